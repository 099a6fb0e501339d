"""reviewer_kernels/gdn_state.py's prefill form: the chunk terms and the walk as Triton launches (around a triangular
solve) against the batched PyTorch terms and loop.

Under Triton's CPU interpreter (a subprocess, fp32) and, on a GPU, in bf16 inputs with the fp32 state. The loop itself
is checked against transformers' token-by-token recurrence in tests/backend/models/test_fast_models.py.
"""

from __future__ import annotations

import pytest
import torch

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
    print(json.dumps({"case": case, "strided_same": torch.equal(strided, walk),
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
    assert r["out_vs_tokens"] < 1e-4 and r["state_vs_tokens"] < 1e-4, r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [300, 1024])
def test_chunk_kernels_on_cuda_at_the_35b_shape(T):
    # the 35B-A3B shape's heads (16 key, 32 value, dims 128), prefill pieces of an agent turn's size
    q, k, v, g, beta, s0 = make_case(T, 16, 32, 128, 128, device="cuda", dtype=torch.bfloat16)
    loop_state, walk_state = s0.clone(), s0.clone()
    loop = gdn_chunked(q, k, v, g, beta, loop_state, use_triton=False)
    walk = gdn_chunked(q, k, v, g, beta, walk_state, use_triton=True)
    torch.testing.assert_close(walk.float(), loop.float(), rtol=2e-2, atol=2e-2)  # bf16 outputs
    # the terms' two products on tensor cores in tf32 (gdn_state.PREP_DOT), the loop's in fp32
    torch.testing.assert_close(walk_state, loop_state, rtol=1e-3, atol=1e-3)
    assert gdn_chunked(q, k, v, g, beta, s0.clone()).equal(walk)  # the default on CUDA is the kernel
