"""reviewer_kernels/wide_linear.py: the invariant steps' wide projections as one [BN, BK] x [BK, 16] MMA per step with
split-K partials added in a fixed order: a row's bits do not depend on how many rows the call has, nor on their values.

The Triton kernel runs on the CPU through Triton's interpreter in a subprocess (fp32 and fp16); on CUDA in bf16.
"""

from __future__ import annotations

import pytest
import torch

from reviewer_kernels.wide_linear import wide_linear, wide_linear_torch
from tests.reviewer_kernels.test_fused_moe import interpreted_by_case

# (dtype, N, K, BN, BK, SPLITS). N not a multiple of BN (masked tile rows), K not a multiple of BK (a masked last
# step), several splits and one, a split count that does not divide the steps.
CASES = [
    (dt, *case) for dt in ("float32", "float16") for case in [
        (40, 192, 16, 64, 1),
        (96, 256, 32, 64, 2),
        (72, 200, 32, 64, 3),
        (64, 320, 32, 128, 2),
        (33, 128, 16, 32, 4),
    ]
]


def inputs_for(case, rows: int, device="cpu"):
    dt, n, k, bn, bk, splits = case
    g = torch.Generator().manual_seed(n * k + rows)
    dtype = getattr(torch, dt)
    x, w = torch.randn(rows, k, generator=g).to(device, dtype), (torch.randn(n, k, generator=g) / k ** 0.5).to(
        device, dtype)
    return x, w, {"BN": bn, "BK": bk, "SPLITS": splits, "stages": 2, "warps": 4}


SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.reviewer_kernels.test_wide_linear import CASES, inputs_for
from reviewer_kernels.wide_linear import wide_linear, wide_linear_torch
for case in CASES:
    x, w, tiles = inputs_for(case, 5)
    y = wide_linear(x, w, use_triton=True, tiles=tiles)
    ref = wide_linear_torch(x, w)
    err = float((y.double() - ref.double()).norm() / ref.double().norm())
    alone = torch.cat([wide_linear(x[t:t + 1], w, use_triton=True, tiles=tiles) for t in range(5)])
    again = wide_linear(x, w, use_triton=True, tiles=tiles)  # the counters were left at zero
    # the residual add and the sums of squares in the epilogue: the same y plus the residual, rounded as PyTorch
    # adds, and per tile of columns each row's sum of squares (rows past T zero)
    res = torch.randn(5, case[1]).to(x.dtype)
    s, ss = wide_linear(x, w, use_triton=True, tiles=tiles, residual=res, sumsq=True)
    want = (res.float() + y.float()).to(y.dtype)
    tiles_n = -(-case[1] // case[3])
    ss_ref = torch.zeros(tiles_n, 16, dtype=torch.float64)
    for p in range(tiles_n):
        ss_ref[p, :5] = want[:, p * case[3]:(p + 1) * case[3]].double().pow(2).sum(1)
    print(json.dumps({"case": list(case), "err": err, "rows_equal_alone": torch.equal(y, alone),
                      "repeatable": torch.equal(y, again), "shape": list(y.shape),
                      "residual_equal": torch.equal(s, want), "sumsq_shape": list(ss.shape),
                      "sumsq_err": float((ss.double() - ss_ref).abs().max() / ss_ref.abs().max())}), flush=True)
"""


@pytest.fixture(scope="module")
def results():
    return interpreted_by_case(SCRIPT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_pytorch_and_rows_equal_rows_alone_in_interpreter(results, case):
    r = results[tuple(case)]
    assert r["err"] < (1e-5 if case[0] == "float32" else 2e-3), r
    assert r["rows_equal_alone"] and r["repeatable"], r
    assert r["shape"] == [5, case[1]]
    assert r["residual_equal"] and r["sumsq_shape"] == [-(-case[1] // case[3]), 16], r
    assert r["sumsq_err"] < (1e-6 if case[0] == "float32" else 1e-3), r


def test_fallback_residual_and_sums_of_squares():
    """Off Triton: residual + y rounded as PyTorch adds, one range of columns holding each row's whole sum."""
    x, w, _ = inputs_for(("float32", 48, 128, 16, 64, 1), 3)
    res = torch.randn(3, 48)
    s, ss = wide_linear(x, w, use_triton=False, residual=res, sumsq=True)
    assert torch.equal(s, res + wide_linear_torch(x, w))
    assert ss.shape == (1, 16) and torch.allclose(ss[0, :3], s.pow(2).sum(1)) and not ss[0, 3:].any()
    with pytest.raises(ValueError, match="residual"):
        wide_linear(x, w, residual=res[:, :40])


def test_fallback_is_the_product_rounded_once():
    x, w, _ = inputs_for(("float16", 48, 128, 16, 64, 1), 3)
    y = (x.double() @ w.double().t()).to(torch.float16)
    torch.testing.assert_close(wide_linear(x, w, use_triton=False), y, rtol=1e-3, atol=1e-3)


def test_bad_inputs_raise_clear_errors():
    x, w = torch.randn(2, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match="T <= 16"):
        wide_linear(torch.randn(17, 64), w)
    with pytest.raises(ValueError, match="T <= 16"):
        wide_linear(x, torch.randn(32, 63))
    with pytest.raises(ValueError, match="T <= 16"):
        wide_linear(x[0], w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(12352, 2048), (9216, 2048), (2048, 4096)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_cuda_bf16_rows_are_batch_invariant_at_the_35b_a3b_shapes(shape):
    """At the served shapes and their launch shapes (TUNED): each row of a 16-row call equals the row alone and the
    row among other neighbours, and the call is within bf16 rounding of the float32 product."""
    n, k = shape
    torch.manual_seed(n + k)
    x, w = torch.randn(16, k, device="cuda").bfloat16(), (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
    block = wide_linear(x, w)
    ref = x.float() @ w.float().t()
    assert ((block.float() - ref).norm() / ref.norm()).item() < 1e-2
    fp32 = wide_linear(x.float(), w.float())  # a float32 model (or reference) at the same shape fits too
    assert ((fp32 - ref).norm() / ref.norm()).item() < 1e-5
    others = torch.randn_like(x)
    for t in (0, 7, 15):
        assert torch.equal(block[t:t + 1], wide_linear(x[t:t + 1], w)), t
        others[t] = x[t]
        assert torch.equal(block[t], wide_linear(others, w)[t]), t
