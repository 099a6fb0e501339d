"""kernels/rows_linear.py: a decode step's or a verify block's projection on the tensor cores, the same kernel for
1..16 rows, so a row's bits do not depend on how many rows came with it (what lossless bf16 speculation needs).

The Triton kernel runs on the CPU through Triton's interpreter in a subprocess (fp32 and fp16); on CUDA in bf16.
The reference is backend/models/llama.py's own math (rms_norm, F.linear, apply_rope, SiLU, the residual add)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.models.llama import apply_rope, rms_norm, rope_tables
from kernels.rows_linear import rows_linear
from tests.test_fused_moe import interpreted_by_case

# (dtype, K, epilogue, shape): shape = (heads, kv heads, head size) for rope, output rows otherwise
CASES = [(dt, *case) for dt in ("float32", "float16") for case in [
    (96, "rope", (2, 1, 32)),  # K not a multiple of the K step: a masked tail
    (64, "swiglu", 40),  # output rows not a multiple of the column tile
    (80, "norm", 37),  # the LM head's case
    (96, "residual", 33),  # output and down projections
]]
POSITION = 11

SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.test_rows_linear import CASES, inputs_for, model_math, one_row
from kernels.rows_linear import rows_linear
tiles = {"BN": 16, "BK": 32, "warps": 2, "stages": 2}
err = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())
for i, case in enumerate(CASES):
    x, w, kw = inputs_for(case, 5)
    y = rows_linear(x, w, use_triton=True, tiles=tiles, **kw)
    alone = torch.cat([rows_linear(x[t:t + 1], w, use_triton=True, tiles=tiles, **one_row(kw, t)) for t in range(5)])
    print(json.dumps({"case": [i], "err_model": err(y, model_math(case, x, w, kw)), "shape": list(y.shape),
                      "rows_equal": torch.equal(y, alone)}), flush=True)
"""


def one_row(kw, t):
    """The keyword arguments of row t alone: its position under RoPE, its residual row."""
    out = dict(kw)
    if "rope" in kw:
        cos, sin, pos, n = kw["rope"]
        out["rope"] = (cos, sin, pos[t:t + 1], n)
    if "residual" in kw:
        out["residual"] = kw["residual"][t:t + 1]
    return out


def inputs_for(case, rows, device="cpu"):
    dt, k, epilogue, shape = case
    dtype = getattr(torch, dt)
    g = torch.Generator().manual_seed(k * 7 + len(epilogue) + rows)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, kw = r(rows, k).to(device, dtype), {}
    if epilogue in ("rope", "swiglu", "norm"):
        kw["norm"] = ((torch.rand(k, generator=g) + 0.5).to(device, dtype), 1e-5)
    if epilogue == "rope":
        heads, kv_heads, d = shape
        n = (heads + 2 * kv_heads) * d
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        cos, sin = rope_tables(inv_freq, 1.0, 64, dtype)
        kw["rope"] = (cos.to(device), sin.to(device), torch.arange(POSITION, POSITION + rows, device=device),
                      (heads + kv_heads) * d)
    else:
        n = 2 * shape if epilogue == "swiglu" else shape
        kw["swiglu"] = epilogue == "swiglu"
    if epilogue == "residual":
        kw["residual"] = r(rows, n).to(device, dtype)
    return x, (r(n, k) / k ** 0.5).to(device, dtype), kw


def model_math(case, x, w, kw):
    """What backend/models/llama.py computes, its elementwise tails in fp32."""
    y = F.linear(rms_norm(x, kw["norm"][0], kw["norm"][1]) if "norm" in kw else x, w)
    if case[2] == "swiglu":
        gate, up = y.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(y.dtype)
    if case[2] == "rope":
        cos, sin, pos, rotated = kw["rope"]
        heads, kv_heads, d = case[3]
        rows = x.shape[0]
        qk = apply_rope(y[:, :rotated].float().view(rows, heads + kv_heads, d).transpose(0, 1),
                        cos[pos].float(), sin[pos].float())
        return torch.cat([qk.transpose(0, 1).reshape(rows, rotated).to(y.dtype), y[:, rotated:]], dim=-1)
    if case[2] == "residual":
        return (kw["residual"].float() + y.float()).to(y.dtype)
    return y


@pytest.fixture(scope="module")
def results():
    return interpreted_by_case(SCRIPT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_the_model_math_and_rows_alone_in_interpreter(results, case):
    r = results[(CASES.index(case),)]
    assert r["rows_equal"], r  # batch invariance: a 5-row call == five 1-row calls, bit for bit
    assert r["err_model"] < (1e-5 if case[0] == "float32" else 2e-3), r


def test_fallback_is_the_model_math_and_bad_inputs_raise():
    for case in CASES[:4]:
        x, w, kw = inputs_for(case, 3)
        torch.testing.assert_close(rows_linear(x, w, use_triton=False, **kw), model_math(case, x, w, kw),
                                   rtol=1e-6, atol=1e-6)
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match=r"x \[T <= 16, K\]"):
        rows_linear(torch.randn(17, 64), w)
    with pytest.raises(ValueError, match="one epilogue"):
        rows_linear(x, torch.randn(8, 64), swiglu=True, residual=torch.randn(2, 4))
    with pytest.raises(ValueError, match="even"):
        rows_linear(x, torch.randn(7, 64), swiglu=True)
    with pytest.raises(ValueError, match="residual"):
        rows_linear(x, w, residual=torch.randn(1, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [("bfloat16", 576, "rope", (9, 3, 64)), ("bfloat16", 576, "swiglu", 1536),
                                  ("bfloat16", 576, "norm", 49152), ("bfloat16", 1536, "residual", 576)],
                         ids=lambda c: c[2])
@pytest.mark.parametrize("rows", [2, 9, 16])
def test_cuda_bf16_at_the_smollm2_shapes_is_batch_invariant(case, rows):
    """Within bf16 rounding of the model's math, and each row of a block bitwise the row computed alone."""
    x, w, kw = inputs_for(case, rows, "cuda")
    y, ref = rows_linear(x, w, **kw), model_math(case, x, w, kw)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    for t in range(rows):
        assert torch.equal(y[t:t + 1], rows_linear(x[t:t + 1], w, **one_row(kw, t))), t
