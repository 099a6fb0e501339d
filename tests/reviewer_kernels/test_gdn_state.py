"""reviewer_kernels/gdn_state.py's prefill form: the chunk walk as one Triton launch against the PyTorch loop.

Under Triton's CPU interpreter (a subprocess, fp32) and, on a GPU, in bf16 inputs with the fp32 state. The loop itself
is checked against transformers' token-by-token recurrence in tests/backend/models/test_fast_models.py.
"""

from __future__ import annotations

import pytest
import torch

from reviewer_kernels.gdn_state import gdn_chunked, gdn_recurrent_torch
from tests.reviewer_kernels.test_fused_moe import interpreted_by_case

# (T, key heads, value heads, key dim, value dim, chunk): one partial chunk, several chunks with padding, grouped heads
CASES = [(9, 1, 1, 16, 32, 16), (70, 1, 2, 16, 32, 16), (200, 2, 4, 32, 64, 32)]


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
    print(json.dumps({"case": case, "out_vs_loop": (walk - loop).abs().max().item(),
                      "state_vs_loop": (walk_state - loop_state).abs().max().item(),
                      "out_vs_tokens": (walk - token).abs().max().item(),
                      "state_vs_tokens": (walk_state - token_state).abs().max().item(),
                      "scale": token.abs().max().item()}))
"""


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted_by_case(INTERPRETER_SCRIPT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_chunk_walk_kernel_matches_the_loop_and_the_token_recurrence(interpreter_results, case):
    r = interpreter_results[tuple(case)]
    assert r["scale"] > 0.1, r  # outputs that are not all zero
    assert r["out_vs_loop"] < 1e-5 and r["state_vs_loop"] < 1e-5, r
    assert r["out_vs_tokens"] < 1e-4 and r["state_vs_tokens"] < 1e-4, r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunk_walk_kernel_on_cuda_at_the_35b_shape():
    # the 35B-A3B shape's heads (16 key, 32 value, dims 128), an agent turn's prefill piece
    q, k, v, g, beta, s0 = make_case(300, 16, 32, 128, 128, device="cuda", dtype=torch.bfloat16)
    loop_state, walk_state = s0.clone(), s0.clone()
    loop = gdn_chunked(q, k, v, g, beta, loop_state, use_triton=False)
    walk = gdn_chunked(q, k, v, g, beta, walk_state, use_triton=True)
    torch.testing.assert_close(walk.float(), loop.float(), rtol=2e-2, atol=2e-2)  # bf16 outputs
    torch.testing.assert_close(walk_state, loop_state, rtol=1e-4, atol=1e-4)
    assert gdn_chunked(q, k, v, g, beta, s0.clone()).equal(walk)  # the default on CUDA is the kernel
