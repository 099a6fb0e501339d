"""reviewer_kernels/block_attention.py: the fused cache-write + attention of a decode step / speculative block.

The fallback is checked against attention written out by hand in float64; the Triton kernel against the fallback
under Triton's CPU interpreter (a subprocess, fp32: TRITON_INTERPRET must be set before triton is imported) and, on a
GPU, in bf16. Cases cover grouped-query attention, one and several column splits, several row chunks, a block at
position 0 and blocks whose cached prefix ends inside a split.
"""

from __future__ import annotations

import os

import pytest
import torch

from reviewer_kernels.block_attention import block_attention, block_attention_torch
from tests.reviewer_kernels.test_fused_moe import interpreted_by_case, run_interpreted


def make_case(heads, kv_heads, head_dim, T, start, max_context=1024, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=device).to(dtype)  # noqa: E731
    q = r(T, heads, head_dim).transpose(0, 1)  # [H, T, D] as a strided view, as the models pass it
    k_new, v_new = r(T, kv_heads, head_dim).transpose(0, 1), r(T, kv_heads, head_dim).transpose(0, 1)
    k_cache, v_cache = r(kv_heads, max_context, head_dim), r(kv_heads, max_context, head_dim)
    return q, k_new, v_new, k_cache, v_cache, torch.tensor([start], device=device)


def reference64(q, k_new, v_new, k_cache, v_cache, start, causal=True, window=0):
    """Softmax attention over cache[:start] + the block (causal, or all of it), in float64, one query at a time;
    window > 0: position p sees only the columns after p - window."""
    H, T, D = q.shape
    group = H // k_new.shape[0]
    out = torch.empty(T, H, D, dtype=torch.float64)
    for h in range(H):
        keys = torch.cat([k_cache[h // group, :start], k_new[h // group]]).double()
        values = torch.cat([v_cache[h // group, :start], v_new[h // group]]).double()
        for t in range(T):
            end = start + t + 1 if causal else start + T
            first = max(0, start + t - window + 1) if window else 0
            w = torch.softmax(keys[first:end] @ q[h, t].double() / D ** 0.5, dim=0)
            out[t, h] = w @ values[first:end]
    return out.reshape(T, H * D)


CASES = [  # heads, kv_heads, head_dim, T, start, span
    (9, 3, 64, 1, 511, 768),  # the SmolLM2 shape's decode step
    (9, 3, 64, 16, 300, 512),
    (4, 4, 32, 5, 0, 256),  # a block at position 0; no grouping
    (16, 2, 256, 1, 200, 768),  # the Qwen3.6 shape: several splits
    (16, 2, 256, 16, 37, 256),  # 128 query rows: two row chunks
    (8, 2, 64, 3, 1000, 1024),  # the prefix ends inside the last split
    (9, 3, 64, 5, 130, 135),  # span = start + T exactly, as an eager call passes it
    (16, 2, 256, 1, 70, 71),
]

# causal=False (a DFlash drafter's bidirectional block layers): blocks of several tokens at head dims <= 64 (the
# interpreter is slow at 256; the CUDA test takes every case both ways)
BIDIRECTIONAL = [c for c in CASES if c[3] > 1 and c[2] <= 64]
# sliding windows (the released Qwen3.6 drafter's layers): heads, kv_heads, head_dim, T, start, span, window; windows
# that cut inside a tile, that skip whole slices, and one that reaches past the cache's start
WINDOWED = [(9, 3, 64, 16, 300, 512, 100), (8, 2, 64, 3, 1000, 1024, 130), (4, 4, 32, 5, 20, 256, 64)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("case", WINDOWED, ids=lambda c: "-".join(map(str, c)))
def test_fallback_sliding_window_matches_float64_attention(case, causal):
    heads, kv_heads, head_dim, T, start, span, window = case
    q, k_new, v_new, k_cache, v_cache, pos = make_case(heads, kv_heads, head_dim, T, start)
    ref = reference64(q, k_new, v_new, k_cache, v_cache, start, causal, window)
    out = block_attention_torch(q, k_new, v_new, k_cache, v_cache, pos, span, causal, window)
    assert (out.double() - ref).abs().max() < 1e-4
    unwindowed = reference64(q, k_new, v_new, k_cache, v_cache, start, causal)
    cut = (out.double() - unwindowed).abs().max() > 1e-3
    assert cut == (start + T > window)  # the window cut something exactly when the positions reach past it


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_fallback_matches_float64_attention_and_writes_the_cache(case, causal):
    heads, kv_heads, head_dim, T, start, span = case
    q, k_new, v_new, k_cache, v_cache, pos = make_case(heads, kv_heads, head_dim, T, start)
    ref = reference64(q, k_new, v_new, k_cache, v_cache, start, causal)
    before = k_cache.clone()
    out = block_attention_torch(q, k_new, v_new, k_cache, v_cache, pos, span, causal)
    assert out.shape == (T, heads * head_dim)
    assert (out.double() - ref).abs().max() < 1e-4
    assert torch.equal(k_cache[:, start:start + T], k_new) and torch.equal(v_cache[:, start:start + T], v_new)
    assert torch.equal(k_cache[:, :start], before[:, :start]) and torch.equal(k_cache[:, start + T:],
                                                                               before[:, start + T:])


def test_without_triton_the_fallback_runs_on_cpu():
    assert os.environ.get("TRITON_INTERPRET") != "1"
    a = make_case(4, 2, 32, 3, 10)
    b = make_case(4, 2, 32, 3, 10)
    assert torch.equal(block_attention(*a, span=256), block_attention_torch(*b, span=256))


def test_bad_arguments_raise_clear_errors():
    q, k_new, v_new, k_cache, v_cache, pos = make_case(4, 2, 32, 3, 10)
    with pytest.raises(ValueError, match="bad shapes"):
        block_attention_torch(q, k_new[:1, :2], v_new, k_cache, v_cache, pos)
    with pytest.raises(ValueError, match="1..16"):
        big = make_case(4, 2, 32, 17, 10)
        block_attention_torch(*big)
    with pytest.raises(ValueError, match="one-element"):
        block_attention_torch(q, k_new, v_new, k_cache, v_cache, pos.float())


INTERPRETER_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.reviewer_kernels.test_block_attention import BIDIRECTIONAL, CASES, WINDOWED, make_case
from reviewer_kernels.block_attention import block_attention, block_attention_torch
for case in CASES:
    heads, kv_heads, head_dim, T, start, span = case
    a = make_case(heads, kv_heads, head_dim, T, start)
    b = make_case(heads, kv_heads, head_dim, T, start)
    out = block_attention(*a, span=span, use_triton=True)
    ref = block_attention_torch(*b, span=span)
    c = make_case(heads, kv_heads, head_dim, T, start)
    wide = block_attention(*c, span=span + 700, use_triton=True)  # more (empty) slices: a bigger CUDA-graph span
    d = make_case(heads, kv_heads, head_dim, T, start)
    whole = block_attention(*d, span=d[3].shape[1], use_triton=True)  # what a CUDA graph passes: the whole cache
    print(json.dumps({"case": list(case), "err": (out - ref).abs().max().item(),
                      "cache_equal": bool(torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])),
                      "span_invariant": bool(torch.equal(out, wide) and torch.equal(out, whole))}), flush=True)
for case in BIDIRECTIONAL:
    heads, kv_heads, head_dim, T, start, span = case
    a = make_case(heads, kv_heads, head_dim, T, start)
    b = make_case(heads, kv_heads, head_dim, T, start)
    out = block_attention(*a, span=span, use_triton=True, causal=False)
    ref = block_attention_torch(*b, span=span, causal=False)
    print(json.dumps({"case": list(case) + ["bidirectional"], "err": (out - ref).abs().max().item(),
                      "cache_equal": bool(torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])),
                      "span_invariant": True}), flush=True)
for case in WINDOWED:
    heads, kv_heads, head_dim, T, start, span, window = case
    for causal in (True, False):
        a = make_case(heads, kv_heads, head_dim, T, start)
        b = make_case(heads, kv_heads, head_dim, T, start)
        out = block_attention(*a, span=span, use_triton=True, causal=causal, window=window)
        ref = block_attention_torch(*b, span=span, causal=causal, window=window)
        d = make_case(heads, kv_heads, head_dim, T, start)
        whole = block_attention(*d, span=d[3].shape[1], use_triton=True, causal=causal, window=window)
        print(json.dumps({"case": list(case) + ["causal" if causal else "bidirectional"],
                          "err": (out - ref).abs().max().item(),
                          "cache_equal": bool(torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])),
                          "span_invariant": bool(torch.equal(out, whole))}), flush=True)
"""


@pytest.fixture(scope="module")
def interpreted():
    return interpreted_by_case(INTERPRETER_SCRIPT)


@pytest.mark.parametrize("case", CASES + [c + ("bidirectional",) for c in BIDIRECTIONAL]
                         + [c + (kind,) for c in WINDOWED for kind in ("causal", "bidirectional")],
                         ids=lambda c: "-".join(map(str, c)))
def test_triton_kernel_matches_fallback_in_interpreter(interpreted, case):
    r = interpreted[tuple(case)]
    assert r["cache_equal"], "the kernel wrote the cache differently"
    assert r["span_invariant"], "a larger span changed the result"
    assert r["err"] < 2e-5, r


GATED_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.reviewer_kernels.test_block_attention import CASES, make_case
from reviewer_kernels.block_attention import Tiles, block_attention, write_block
for case in [c for c in CASES if c[2] <= 64]:
    heads, kv_heads, head_dim, T, start, span = case
    g = torch.Generator().manual_seed(3)
    # the output gate as the fused projection holds it: [T, H, D] with a row stride of the whole projection
    gate = torch.randn(T, heads, 2 * head_dim + 8, generator=g)[:, :, head_dim:2 * head_dim]
    a = make_case(heads, kv_heads, head_dim, T, start)
    plain = block_attention(*a, span=span, use_triton=True)
    b = make_case(heads, kv_heads, head_dim, T, start)
    gated = block_attention(*b, span=span, use_triton=True, gate=gate)
    c = make_case(heads, kv_heads, head_dim, T, start)
    fallback = block_attention(*c, span=span, use_triton=False, gate=gate)
    d = make_case(heads, kv_heads, head_dim, T, start)
    write_block(d[1], d[2], d[3], d[4], d[5], use_triton=True)  # what attention_prep leaves in the cache
    cached = block_attention(*d, span=span, use_triton=True, cached=True)
    want = (plain.float() * torch.sigmoid(gate.reshape(T, -1))).to(plain.dtype)
    # other slice counts (Tiles.max_splits): fewer, wider slices, or more with a larger combine tile; each the same
    # attention, and a whole-cache span gives the same bits as the exact one
    splits_err, splits_span = 0.0, True
    for max_splits in (3, 255):
        tiles = Tiles(16, 64 if head_dim <= 64 else 32, max_splits=max_splits)
        e = make_case(heads, kv_heads, head_dim, T, start)
        got = block_attention(*e, span=span, use_triton=True, tiles=tiles)
        f = make_case(heads, kv_heads, head_dim, T, start)
        splits_span &= torch.equal(got, block_attention(*f, span=f[3].shape[1], use_triton=True, tiles=tiles))
        splits_err = max(splits_err, (got - plain).abs().max().item())
    print(json.dumps({"case": list(case), "gated": (gated - want).abs().max().item(),
                      "fallback": (gated - fallback).abs().max().item(), "cached": bool(torch.equal(cached, plain)),
                      "cache_equal": bool(torch.equal(a[3], d[3]) and torch.equal(a[4], d[4])),
                      "splits_err": splits_err, "splits_span": bool(splits_span)}), flush=True)
"""


@pytest.fixture(scope="module")
def gated():
    return interpreted_by_case(GATED_SCRIPT)


@pytest.mark.parametrize("case", [c for c in CASES if c[2] <= 64], ids=lambda c: "-".join(map(str, c)))
def test_output_gate_and_cached_blocks_under_interpreter(gated, case):
    """gate=: the combine kernel's attn * sigmoid(gate) is that product computed after the kernel (to the sigmoid's
    last bits: Triton's and torch's differ there) and the fallback's; cached=True after the block's keys and values
    were written gives the uncached call's bits and cache; other slice counts (Tiles.max_splits 3 and 255) the same
    attention, span-invariant."""
    r = gated[tuple(case)]
    assert r["gated"] < 1e-6 and r["fallback"] < 2e-5, r
    assert r["cached"] and r["cache_equal"], r
    assert r["splits_err"] < 2e-5 and r["splits_span"], r


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_bf16_kernel_matches_fallback(case, causal):
    heads, kv_heads, head_dim, T, start, span = case
    a = make_case(heads, kv_heads, head_dim, T, start, dtype=torch.bfloat16, device="cuda")
    b = make_case(heads, kv_heads, head_dim, T, start, dtype=torch.bfloat16, device="cuda")
    out = block_attention(*a, span=span, causal=causal)
    ref = block_attention_torch(*b, span=span, causal=causal)
    assert torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
    assert out.shape == (T, heads * head_dim) and out.dtype == torch.bfloat16
    # the whole cache as the span (one CUDA graph for every length): the slices past the length add nothing, bit
    # for bit, also when the partial-sum buffers hold garbage from earlier calls
    for _ in range(2):
        c = make_case(heads, kv_heads, head_dim, T, start, dtype=torch.bfloat16, device="cuda")
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0x7F)  # poison what the allocator hands out
        whole = block_attention(*c, span=c[3].shape[1], causal=causal)
        assert torch.equal(out, whole)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("case", WINDOWED, ids=lambda c: "-".join(map(str, c)))
def test_cuda_bf16_sliding_window_matches_fallback_at_every_span(case, causal):
    heads, kv_heads, head_dim, T, start, span, window = case
    a = make_case(heads, kv_heads, head_dim, T, start, dtype=torch.bfloat16, device="cuda")
    b = make_case(heads, kv_heads, head_dim, T, start, dtype=torch.bfloat16, device="cuda")
    out = block_attention(*a, span=span, causal=causal, window=window)
    ref = block_attention_torch(*b, span=span, causal=causal, window=window)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
    c = make_case(heads, kv_heads, head_dim, T, start, dtype=torch.bfloat16, device="cuda")
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0x7F)
    assert torch.equal(out, block_attention(*c, span=c[3].shape[1], causal=causal, window=window))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("start", [37, 3000, 30000])
def test_cuda_verify_rows_are_the_decode_steps_bits(start):
    """Batch invariance at the 35B-A3B shape (16 query heads, 2 key heads, 256 dims, a 32k cache passed whole, as
    CUDA graphs do): each row of a 16-token verify equals, bit for bit, a decode step at that position. Every
    verify size's rows too (T = 2..15 share the tiles). What lossless speculation needs of this kernel."""
    q, k_new, v_new, k_cache, v_cache, pos = make_case(16, 2, 256, 16, start, max_context=32768,
                                                       dtype=torch.bfloat16, device="cuda", seed=1)
    whole = k_cache.shape[1]
    verify = block_attention(q, k_new, v_new, k_cache, v_cache, pos, whole)
    for t in range(16):  # the cache now holds the block's keys: step t sees columns < start + t as the verify did
        step = block_attention(q[:, t:t + 1], k_new[:, t:t + 1], v_new[:, t:t + 1], k_cache, v_cache, pos + t,
                               whole)
        assert torch.equal(step[0], verify[t]), t
    for T in (2, 5, 15):
        assert torch.equal(block_attention(q[:, :T], k_new[:, :T], v_new[:, :T], k_cache, v_cache, pos, whole),
                           verify[:T]), T


MODEL_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from backend.models import load_fast
from tests.backend.models.test_fast_models import tiny_llama, tiny_qwen
torch.manual_seed(0)
for arch, make in (("llama", tiny_llama), ("qwen", tiny_qwen)):
    hf = make()
    kernel, sdpa = load_fast(hf, 256, cuda_graphs=False), load_fast(hf, 256, cuda_graphs=False)
    kernel.model.kv.use_block_kernel = True  # what a CUDA device gets; here the interpreter runs it
    prompt = torch.randint(0, 320, (20,))
    blocks = ((torch.randint(0, 320, (5,)), 2), (torch.randint(0, 320, (16,)), 16))
    outs = []
    for fast in (kernel, sdpa):
        logs = [fast.prefill(prompt)[0]]
        for step in range(3):
            logs.append(fast.decode(step)[0])
        for block, keep in blocks:
            logs.append(fast.verify(block)[0])
            fast.accept(keep)
        logs.append(fast.decode(7)[0])
        outs.append(torch.cat([l.reshape(-1) for l in logs]))
    n = kernel.length
    print(json.dumps({"arch": arch, "err": (outs[0] - outs[1]).abs().max().item(), "length": n,
                      "kv_err": (kernel.model.kv.k[:, :, :n] - sdpa.model.kv.k[:, :, :n]).abs().max().item()}))
"""


def test_fast_models_attend_through_the_kernel_as_through_sdpa():
    """The models' wiring (consecutive positions, strided q/k/v views, the cache slice per layer, no mask) gives the
    logits and caches of the index_copy_ + SDPA path, through prefill, decode, verify and accept."""
    pytest.importorskip("triton")
    results = run_interpreted(MODEL_SCRIPT)
    assert [r["arch"] for r in results] == ["llama", "qwen"]
    for r in results:
        assert r["length"] == 20 + 3 + 2 + 16 + 1
        assert r["err"] < 1e-4 and r["kv_err"] < 1e-5, r


def test_exact_mode_turns_the_kernel_off_and_back_on():
    """Exact mode (span_multiple > 0) needs every position computed the same way: no block kernel while it is on."""
    from backend.models import load_fast
    from tests.backend.models.test_fast_models import tiny_llama

    fast = load_fast(tiny_llama(), 64, cuda_graphs=False)
    kv = fast.model.kv
    assert not kv.block_kernel_available and not kv.block_kernel(1)  # a CPU cache never has it
    kv.block_kernel_available = True  # as on a CUDA device
    fast.span_multiple = 512
    assert not kv.block_kernel(1)
    fast.span_multiple = 0
    assert kv.block_kernel(1) and not kv.block_kernel(17)
