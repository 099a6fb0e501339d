"""reviewer_kernels/rows_linear.py: projections of 1..16 rows through one [16, K] MMA with split-K partials added in a
fixed order, so a row's bits do not depend on how many rows the call has (batch invariance).

The Triton kernel runs on the CPU through Triton's interpreter in a subprocess (fp32 and fp16); on CUDA in bf16.
"""

from __future__ import annotations

import pytest
import torch

from reviewer_kernels.rows_linear import plan, rows_linear, rows_linear_torch
from tests.reviewer_kernels.test_fused_moe import interpreted_by_case

# (dtype, epilogue, N, K, forced SPLITS or None, pipeline stages or None). K not a multiple of 64 (a masked last
# step), several splits, one; the K loop unrolled (stages None: 0) and software-pipelined.
CASES = [
    (dt, *case) for dt in ("float32", "float16") for case in [
        ("norm", 48, 96, None, None),
        ("norm", 40, 200, 3, None),
        ("norm", 40, 330, 2, 3),
        ("plain", 33, 150, 2, None),
        ("residual", 64, 130, None, None),
        ("residual", 64, 300, 1, 2),
        ("swiglu", 64, 96, 2, None),
        ("swiglu", 64, 260, 1, 3),
        ("rope", 4 * 32, 64, 1, None),  # heads of 32: q, k rotated, v passes through
        ("rope", 4 * 32, 100, 2, None),
        ("rope", 4 * 32, 200, 1, 2),
        ("rope16", 4 * 16, 64, None, None),  # heads of 16: half a head is under the MMA's 16 columns (padded)
    ]
]
POSITION = 37


def inputs_for(case, rows: int, device="cpu"):
    dt, epilogue, n, k, splits, stages = case
    g = torch.Generator().manual_seed(n * k + rows)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    dtype = getattr(torch, dt)
    x, w = r(rows, k).to(device, dtype), (r(n, k) / k ** 0.5).to(device, dtype)
    kw = {"eps": 1e-5}
    if epilogue not in ("plain", "residual"):
        kw["norm_weight"] = (torch.rand(k, generator=g) + 0.5).to(device, dtype)
    if epilogue == "residual":
        kw["residual"] = r(rows, n).to(device, dtype)
    if epilogue == "swiglu":
        kw["swiglu"] = True
    if epilogue.startswith("rope"):
        d = 16 if epilogue == "rope16" else 32
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.arange(128).float()[:, None] * inv[None]
        emb = torch.cat((freqs, freqs), -1)
        kw["rope"] = (emb.cos().to(device, dtype), emb.sin().to(device, dtype),
                      torch.arange(POSITION, POSITION + rows, device=device), 3 * d)
    tiles = {"SPLITS": splits, "KS": -(-(-(-k // 64)) // splits) * 64} if splits else {}
    if stages:
        tiles["stages"] = stages
    return x, w, kw, tiles or None


def one_row(kw, t):
    """The keyword arguments of row t alone (its residual row, its position)."""
    one = dict(kw)
    if "residual" in kw:
        one["residual"] = kw["residual"][t:t + 1]
    if "rope" in kw:
        cos, sin, pos, n = kw["rope"]
        one["rope"] = (cos, sin, pos[t:t + 1], n)
    return one


SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.reviewer_kernels.test_rows_linear import CASES, inputs_for, one_row
from reviewer_kernels.rows_linear import rows_linear, rows_linear_torch
for case in CASES:
    x, w, kw, tiles = inputs_for(case, 5)
    y = rows_linear(x, w, use_triton=True, tiles=tiles, **kw)
    ref = rows_linear_torch(x, w, **kw)
    err = float((y.double() - ref.double()).norm() / ref.double().norm())
    alone = torch.cat([rows_linear(x[t:t + 1], w, use_triton=True, tiles=tiles, **one_row(kw, t)) for t in range(5)])
    again = rows_linear(x, w, use_triton=True, tiles=tiles, **kw)  # the counters were left at zero
    print(json.dumps({"case": list(case), "err": err, "rows_equal_alone": torch.equal(y, alone),
                      "repeatable": torch.equal(y, again), "shape": list(y.shape)}), flush=True)
"""


@pytest.fixture(scope="module")
def results():
    return interpreted_by_case(SCRIPT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_pytorch_and_rows_equal_rows_alone_in_interpreter(results, case):
    r = results[tuple(case)]
    assert r["err"] < (1e-5 if case[0] == "float32" else 2e-3), r
    assert r["rows_equal_alone"] and r["repeatable"], r
    n = case[2] // 2 if case[1] == "swiglu" else case[2]
    assert r["shape"] == [5, n]


def test_plan_depends_on_the_shape_only():
    """SPLITS and KS cover K in whole 64-column steps and never depend on T (plan takes no T)."""
    for tiles, k in [(30, 576), (48, 576), (18, 1536), (1536, 576), (193, 2048)]:
        p = plan(tiles, k, 32)
        assert p["KS"] % 64 == 0 and p["SPLITS"] * p["KS"] >= k > (p["SPLITS"] - 1) * p["KS"], p
    assert plan(1536, 576, 32)["SPLITS"] == 1  # the LM head has programs enough without splitting K


def test_fallback_is_the_documented_rounding():
    """The PyTorch twin: W (x * nw) * rstd in fp32 equals the model's rms_norm then F.linear within rounding."""
    x, w, kw, _ = inputs_for(("float32", "norm", 48, 96, None, None), 3)
    xf = x.double()
    ref = (kw["norm_weight"].double() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)) @ w.double().t()
    torch.testing.assert_close(rows_linear(x, w, use_triton=False, **kw).double(), ref, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_clear_errors():
    x, w = torch.randn(2, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match="T <= 16"):
        rows_linear(torch.randn(17, 64), w)
    with pytest.raises(ValueError, match="one epilogue"):
        rows_linear(x, w, swiglu=True, residual=torch.randn(2, 32))
    with pytest.raises(ValueError, match="norm weight"):
        rows_linear(x, w, torch.randn(63))
    with pytest.raises(ValueError, match="residual"):
        rows_linear(x, w, residual=torch.randn(3, 32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [("bfloat16", "rope", (9 + 2 * 3) * 64, 576, None, None),
                                  ("bfloat16", "swiglu", 2 * 1536, 576, None, None),
                                  ("bfloat16", "residual", 576, 1536, None, None),
                                  ("bfloat16", "norm", 49152, 576, None, None),
                                  ("bfloat16", "swiglu", 2 * 1536, 576, 1, 3),
                                  ("bfloat16", "residual", 576, 1536, 2, 3)], ids=lambda c: f"{c[1]}-stages{c[5]}")
@pytest.mark.parametrize("rows", [2, 9, 16])
def test_cuda_bf16_rows_are_batch_invariant_at_the_smollm2_shapes(case, rows):
    x, w, kw, tiles = inputs_for(case, rows, "cuda")
    if "rope" in kw:
        d = 64
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
        emb = torch.cat([torch.arange(2048, device="cuda").float()[:, None] * inv[None]] * 2, -1)
        kw["rope"] = (emb.cos().bfloat16(), emb.sin().bfloat16(), torch.arange(700, 700 + rows, device="cuda"),
                      12 * d)
    block = rows_linear(x, w, tiles=tiles, **kw)
    ref = rows_linear_torch(x, w, **kw)
    assert ((block.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    for t in range(rows):
        assert torch.equal(block[t:t + 1], rows_linear(x[t:t + 1], w, tiles=tiles, **one_row(kw, t))), t
