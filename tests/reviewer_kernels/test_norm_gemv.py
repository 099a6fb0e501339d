"""reviewer_kernels/norm_gemv.py: one token's RMSNorm + projection + epilogue (RoPE, SwiGLU, none) in one launch.

The Triton kernel runs on the CPU through Triton's interpreter in a subprocess (fp32 and fp16); on CUDA in bf16.
The reference is backend/models/llama.py's own math (rms_norm, F.linear, apply_rope, SiLU), not the kernel's twin.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.models.llama import apply_rope, rms_norm, rope_tables
from reviewer_kernels.norm_gemv import norm_gemv
from tests.reviewer_kernels.test_fused_moe import interpreted_by_case

# (dtype, K, epilogue, shape, BN): shape = (heads, kv heads, head size) for rope, rows otherwise
CASES = [
    (dt, *case) for dt in ("float32", "float16") for case in [
        (96, "rope", (4, 2, 16), 2),  # grouped KV heads; K not a power of two
        (64, "rope", (2, 1, 32), 16),  # BN = half the head
        (48, "rope", (3, 3, 8), 8),  # BN larger than half a head: clamped to it
        (96, "swiglu", 50, 4),  # gate/up rows not a multiple of BN
        (40, "swiglu", 64, 1),
        (96, "plain", 37, 8),  # the LM head's case: ragged rows
    ]
]
POSITION = 37

SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.reviewer_kernels.test_norm_gemv import CASES, inputs_for, model_math
from reviewer_kernels.norm_gemv import norm_gemv, norm_gemv_torch
for i, case in enumerate(CASES):
    x, nw, w, kw = inputs_for(case)
    y = norm_gemv(x, nw, w, 1e-5, use_triton=True, tiles={"BN": case[4], "warps": 2}, **kw)
    err = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())
    print(json.dumps({"case": [i], "err_twin": err(y, norm_gemv_torch(x, nw, w, 1e-5, **kw)),
                      "err_model": err(y, model_math(case, x, nw, w)), "shape": list(y.shape),
                      "dtype": str(y.dtype)}), flush=True)
"""


def inputs_for(case, device="cpu"):
    dt, k, epilogue, shape = case[:4]
    dtype = getattr(torch, dt)
    g = torch.Generator().manual_seed(k * 7 + len(epilogue))
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, nw = r(1, k).to(device, dtype), (torch.rand(k, generator=g) + 0.5).to(device, dtype)
    kw = {}
    if epilogue == "rope":
        heads, kv_heads, d = shape
        rows = (heads + 2 * kv_heads) * d
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        cos, sin = rope_tables(inv_freq, 1.0, 64, dtype)
        kw["rope"] = (cos.to(device), sin.to(device), torch.tensor([POSITION], device=device),
                      (heads + kv_heads) * d)
    else:
        rows = 2 * shape if epilogue == "swiglu" else shape
        kw["swiglu"] = epilogue == "swiglu"
    return x, nw, (r(rows, k) / k ** 0.5).to(device, dtype), kw


def model_math(case, x, nw, w):
    """What backend/models/llama.py computes for the same step, its elementwise tails in fp32 (as compiled)."""
    y = F.linear(rms_norm(x, nw, 1e-5), w)
    if case[2] == "swiglu":
        gate, up = y.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(y.dtype)
    if case[2] == "rope":
        heads, kv_heads, d = case[3]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        cos, sin = rope_tables(inv_freq.to(x.device), 1.0, 64, x.dtype)
        rotated = (heads + kv_heads) * d
        qk = apply_rope(y[:, :rotated].float().view(1, heads + kv_heads, d).transpose(0, 1),
                        cos[POSITION:POSITION + 1].float(), sin[POSITION:POSITION + 1].float())
        return torch.cat([qk.transpose(0, 1).reshape(1, rotated).to(y.dtype), y[:, rotated:]], dim=-1)
    return y


@pytest.fixture(scope="module")
def results():
    return interpreted_by_case(SCRIPT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_the_model_math_in_interpreter(results, case):
    r = results[(CASES.index(case),)]  # keyed by index: a case holds a tuple, which JSON would turn into a list
    rows = (case[3][0] + 2 * case[3][1]) * case[3][2] if case[2] == "rope" else case[3]
    assert r["shape"] == [1, rows] and r["dtype"] == f"torch.{case[0]}", r
    if case[0] == "float32":
        assert r["err_twin"] < 1e-6 and r["err_model"] < 1e-6, r
    else:  # fp16: the same rounding points, so at most a last-bit difference on a tie
        assert r["err_twin"] < 1e-3 and r["err_model"] < 1e-3, r


def test_fallback_is_the_model_math():
    """Without Triton the PyTorch twin runs, and it is llama.py's norm, projection and RoPE / SwiGLU."""
    for case in CASES[:6]:
        x, nw, w, kw = inputs_for(case)
        torch.testing.assert_close(norm_gemv(x, nw, w, 1e-5, use_triton=False, **kw), model_math(case, x, nw, w),
                                   rtol=1e-6, atol=1e-6)


def test_bad_inputs_raise_clear_errors():
    x, nw, w = torch.randn(1, 64), torch.randn(64), torch.randn(8, 64)
    cos = sin = torch.randn(16, 16)
    pos = torch.tensor([3])
    with pytest.raises(ValueError, match=r"x \[T <= 16, K\]"):
        norm_gemv(torch.randn(17, 64), nw, w, 1e-5)
    with pytest.raises(ValueError, match="norm weight"):
        norm_gemv(x, torch.randn(32), w, 1e-5)
    with pytest.raises(ValueError, match="one epilogue"):
        norm_gemv(x, nw, torch.randn(32, 64), 1e-5, swiglu=True, rope=(cos, sin, pos, 16))
    with pytest.raises(ValueError, match="even"):
        norm_gemv(x, nw, torch.randn(7, 64), 1e-5, swiglu=True)
    with pytest.raises(ValueError, match="whole heads"):
        norm_gemv(x, nw, torch.randn(40, 64), 1e-5, rope=(cos, sin, pos, 16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [("bfloat16", 576, "rope", (9, 3, 64), 4), ("bfloat16", 576, "swiglu", 1536, 4),
                                  ("bfloat16", 576, "plain", 49152, 4)], ids=lambda c: c[2])
def test_cuda_bf16_at_the_smollm2_shapes(case):
    """The SmolLM2-135M decode step's q/k/v, gate/up and LM head: within bf16 rounding of the model's math, and the
    same bits on a second call."""
    x, nw, w, kw = inputs_for(case, "cuda")
    y, ref = norm_gemv(x, nw, w, 1e-5, **kw), model_math(case, x, nw, w)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    assert torch.equal(y, norm_gemv(x, nw, w, 1e-5, **kw))


ROWS_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.reviewer_kernels.test_norm_gemv import CASES, rows_inputs
from reviewer_kernels.norm_gemv import norm_gemv
for i, case in enumerate(CASES):
    x, nw, w, kw = rows_inputs(case, 4)
    tiles = {"BN": case[4], "warps": 2}
    block = norm_gemv(x, nw, w, 1e-5, use_triton=True, tiles=tiles, **kw)
    alone = []
    for t in range(4):
        one = dict(kw)
        if "rope" in kw:
            cos, sin, pos, n = kw["rope"]
            one["rope"] = (cos, sin, pos[t:t + 1], n)
        alone.append(norm_gemv(x[t:t + 1], nw, w, 1e-5, use_triton=True, tiles=tiles, **one))
    print(json.dumps({"case": [i], "equal": torch.equal(block, torch.cat(alone))}), flush=True)
"""


def rows_inputs(case, rows: int, device="cpu"):
    """`rows` input rows for a CASES entry, each at its own position under RoPE."""
    x, nw, w, kw = inputs_for(case, device)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, x.shape[1], generator=g).to(device, x.dtype)
    if "rope" in kw:
        cos, sin, _, n = kw["rope"]
        kw["rope"] = (cos, sin, torch.arange(POSITION, POSITION + rows, device=device), n)
    return x, nw, w, kw


def test_rows_of_a_block_equal_rows_alone_in_interpreter():
    """Batch invariance: row t of a T-row call (RoPE at its own position) is bit for bit the one-row call."""
    results = interpreted_by_case(ROWS_SCRIPT)
    assert len(results) == len(CASES) and all(r["equal"] for r in results.values()), results


def test_fallback_rows_rotate_at_their_own_positions():
    """The PyTorch twin (CPU BLAS: not batch-invariant, so within fp32 rounding) rotates row t at positions[t]."""
    case = CASES[0]
    x, nw, w, kw = rows_inputs(case, 3)
    cos, sin, pos, n = kw["rope"]
    block = norm_gemv(x, nw, w, 1e-5, use_triton=False, **kw)
    for t in range(3):
        one = norm_gemv(x[t:t + 1], nw, w, 1e-5, use_triton=False, rope=(cos, sin, pos[t:t + 1], n))
        torch.testing.assert_close(block[t:t + 1], one, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [("bfloat16", 576, "rope", (9, 3, 64), 4), ("bfloat16", 576, "swiglu", 1536, 4),
                                  ("bfloat16", 576, "plain", 49152, 4)], ids=lambda c: c[2])
@pytest.mark.parametrize("rows", [2, 9, 16])
def test_cuda_bf16_rows_are_batch_invariant(case, rows):
    x, nw, w, kw = rows_inputs(case, rows, "cuda")
    block = norm_gemv(x, nw, w, 1e-5, **kw)
    for t in range(rows):
        one = dict(kw)
        if "rope" in kw:
            cos, sin, pos, n = kw["rope"]
            one["rope"] = (cos, sin, pos[t:t + 1], n)
        assert torch.equal(block[t:t + 1], norm_gemv(x[t:t + 1], nw, w, 1e-5, **one)), t
