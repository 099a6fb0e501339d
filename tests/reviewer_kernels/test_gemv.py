"""reviewer_kernels/gemv.py: one token's output projection with its prologue (gated RMSNorm, sigmoid gate), one launch.

The Triton kernel runs on the CPU through Triton's interpreter in a subprocess (fp32 and fp16); on CUDA in bf16.
"""

from __future__ import annotations

import pytest
import torch

from reviewer_kernels.gemv import gemv, gemv_torch
from tests.reviewer_kernels.test_fused_moe import interpreted_by_case

# (dtype, N, K, head size for the gated norm or None, prologue, BN)
CASES = [
    (dt, *case) for dt in ("float32", "float16") for case in [
        (40, 256, 32, "gated_norm", 8),  # several heads
        (64, 512, 128, "gated_norm", 2),  # the 35B-A3B head size
        (24, 384, 128, "gated_norm", 4),  # K not a power of two: a masked padding head
        (33, 96, None, "plain", 4),  # N and K ragged
        (17, 200, None, "sigmoid_gate", 1),
    ]
]

SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.reviewer_kernels.test_gemv import CASES, inputs_for
from reviewer_kernels.gemv import gemv, gemv_torch
for case in CASES:
    x, w, kw = inputs_for(case)
    y = gemv(x, w, use_triton=True, tiles={"BN": case[5], "warps": 2}, **kw)
    ref = gemv_torch(x, w, **kw)  # same dtype, same rounding points
    d = lambda t: t.double() if t is not None else None
    r64 = gemv_torch(d(x), d(w), **{k: d(v) if torch.is_tensor(v) else v for k, v in kw.items()})
    err = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())
    print(json.dumps({"case": list(case), "err_same_dtype": err(y, ref), "err_float64": err(y, r64),
                      "shape": list(y.shape), "dtype": str(y.dtype)}), flush=True)
"""


def inputs_for(case, device="cpu"):
    dt, n, k, head, prologue = case[:5]
    g = torch.Generator().manual_seed(n * k)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    dtype = getattr(torch, dt)
    x, gate, w = r(1, k).to(device, dtype), r(1, k).to(device, dtype), (r(n, k) / k ** 0.5).to(device, dtype)
    kw = {"eps": 1e-6}
    if prologue != "plain":
        kw["gate"] = gate
    if prologue == "gated_norm":
        kw["norm_weight"] = (torch.rand(head, generator=g) + 0.5).to(device, dtype)
    return x, w, kw


@pytest.fixture(scope="module")
def results():
    return interpreted_by_case(SCRIPT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_pytorch_in_interpreter(results, case):
    r = results[tuple(case)]
    assert r["shape"] == [1, case[1]] and r["dtype"] == f"torch.{case[0]}", r
    if case[0] == "float32":
        assert r["err_same_dtype"] < 1e-6 and r["err_float64"] < 1e-6, r
    else:  # fp16: the same rounding points as the eager functions, so at most a last-bit difference on a tie
        assert r["err_same_dtype"] < 1e-3 and r["err_float64"] < 2e-3, r


def test_fallback_is_the_model_math():
    """Without Triton the PyTorch twin runs, and it is qwen3_5_moe's eager gated norm + linear."""
    from backend.models.qwen3_5_moe import gated_rms_norm
    x, w, kw = inputs_for(("float32", 24, 256, 64, "gated_norm"))
    y = gemv(x, w, use_triton=False, **kw)
    ref = torch.nn.functional.linear(
        gated_rms_norm(x.reshape(-1, 64), kw["gate"].reshape(-1, 64), kw["norm_weight"], 1e-6).reshape(1, -1), w)
    assert torch.equal(y, ref)
    x, w, kw = inputs_for(("float32", 24, 256, None, "sigmoid_gate"))
    assert torch.equal(gemv(x, w, use_triton=False, **kw), torch.nn.functional.linear(x * torch.sigmoid(kw["gate"]), w))


RESIDUAL_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.reviewer_kernels.test_gemv import inputs_for
from reviewer_kernels.gemv import gemv
for case in [("float32", 40, 256, 32, "gated_norm"), ("float16", 33, 96, None, "plain"),
             ("float16", 17, 200, None, "sigmoid_gate")]:
    x, w, kw = inputs_for(case)
    res = torch.randn(1, case[1]).to(x.dtype)
    fused = gemv(x, w, residual=res, use_triton=True, **kw)
    print(json.dumps({"case": list(case), "equal": torch.equal(fused, res + gemv(x, w, use_triton=True, **kw))}))
"""


def test_residual_is_added_with_pytorch_rounding():
    """gemv(..., residual=r) is bit for bit r + gemv(...): the model folds its residual add into the projection."""
    results = interpreted_by_case(RESIDUAL_SCRIPT)
    assert len(results) == 3 and all(r["equal"] for r in results.values()), results
    x, w, kw = inputs_for(("float32", 24, 256, 64, "gated_norm"))
    res = torch.randn(1, 24)
    assert torch.equal(gemv(x, w, residual=res, use_triton=False, **kw), res + gemv(x, w, use_triton=False, **kw))


def test_bad_shapes_raise_clear_errors():
    x, w = torch.randn(1, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match=r"x \[T <= 16, K\]"):
        gemv(torch.randn(17, 64), w)
    with pytest.raises(ValueError, match=r"x \[T <= 16, K\]"):
        gemv(x, torch.randn(8, 32))
    with pytest.raises(ValueError, match="gate"):
        gemv(x, w, gate=torch.randn(1, 32))
    with pytest.raises(ValueError, match="norm weight"):
        gemv(x, w, gate=torch.randn(1, 64), norm_weight=torch.randn(48))
    with pytest.raises(ValueError, match="residual"):
        gemv(x, w, residual=torch.randn(1, 64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prologue", ["gated_norm", "sigmoid_gate", "plain"])
def test_cuda_bf16_matches_pytorch(prologue):
    """The 35B-A3B output projection's shape in bf16: within bf16 rounding of the eager functions + cuBLAS."""
    x, w, kw = inputs_for(("bfloat16", 2048, 4096, 128 if prologue == "gated_norm" else None, prologue), "cuda")
    y, ref = gemv(x, w, **kw), gemv_torch(x, w, **kw)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    assert torch.equal(y, gemv(x, w, **kw))


ROWS_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.reviewer_kernels.test_gemv import CASES, rows_inputs
from reviewer_kernels.gemv import gemv
for i, case in enumerate(CASES):
    x, w, kw, res = rows_inputs(case, 5)
    block = gemv(x, w, residual=res, use_triton=True, tiles={"BN": case[5], "warps": 2}, **kw)
    alone = [gemv(x[t:t + 1], w, residual=res[t:t + 1], use_triton=True, tiles={"BN": case[5], "warps": 2},
                  **{k: v[t:t + 1] if k == "gate" else v for k, v in kw.items()}) for t in range(5)]
    print(json.dumps({"case": [i], "equal": torch.equal(block, torch.cat(alone))}), flush=True)
"""


def rows_inputs(case, rows: int, device="cpu"):
    """A block of `rows` inputs (gates and residuals too) for a CASES entry."""
    x, w, kw = inputs_for(case, device)
    g = torch.Generator().manual_seed(rows)
    more = lambda: torch.randn(rows, x.shape[1], generator=g).to(device, x.dtype)  # noqa: E731
    x = more()
    if "gate" in kw:
        kw["gate"] = more()
    return x, w, kw, torch.randn(rows, w.shape[0], generator=g).to(device, x.dtype)


def test_rows_of_a_block_equal_rows_alone_in_interpreter():
    """Batch invariance: row t of a T-row call is bit for bit the one-row call on row t (a verify block's position
    gets a decode step's bits)."""
    results = interpreted_by_case(ROWS_SCRIPT)
    assert len(results) == len(CASES) and all(r["equal"] for r in results.values()), results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prologue", ["gated_norm", "sigmoid_gate", "plain"])
@pytest.mark.parametrize("rows", [2, 7, 16])
def test_cuda_bf16_rows_are_batch_invariant(prologue, rows):
    case = ("bfloat16", 2048, 4096, 128 if prologue == "gated_norm" else None, prologue)
    x, w, kw, res = rows_inputs(case, rows, "cuda")
    block = gemv(x, w, residual=res, **kw)
    for t in range(rows):
        alone = gemv(x[t:t + 1], w, residual=res[t:t + 1], **{k: v[t:t + 1] if k == "gate" else v
                                                               for k, v in kw.items()})
        assert torch.equal(block[t:t + 1], alone), t
