"""reviewer_kernels/attention_prep.py: a gated-attention layer's q/k norms, RoPE and cache write in one launch.

The PyTorch twin is checked against the model's own glue (backend/models/qwen3_5_moe.attention_heads: norm, then
RoPE in the input dtype); the Triton kernel against the twin under Triton's CPU interpreter (a subprocess; fp32 and
fp16) and, on a GPU, in bf16 at the 35B-A3B shape, where a row's bits must not depend on the block's size.
"""

from __future__ import annotations

import pytest
import torch

from backend.models.llama import rope_tables
from backend.models.qwen3_5_moe import attention_heads
from reviewer_kernels.attention_prep import attention_prep, attention_prep_torch
from tests.reviewer_kernels.test_fused_moe import interpreted_by_case

# (dtype, heads, kv_heads, head_dim, rotary dims, T, padded rows, first position, consecutive positions)
CASES = [(dt, *case) for dt in ("float32", "float16") for case in [
    (4, 2, 32, 8, 1, 16, 0, True),  # tiny_qwen's shape, a decode step at position 0 in padded rows
    (4, 2, 32, 8, 5, 16, 37, True),  # a verify block
    (8, 1, 64, 64, 3, 3, 100, False),  # whole-head RoPE, positions not consecutive, no padding
    (2, 2, 16, 4, 16, 16, 200, True),  # a full block, no grouping
]]


def make_case(heads, kv_heads, head_dim, rot, T, rows, first, consecutive, dtype=torch.float32, device="cpu",
              seed=0, max_context=256):
    g = torch.Generator(device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    width = (2 * heads + 2 * kv_heads) * head_dim
    proj = (r(rows, width + 8) * 2).to(dtype)[:, :width]  # strided rows, as a column slice would be
    q_norm, k_norm = 1 + 0.3 * r(head_dim), 1 + 0.3 * r(head_dim)  # (1 + w) in fp32, as the model keeps them
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=device).float() / rot))
    cos, sin = rope_tables(inv_freq, 1.0, max_context, dtype)
    step = 1 if consecutive else 7
    positions = torch.arange(first, first + step * T, step, device=device)
    k_cache, v_cache = r(kv_heads, max_context, head_dim).to(dtype), r(kv_heads, max_context, head_dim).to(dtype)
    return proj, q_norm, k_norm, cos, sin, positions, k_cache, v_cache


def test_twin_is_the_models_glue_and_writes_the_cache():
    """The twin's q, k, v and gate are attention_heads' (fp32: the same up to rounding order), and the caches hold
    the block's keys and values at its positions afterwards, nothing else changed."""
    heads, kv_heads, D, rot, T = 4, 2, 32, 8, 5
    proj, qn, kn, cos, sin, pos, kc, vc = make_case(heads, kv_heads, D, rot, T, 16, 37, True)
    before_k, before_v = kc.clone(), vc.clone()
    a = attention_prep_torch(proj, qn, kn, cos, sin, pos, kc, vc, heads=heads, kv_heads=kv_heads, eps=1e-6)
    q, k, v, gate = attention_heads(proj[:T], qn, kn, cos[pos], sin[pos], 1e-6, heads, kv_heads, D)
    torch.testing.assert_close(a.q, q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.k, k, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.v, v) and torch.equal(a.gate.reshape(T, -1), gate)
    assert torch.equal(kc[:, pos], a.k) and torch.equal(vc[:, pos], a.v)
    kc[:, pos], vc[:, pos] = before_k[:, pos], before_v[:, pos]
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)


def test_bad_shapes_say_why():
    proj, qn, kn, cos, sin, pos, kc, vc = make_case(4, 2, 32, 8, 5, 16, 37, True)
    with pytest.raises(ValueError, match="proj must be"):
        attention_prep(proj[:, :-32], qn, kn, cos, sin, pos, kc, vc, heads=4, kv_heads=2, eps=1e-6)
    with pytest.raises(ValueError, match="proj must be"):
        attention_prep(proj[:3], qn, kn, cos, sin, pos, kc, vc, heads=4, kv_heads=2, eps=1e-6)
    with pytest.raises(ValueError, match="key heads"):
        attention_prep(proj, qn, kn, cos, sin, pos, kc, vc, heads=6, kv_heads=1, eps=1e-6)
    with pytest.raises(ValueError, match="q_norm"):
        attention_prep(proj, qn[:8], kn, cos, sin, pos, kc, vc, heads=4, kv_heads=2, eps=1e-6)


INTERPRETER_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from reviewer_kernels.attention_prep import attention_prep
from tests.reviewer_kernels.test_attention_prep import CASES, make_case
for case in CASES:
    dt, heads, kv_heads, D, rot, T, rows, first, consecutive = case
    args = make_case(heads, kv_heads, D, rot, T, rows, first, consecutive, getattr(torch, dt))
    ref_args = make_case(heads, kv_heads, D, rot, T, rows, first, consecutive, getattr(torch, dt))
    a = attention_prep(*args, heads=heads, kv_heads=kv_heads, eps=1e-6, use_triton=True)
    b = attention_prep(*ref_args, heads=heads, kv_heads=kv_heads, eps=1e-6, use_triton=False)
    # each row alone (a decode step at its position) gives the block's bits
    alone = True
    for t in range(T):
        one = make_case(heads, kv_heads, D, rot, T, rows, first, consecutive, getattr(torch, dt))
        proj, qn, kn, cos, sin, pos, kc, vc = one
        c = attention_prep(proj[t:t + 1], qn, kn, cos, sin, pos[t:t + 1], kc, vc, heads=heads, kv_heads=kv_heads,
                           eps=1e-6, use_triton=True)
        alone &= torch.equal(c.q[:, 0], a.q[:, t]) and torch.equal(c.k[:, 0], a.k[:, t])
    err = lambda x, y: (x.double() - y.double()).abs().max().item()
    print(json.dumps({"case": list(case), "q": err(a.q, b.q), "k": err(a.k, b.k), "v": torch.equal(a.v, b.v),
                      "gate": torch.equal(a.gate, b.gate), "k_cache": err(args[6], ref_args[6]),
                      "v_cache": torch.equal(args[7], ref_args[7]), "alone": bool(alone),
                      "shapes": [list(a.q.shape), list(a.k.shape)]}), flush=True)
"""


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted_by_case(INTERPRETER_SCRIPT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_its_twin_under_interpreter(interpreter_results, case):
    """q and k to rounding (one ulp of the dtype: the rsqrt and the products' order), the value and gate views and
    the value cache bit for bit, the key cache as the returned keys; every row alone gives the block's bits."""
    r = interpreter_results[tuple(case)]
    tol = 1e-5 if case[0] == "float32" else 4e-3
    assert r["q"] < tol and r["k"] < tol and r["k_cache"] < tol, r
    assert r["v"] and r["gate"] and r["v_cache"] and r["alone"], r
    heads, kv_heads, D, T = case[1], case[2], case[3], case[5]
    assert r["shapes"] == [[heads, T, D], [kv_heads, T, D]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_35b_shape_matches_twin_and_rows_are_invariant():
    """The 35B-A3B shape (16 query heads, 2 key heads, 256 dims, 64 rotated) in bf16 at positions near 30k: the
    twin to a bf16 ulp, and each row of a 16-row block bitwise the row computed alone."""
    args = make_case(16, 2, 256, 64, 16, 16, 30000, True, torch.bfloat16, "cuda", max_context=32768)
    ref_args = [x.clone() for x in args]
    a = attention_prep(*args, heads=16, kv_heads=2, eps=1e-6)
    b = attention_prep(*ref_args, heads=16, kv_heads=2, eps=1e-6, use_triton=False)
    assert (a.q.float() - b.q.float()).abs().max() < 2e-2 and (a.k.float() - b.k.float()).abs().max() < 2e-2
    assert torch.equal(args[7], ref_args[7])
    proj, qn, kn, cos, sin, pos, kc, vc = args
    for t in (0, 7, 15):
        one = attention_prep(proj[t:t + 1], qn, kn, cos, sin, pos[t:t + 1], kc, vc, heads=16, kv_heads=2, eps=1e-6)
        assert torch.equal(one.q[:, 0], a.q[:, t]) and torch.equal(one.k[:, 0], a.k[:, t]), t
