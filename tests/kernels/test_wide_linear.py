"""kernels/wide_linear.py: the invariant steps' wide projections as one [BN, BK] x [BK, 16] MMA per step, the prologue
(RMSNorm, per-head gated RMSNorm, sigmoid gate) in the same launch, split-K partials added in a fixed order: a row's
bits do not depend on how many rows the call has, nor on their values.

The Triton kernel runs on the CPU through Triton's interpreter in a subprocess (fp32 and fp16); on CUDA in bf16.
"""

from __future__ import annotations

import pytest
import torch

from backend.models.qwen3_5_moe import gated_rms_norm, qwen_rms_norm
from kernels.wide_linear import wide_linear, wide_linear_torch
from tests.kernels.test_fused_moe import interpreted_by_case

# (dtype, prologue, N, K, BN, BK, SPLITS). N not a multiple of BN (masked tile rows), several splits and one, K steps of
# whole heads (gated: head 32), a K range that a split covers only in part.
CASES = [
    (dt, *case) for dt in ("float32", "float16") for case in [
        ("plain", 40, 192, 16, 64, 1),
        ("norm", 96, 256, 32, 64, 2),
        ("norm", 72, 320, 32, 128, 2),
        ("gated", 64, 256, 32, 128, 3),
        ("gated", 33, 128, 16, 64, 1),
        ("sigmoid", 96, 256, 32, 64, 4),
        ("residual", 64, 192, 32, 64, 2),
    ]
]
HEAD = 32  # the gated norm's head size in CASES


def inputs_for(case, rows: int, device="cpu"):
    dt, prologue, n, k, bn, bk, splits = case
    g = torch.Generator().manual_seed(n * k + rows)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    dtype = getattr(torch, dt)
    x, w = r(rows, k).to(device, dtype), (r(n, k) / k ** 0.5).to(device, dtype)
    kw = {"eps": 1e-5}
    if prologue == "norm":
        kw["norm_weight"] = (torch.rand(k, generator=g) + 0.5).to(device, dtype)
    if prologue in ("gated", "sigmoid"):
        kw["gate"] = r(rows, k).to(device, dtype)
    if prologue == "gated":
        kw["head_norm"] = (torch.rand(HEAD, generator=g) + 0.5).to(device, dtype)
    if prologue == "residual":
        kw["residual"] = r(rows, n).to(device, dtype)
    return x, w, kw, {"BN": bn, "BK": bk, "SPLITS": splits, "stages": 2, "warps": 4}


def one_row(kw, t):
    """The keyword arguments of row t alone (its gate and residual rows)."""
    return {key: (v[t:t + 1] if key in ("gate", "residual") else v) for key, v in kw.items()}


SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.kernels.test_wide_linear import CASES, inputs_for, one_row
from kernels.wide_linear import wide_linear, wide_linear_torch
for case in CASES:
    x, w, kw, tiles = inputs_for(case, 5)
    y = wide_linear(x, w, use_triton=True, tiles=tiles, **kw)
    ref = wide_linear_torch(x, w, **kw)
    err = float((y.double() - ref.double()).norm() / ref.double().norm())
    alone = torch.cat([wide_linear(x[t:t + 1], w, use_triton=True, tiles=tiles, **one_row(kw, t)) for t in range(5)])
    again = wide_linear(x, w, use_triton=True, tiles=tiles, **kw)  # the counters were left at zero
    print(json.dumps({"case": list(case), "err": err,
                      "rows_equal_alone": torch.equal(y, alone), "repeatable": torch.equal(y, again),
                      "shape": list(y.shape)}), flush=True)
"""


@pytest.fixture(scope="module")
def results():
    return interpreted_by_case(SCRIPT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_pytorch_and_rows_equal_rows_alone_in_interpreter(results, case):
    r = results[tuple(case)]
    assert r["err"] < (1e-5 if case[0] == "float32" else 2e-3), r
    assert r["rows_equal_alone"] and r["repeatable"], r
    assert r["shape"] == [5, case[2]]


def test_fallback_is_the_models_own_prologue_then_the_projection():
    """The PyTorch twin against the model's functions in float64: the RMSNorm applied as W (x * nw) * rstd, and the
    gated norm and sigmoid gate exactly as backend/models/qwen3_5_moe.py computes them before its projection."""
    x, w, kw, _ = inputs_for(("float32", "norm", 48, 128, 16, 64, 1), 3)
    ref = qwen_rms_norm(x.double(), kw["norm_weight"].double(), 1e-5) @ w.double().t()
    torch.testing.assert_close(wide_linear(x, w, use_triton=False, **kw).double(), ref, rtol=1e-5, atol=1e-5)
    x, w, kw, _ = inputs_for(("float32", "gated", 48, 128, 16, 64, 1), 3)
    normed = gated_rms_norm(x.view(-1, HEAD), kw["gate"].view(-1, HEAD), kw["head_norm"], 1e-5).view(3, -1)
    torch.testing.assert_close(wide_linear(x, w, use_triton=False, **kw), normed @ w.t(), rtol=1e-5, atol=1e-5)
    x, w, kw, _ = inputs_for(("float32", "sigmoid", 48, 128, 16, 64, 1), 3)
    torch.testing.assert_close(wide_linear(x, w, use_triton=False, **kw),
                               (x * torch.sigmoid(kw["gate"])) @ w.t(), rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_clear_errors():
    x, w = torch.randn(2, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match="T <= 16"):
        wide_linear(torch.randn(17, 64), w)
    with pytest.raises(ValueError, match="RMSNorm's weight"):
        wide_linear(x, w, torch.randn(63))
    with pytest.raises(ValueError, match="RMSNorm's weight"):
        wide_linear(x, w, torch.randn(64), gate=torch.randn(2, 64))
    with pytest.raises(ValueError, match="gate"):
        wide_linear(x, w, gate=torch.randn(3, 64))
    with pytest.raises(ValueError, match="head size"):
        wide_linear(x, w, gate=torch.randn(2, 64), head_norm=torch.randn(24))
    with pytest.raises(ValueError, match="residual"):
        wide_linear(x, w, residual=torch.randn(3, 32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [("norm", 12352, 2048), ("norm", 9216, 2048), ("gated", 2048, 4096),
                                   ("sigmoid", 2048, 4096)], ids=lambda s: f"{s[0]}-{s[1]}x{s[2]}")
def test_cuda_bf16_rows_are_batch_invariant_at_the_35b_a3b_shapes(shape):
    """At the served shapes and launch shapes (TUNED): each row of a 16-row call equals the row alone and the row
    among other neighbours, and the call is within bf16 rounding of the float32 twin."""
    prologue, n, k = shape
    torch.manual_seed(n + k)
    x, w = torch.randn(16, k, device="cuda").bfloat16(), (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
    kw = {"eps": 1e-6}
    if prologue == "norm":
        kw["norm_weight"] = torch.rand(k, device="cuda") + 0.5  # (1 + weight) in fp32, as the model holds it
    else:
        kw["gate"] = torch.randn(16, k, device="cuda").bfloat16()
    if prologue == "gated":
        kw["head_norm"] = (torch.rand(128, device="cuda") + 0.5).bfloat16()
    block = wide_linear(x, w, **kw)
    ref = wide_linear_torch(x, w, **kw)
    assert ((block.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    others = torch.randn_like(x)
    others_kw = {key: (torch.randn_like(v) if key == "gate" else v) for key, v in kw.items()}
    for t in (0, 7, 15):
        assert torch.equal(block[t:t + 1], wide_linear(x[t:t + 1], w, **one_row(kw, t))), t
        others[t] = x[t]
        if "gate" in kw:
            others_kw["gate"][t] = kw["gate"][t]
        assert torch.equal(block[t], wide_linear(others, w, **others_kw)[t]), t
