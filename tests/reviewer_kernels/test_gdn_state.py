"""reviewer_kernels/gdn_state.py's prefill form: the chunk terms, the triangular solve and the walk as Triton launches
against the batched PyTorch terms and loop; the solve alone against float64.

Under Triton's CPU interpreter (a subprocess, fp32) and, on a GPU, in bf16 inputs with the fp32 state. The loop itself
is checked against transformers' token-by-token recurrence in tests/backend/models/test_fast_models.py.
"""

from __future__ import annotations

import pytest
import torch

from reviewer_kernels import gdn_state
from reviewer_kernels.gdn_state import gdn_chunked, gdn_recurrent_torch
from tests.reviewer_kernels.test_fused_moe import interpreted_by_case

# (T, key heads, value heads, key dim, value dim, chunk): one partial chunk, several chunks with padding, grouped heads,
# the model's chunk of 64
CASES = [(9, 1, 1, 16, 32, 16), (70, 1, 2, 16, 32, 16), (200, 2, 4, 32, 64, 32), (130, 2, 4, 16, 32, 64)]


def make_case(T, hk, hv, dk, dv, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator(device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    q, k, v = r(T, hk, dk).to(dtype), r(T, hk, dk).to(dtype), r(T, hv, dv).to(dtype)
    gate = -torch.rand(T, hv, generator=g, device=device) * 0.5
    beta = torch.rand(T, hv, generator=g, device=device)
    return q, k, v, gate, beta, r(hv, dk, dv)


INTERPRETER_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from reviewer_kernels import gdn_state
from reviewer_kernels.gdn_state import gdn_chunked, gdn_recurrent_torch
from tests.reviewer_kernels.test_gdn_state import CASES, make_case
for case in CASES:
    q, k, v, g, beta, s0 = make_case(*case[:5])
    loop_state, walk_state, token_state = s0.clone(), s0.clone(), s0.clone()
    loop = gdn_chunked(q, k, v, g, beta, loop_state, chunk=case[5], use_triton=False)
    walk = gdn_chunked(q, k, v, g, beta, walk_state, chunk=case[5], use_triton=True)
    token = gdn_recurrent_torch(q, k, v, g, beta, token_state, token_state, every_position=False)
    # q, k, v as the model hands them: views into one projection row (strided tokens), the gates as computed
    wide = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1), v.flatten(1)[:, :5]], 1)
    qs, ks, vs = wide[:, :q[0].numel()], wide[:, q[0].numel():2 * q[0].numel()], wide[:, 2 * q[0].numel():]
    strided = gdn_chunked(qs.view(q.shape), ks.view(k.shape), vs[:, :v[0].numel()].view(v.shape), g, beta, s0.clone(),
                          chunk=case[5], use_triton=True)
    gdn_state.WALK, split_state = "split", s0.clone()  # the state's walk, then every chunk's output at once
    split = gdn_chunked(q, k, v, g, beta, split_state, chunk=case[5], use_triton=True)
    gdn_state.CHUNK_DOT, split3_state = "3xtf32", s0.clone()  # its products as three tf32 ones each
    split3 = gdn_chunked(q, k, v, g, beta, split3_state, chunk=case[5], use_triton=True)
    gdn_state.WALK, gdn_state.CHUNK_DOT = "fused", "ieee"
    print(json.dumps({"case": case, "strided_same": torch.equal(strided, walk),
                      "split_out_vs_loop": (split - loop).abs().max().item(),
                      "split_state_vs_loop": (split_state - loop_state).abs().max().item(),
                      "split3_out_vs_loop": (split3 - loop).abs().max().item(),
                      "split3_state_vs_loop": (split3_state - loop_state).abs().max().item(),
                      "out_vs_loop": (walk - loop).abs().max().item(),
                      "state_vs_loop": (walk_state - loop_state).abs().max().item(),
                      "out_vs_tokens": (walk - token).abs().max().item(),
                      "state_vs_tokens": (walk_state - token_state).abs().max().item(),
                      "scale": token.abs().max().item()}))
"""


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted_by_case(INTERPRETER_SCRIPT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_chunk_kernels_match_the_loop_and_the_token_recurrence(interpreter_results, case):
    r = interpreter_results[tuple(case)]
    assert r["scale"] > 0.1, r  # outputs that are not all zero
    assert r["strided_same"], r  # inputs read where they lie: the same bits as from contiguous copies
    assert r["out_vs_loop"] < 1e-5 and r["state_vs_loop"] < 1e-5, r
    assert r["split_out_vs_loop"] < 1e-5 and r["split_state_vs_loop"] < 1e-5, r  # WALK "split"
    assert r["split3_out_vs_loop"] < 1e-5 and r["split3_state_vs_loop"] < 1e-5, r  # and CHUNK_DOT "3xtf32"
    assert r["out_vs_tokens"] < 1e-4 and r["state_vs_tokens"] < 1e-4, r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("form", ["fused", "split", "split-3xtf32"])
@pytest.mark.parametrize("T", [300, 1024])
def test_chunk_kernels_on_cuda_at_the_35b_shape(T, form, monkeypatch):
    # the 35B-A3B shape's heads (16 key, 32 value, dims 128), prefill pieces of an agent turn's size; the walk's
    # two forms (gdn_state.WALK), the split one also with its products as three tf32 ones (CHUNK_DOT "3xtf32")
    monkeypatch.setattr(gdn_state, "WALK", form.split("-")[0])
    if form.endswith("3xtf32"):
        monkeypatch.setattr(gdn_state, "CHUNK_DOT", "3xtf32")
    q, k, v, g, beta, s0 = make_case(T, 16, 32, 128, 128, device="cuda", dtype=torch.bfloat16)
    loop_state, walk_state = s0.clone(), s0.clone()
    loop = gdn_chunked(q, k, v, g, beta, loop_state, use_triton=False)
    walk = gdn_chunked(q, k, v, g, beta, walk_state, use_triton=True)
    torch.testing.assert_close(walk.float(), loop.float(), rtol=2e-2, atol=2e-2)  # bf16 outputs
    # the terms' two products on tensor cores in tf32 (gdn_state.PREP_DOT), the loop's in fp32
    torch.testing.assert_close(walk_state, loop_state, rtol=1e-3, atol=1e-3)
    assert gdn_chunked(q, k, v, g, beta, s0.clone()).equal(walk)  # the default on CUDA is the kernel


def solve_case(hv, n, chunk, width, correlated, device="cpu", seed=0):
    """A chunk's system as gdn_chunked builds it: A = beta k k^T e^(c_t - c_j) below the diagonal, unit keys. With
    `correlated`, keys close to one another (k_t.k_j near 1: a run of repeated tokens), the least favourable case for
    a forward substitution (entries of the inverse grow)."""
    g = torch.Generator(device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.float64)  # noqa: E731
    k = r(hv, n, chunk, 32)
    if correlated:
        k = r(hv, n, 1, 32) + 0.05 * k
    k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.rand(hv, n, chunk, generator=g, device=device, dtype=torch.float64)
    c = (-torch.rand(hv, n, chunk, generator=g, device=device, dtype=torch.float64) * 0.1).cumsum(-1)
    A = (beta[..., None] * k @ k.transpose(-1, -2) * (c[..., :, None] - c[..., None, :]).exp()).tril(-1)
    return A, r(hv, n, chunk, width)


SOLVE_CASES = [(2, 3, 16, 48, False), (2, 2, 32, 96, True), (3, 2, 64, 256, False), (1, 2, 64, 48, True)]

SOLVE_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from reviewer_kernels import gdn_state
from tests.reviewer_kernels.test_gdn_state import SOLVE_CASES, solve_case
for case in SOLVE_CASES:
    A, rhs = solve_case(*case)
    exact = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    rhs32 = rhs.float()
    u = gdn_state._solve(A.float(), rhs32)  # the default SOLVE, "triton", under the interpreter
    # the kernel overwrites the right-hand sides (the walk reads u through rhs's strides); cuBLAS would not
    print(json.dumps({"case": case, "err": (u.double() - exact).abs().max().item(),
                      "scale": exact.abs().max().item(), "in_place": u.data_ptr() == rhs32.data_ptr()}))
"""


@pytest.fixture(scope="module")
def solve_results():
    return interpreted_by_case(SOLVE_SCRIPT)


@pytest.mark.parametrize("case", SOLVE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_triangular_solve_kernel_against_float64(solve_results, case):
    r = solve_results[tuple(case)]
    assert r["in_place"], r
    assert r["scale"] > 1.0 and r["err"] < 2e-6 * r["scale"], r  # fp32 rounding, not a wrong step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("correlated", [False, True])
def test_triangular_solve_on_cuda_as_close_as_cublas(correlated):
    """At the 35B-A3B shape (32 value heads, chunks of 64, [u_free | u_state] 256 wide), 1,024 tokens: the kernel's
    error against float64 within a small multiple of cuBLAS's fp32 trsm, which it replaced."""
    from reviewer_kernels import gdn_state

    A, rhs = solve_case(32, 16, 64, 256, correlated, device="cuda")
    exact = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    cublas = torch.linalg.solve_triangular(A.float(), rhs.float(), upper=False, unitriangular=True)
    ours = gdn_state._solve(A.float(), rhs.float().clone())
    err_cublas = (cublas.double() - exact).abs().max().item()
    err_ours = (ours.double() - exact).abs().max().item()
    assert err_ours <= 4 * err_cublas + 1e-6, (err_ours, err_cublas)
