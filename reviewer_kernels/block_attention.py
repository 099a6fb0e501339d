"""Attention for a decode step or a speculative block (T <= 16 new tokens) in one or two launches, cache write included.

    out = block_attention(q, k_new, v_new, k_cache, v_cache, start, span)   # out [T, H * D]

q [H, T, D] (RoPE applied), k_new / v_new [Hkv, T, D]: the block's queries, keys and values; k_cache / v_cache
[Hkv, max_context, D]: this layer's cache; start: a one-element device tensor, the position of the first new token
(the block sits at start .. start + T - 1); span: a host bound on start + T, which only sets how many programs split
the cached columns. CUDA graphs pass the whole cache (k_cache.shape[1]): slices past start + T return at once and the
combine reads only the slices the length reaches, so one graph serves every length at a few microseconds' cost. The new keys and values are written to the cache at start .. start + T - 1
and query t attends to cache columns 0 .. start - 1 and to new tokens 0 .. t: the same as writing the cache and
running SDPA with a causal mask, which is what it replaces on the fast path.

Why: on the H200 a decode step of the SmolLM2 shape spent ~40% of its GPU time and 8 of its ~19 launches per layer on
attention (two index_copy cache writes, the bool mask turned into a bias, cuDNN's SDPA with its fill, copy and
reduction kernels: bench/target_step.py --profile). Here each program reads the cached columns of one slice for all
query heads sharing its key head (grouped-query attention reads each key once), the new tokens come straight from
the projection instead of a round trip through the cache, and the span is read from device memory, so the cached
columns past the length are never touched.

Launches: for a block (T > 1) a small kernel first writes its keys and values to the cache; then grid (row chunks,
kv heads, column slices + 1) computes partial softmax sums, one slice of cached columns
per program and one program for the block's own tokens (which also writes them to the cache); a second small kernel
combines them, one program per query row and column slice, over a tile of fixed size. Slices sit at fixed column
offsets, so a position's result does not depend on the span (a CUDA graph's rounded span and an eager call's exact
one give the same bits) up to MAX_SPLITS slices (2,016 columns at head_dim 256, 4,032 at 64); longer spans use wider
slices. The reads of cached columns never overlap the writes (columns >= start), so no program waits on another.
Nothing synchronises with the host: graph-capturable.

The Triton path runs on CUDA (or under TRITON_INTERPRET=1, fp32/fp16 only); elsewhere `block_attention_torch` does the
same thing with index_copy_ and SDPA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from reviewer_kernels.fused_moe import dot_size, triton, triton_usable

MAX_BLOCK = 16  # new tokens per call (the speculative block); longer runs (prefill) use SDPA
# cached K+V bytes per program (per key head): small slices, many programs, each a short dependent chain (on the H200
# 64 KB slices left the kernel latency-bound: 4.8 us for the SmolLM2 shape's 768-column span)
SPLIT_BYTES = 16 * 1024
# + the block's own program: 128 partial sums per row at most, the combine kernel's fixed tile. A 32k cache at head_dim
# 256 is then cut in slices of 288 columns (9 tiles of 32 a program); Tiles.max_splits lets a sweep try more, shorter
# slices (bench/block_attention_tiles.py --splits)
MAX_SPLITS = 127
SPLIT_TILE = 128
COMBINE_BYTES = SPLIT_TILE * 64 * 4  # the combine program's tile of partial sums: 64 head-dim columns at 128 splits
BLOCK_ROWS = 16  # query rows per program, whatever T: the same tile shapes for a decode step and a verify block
# warps per _partial_kernel program, every head size: at the 35B-A3B shape (head_dim 256) 4 warps against the 8 used
# until 2026-12-03 took the 16-token verify from 131 to 93 us a layer at 30k cached tokens and the decode step from 26
# to 25 (H200; tiles of 64 query rows or 64 columns gained more for the verify but cost the decode step up to 9 us:
# bench/results/block_attention_tiles_h200_20261203.json). Decode steps and verifies share it: the same bits.
PARTIAL_WARPS = 4


@dataclass(frozen=True)
class Tiles:
    """_partial_kernel's tile set: query rows and cached columns a program, its warps and pipeline stages. One set
    for decode steps and verifies alike (their rows must get the same bits); bench/block_attention_tiles.py passes
    others to time them."""
    rows: int
    cols: int
    warps: int = PARTIAL_WARPS
    stages: int = 3
    max_splits: int = MAX_SPLITS  # slices of cached columns at most (the combine's tile: the next power of two above)

    @property
    def split_tile(self) -> int:
        return 1 << self.max_splits.bit_length()  # 127 -> 128, 255 -> 256


def default_tiles(head_dim: int) -> Tiles:
    return Tiles(rows=BLOCK_ROWS, cols=64 if head_dim <= 64 else 32)


if triton is not None:
    import triton.language as tl

    # _partial_kernel, a cached-column slice (split < N_SPLITS): columns at fixed absolute offsets, whatever the
    # span: a column's partial sum does not depend on how many splits the launch has (CUDA-graph spans and eager
    # spans give the same bits). The last split also takes anything past the span (only if a caller broke
    # span >= start + T). Row t sees the cached columns before its own position, start + t: those of earlier block
    # tokens were written to the cache before this launch (block_attention does it), so a block position is computed
    # exactly as a decode step at that position computes it (batch invariance); for T = 1 this is the plain decode
    # step. Not CAUSAL (a DFlash drafter's bidirectional block): every row sees the cached columns before the block,
    # and all of the block's tokens come from the projection.
    @triton.jit(do_not_specialize=["T"])
    def _partial_kernel(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, start_ptr, po_ptr, pm_ptr, pl_ptr, T, scale,
                        sq_h, sq_t, skn_h, skn_t, svn_h, svn_t, skc_h, skc_n, svc_h, svc_n, GROUP: tl.constexpr,
                        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                        SPLIT_COLS: tl.constexpr, N_SPLITS: tl.constexpr, N_CHUNKS: tl.constexpr,
                        CAUSAL: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr):
        # the row chunk varies fastest, so a slice's chunks share its K/V reads through L2 (same programs, same bits);
        # it gained little (verify at 30k ~146 -> 134 us a layer, H200): each program's dependent chain binds it.
        chunk = tl.program_id(0)  # slice of the GROUP * T query rows
        h = tl.program_id(1)  # key/value head
        split = tl.program_id(2)  # slice of cached columns; split N_SPLITS: the block's own tokens
        start = tl.load(start_ptr).to(tl.int32)
        if split < N_SPLITS:
            # a slice wholly past the cached columns has nothing to add: it stores nothing either, and the combine
            # kernel reads only the slices the length reaches (_active_splits). So a launch sized for the whole
            # cache (one CUDA graph for every length) costs little more than one sized for the current span.
            if split * SPLIT_COLS >= (start + T - 1 if CAUSAL else start):
                return
        r = chunk * BLOCK_M + tl.arange(0, BLOCK_M)
        g = r // T  # query head within the group
        t = r % T  # block token
        row_ok = r < GROUP * T
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (h * GROUP + g)[:, None] * sq_h + t[:, None] * sq_t + d[None, :], mask=row_ok[:, None],
                    other=0.0)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile leaves the sums unchanged
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        if split < N_SPLITS:
            # cached columns at fixed offsets (see the note above this kernel)
            c0 = split * SPLIT_COLS
            last_split = split == N_SPLITS - 1
            limit = start + T - 1 if CAUSAL else start
            row_limit = start + t if CAUSAL else start + 0 * t
            c1 = tl.where(last_split, limit, tl.minimum(c0 + SPLIT_COLS, limit))
            row_end = tl.where(last_split, row_limit, tl.minimum(c0 + SPLIT_COLS, row_limit))
            c_first = c0
            if WINDOW > 0:
                # a sliding window: row t (position start + t) sees the columns after start + t - WINDOW. The tiles
                # wholly before the first row's window are skipped: a fully masked tile adds exact zeros, so the
                # bits are those of visiting it, and a slice before every window stores empty sums for the combine
                c_first = tl.maximum(c0, (tl.maximum(start - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N)
            for c in range(c_first, c1, BLOCK_N):
                cols = c + tl.arange(0, BLOCK_N)
                ok = cols < c1
                k = tl.load(kc_ptr + h * skc_h + cols[:, None] * skc_n + d[None, :], mask=ok[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision="ieee" if IEEE else "tf32") * scale
                s = tl.where(cols[None, :] < row_end[:, None], s, float("-inf"))
                if WINDOW > 0:
                    s = tl.where(cols[None, :] > (start + t - WINDOW)[:, None], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                p = tl.exp(s - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                v = tl.load(vc_ptr + h * svc_h + cols[:, None] * svc_n + d[None, :], mask=ok[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee" if IEEE else "tf32")
                l_i = l_i * alpha + tl.sum(p, axis=1)
                m_i = m_new
        else:  # each row's own token, straight from the projection (the earlier block tokens are cached columns)
            j = tl.arange(0, BLOCK_T)
            j_ok = j < T
            k = tl.load(kn_ptr + h * skn_h + j[:, None] * skn_t + d[None, :], mask=j_ok[:, None], other=0.0)
            v = tl.load(vn_ptr + h * svn_h + j[:, None] * svn_t + d[None, :], mask=j_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee" if IEEE else "tf32") * scale
            if CAUSAL:
                s = tl.where(j_ok[None, :] & (j[None, :] == t[:, None]), s, float("-inf"))
            else:
                s = tl.where(j_ok[None, :], s, float("-inf"))
            m_i = tl.max(s, axis=1)
            p = tl.exp(s - m_i[:, None])
            acc = tl.dot(p.to(v.dtype), v, input_precision="ieee" if IEEE else "tf32")
            l_i = tl.sum(p, axis=1)
            if chunk == 0:  # one program per key head stores the block into the cache (T = 1: the only write;
                # T > 1: the same bytes block_attention wrote before the launch, so concurrent readers see no change)
                tl.store(kc_ptr + h * skc_h + (start + j)[:, None] * skc_n + d[None, :], k, mask=j_ok[:, None])
                tl.store(vc_ptr + h * svc_h + (start + j)[:, None] * svc_n + d[None, :], v, mask=j_ok[:, None])
        # partial sums, [kv head, split, row]: combined by _combine_kernel
        row = (h * (N_SPLITS + 1) + split) * (N_CHUNKS * BLOCK_M) + r
        tl.store(po_ptr + row[:, None] * D + d[None, :], acc)
        tl.store(pm_ptr + row, m_i)
        tl.store(pl_ptr + row, l_i)

    @triton.jit
    def _write_block_kernel(kn_ptr, vn_ptr, kc_ptr, vc_ptr, start_ptr, skn_h, skn_t, svn_h, svn_t, skc_h, skc_n,
                            svc_h, svc_n, D: tl.constexpr):
        """A block's keys and values into the cache, one (key head, token) per program: one launch for both (two
        index_copy_ were two), ahead of _partial_kernel, whose slices read the earlier block tokens as cached
        columns."""
        h = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1).to(tl.int64)
        col = tl.load(start_ptr).to(tl.int64) + t
        d = tl.arange(0, D)
        tl.store(kc_ptr + h * skc_h + col * skc_n + d, tl.load(kn_ptr + h * skn_h + t * skn_t + d))
        tl.store(vc_ptr + h * svc_h + col * svc_n + d, tl.load(vn_ptr + h * svn_h + t * svn_t + d))

    @triton.jit(do_not_specialize=["T"])
    def _combine_kernel(out_ptr, po_ptr, pm_ptr, pl_ptr, start_ptr, gate_ptr, T, so_t, sg_t, sg_h,
                        GROUP: tl.constexpr, D: tl.constexpr, DC: tl.constexpr, BLOCK_M: tl.constexpr,
                        N_SPLITS: tl.constexpr, N_CHUNKS: tl.constexpr, SP: tl.constexpr,
                        SPLIT_COLS: tl.constexpr, CAUSAL: tl.constexpr, HAS_GATE: tl.constexpr):
        """One query row, DC head-dim columns: all of its partial sums in one load each (a loop over the splits
        was a chain of dependent loads: ~4 us for 13 splits on the H200). The tile is SP = Tiles.split_tile rows
        whatever the split count, so the reduction tree, and with it every bit, does not depend on the span:
        missing splits, and the slices past the cached columns (which _partial_kernel skips), are exact zeros.
        HAS_GATE: the row, rounded to the output dtype, times sigmoid(gate) in fp32, rounded again (a gated
        attention's output gate, attn * sigmoid(gate), without a launch of its own)."""
        h = tl.program_id(0)
        r = tl.program_id(1)  # query row within the group: head h * GROUP + r // T, token r % T
        d = tl.program_id(2) * DC + tl.arange(0, DC)
        s = tl.arange(0, SP)
        if HAS_GATE:  # issued first: it depends on nothing the partial sums do
            g = tl.load(gate_ptr + (r % T) * sg_t + (h * GROUP + r // T) * sg_h + d).to(tl.float32)
        start = tl.load(start_ptr).to(tl.int32)
        limit = start + T - 1 if CAUSAL else start
        active = tl.minimum((limit + SPLIT_COLS - 1) // SPLIT_COLS, N_SPLITS)  # slices holding cached columns
        s_ok = s < active + 1
        # tile row 0: the block's own tokens (partial index N_SPLITS); row i: slice i - 1. Every non-empty partial
        # then sits at the same tile row whatever N_SPLITS is
        part = tl.where(s == 0, N_SPLITS, s - 1)
        row = (h * (N_SPLITS + 1) + part) * (N_CHUNKS * BLOCK_M) + r
        pm = tl.load(pm_ptr + row, mask=s_ok, other=float("-inf"))
        m = tl.max(pm, axis=0)
        w = tl.exp(pm - m)  # 0 for missing splits; empty splits (m = -1e30, l = 0, acc = 0) add exact zeros too
        l_sum = tl.sum(w * tl.load(pl_ptr + row, mask=s_ok, other=0.0), axis=0)
        po = tl.load(po_ptr + row[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
        o = (tl.sum(w[:, None] * po, axis=0) / l_sum).to(out_ptr.dtype.element_ty)
        if HAS_GATE:
            o = (o.to(tl.float32) * tl.sigmoid(g)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (r % T) * so_t + (h * GROUP + r // T) * D + d, o)


def supports(head_dim: int) -> bool:
    """The Triton kernel takes power-of-two head dims >= 16 (tl.arange and tl.dot shapes)."""
    return dot_size(head_dim)


def _check(q, k_new, v_new, k_cache, v_cache, start):
    H, T, D = q.shape
    hkv = k_new.shape[0]
    if k_new.shape != (hkv, T, D) or v_new.shape != k_new.shape or H % hkv:
        raise ValueError(f"bad shapes q {tuple(q.shape)} k_new {tuple(k_new.shape)} v_new {tuple(v_new.shape)}")
    if k_cache.shape[0] != hkv or k_cache.shape[2] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not hold {hkv} heads of {D}")
    if not 1 <= T <= MAX_BLOCK:
        raise ValueError(f"block_attention takes 1..{MAX_BLOCK} new tokens, got {T}")
    if start.numel() != 1 or start.dtype not in (torch.int32, torch.int64):
        raise ValueError("start must be a one-element integer tensor")


def block_attention_torch(q, k_new, v_new, k_cache, v_cache, start, span: int | None = None, causal: bool = True,
                          window: int = 0):
    """The same as block_attention with index_copy_ and SDPA (the fallback, and the reference in tests)."""
    _check(q, k_new, v_new, k_cache, v_cache, start)
    H, T, D = q.shape
    positions = start.reshape(1).long() + torch.arange(T, device=q.device)
    k_cache.index_copy_(1, positions, k_new)
    v_cache.index_copy_(1, positions, v_new)
    end = int(span) if span is not None else int(positions[-1]) + 1
    cols = torch.arange(end, device=q.device)[None, :]
    mask = cols <= positions[:, None] if causal else (cols <= positions[-1]).expand(T, end)
    if window:
        mask = mask & (positions[:, None] - cols < window)
    out = F.scaled_dot_product_attention(q[None], k_cache[None, :, :end], v_cache[None, :, :end], attn_mask=mask,
                                         enable_gqa=H != k_new.shape[0])
    return out[0].transpose(0, 1).reshape(T, H * D)


def block_attention(q, k_new, v_new, k_cache, v_cache, start, span: int, *, use_triton: bool | None = None,
                    out: torch.Tensor | None = None, causal: bool = True, window: int = 0, tiles: Tiles | None = None,
                    gate: torch.Tensor | None = None, cached: bool = False):
    """See the module docstring. span >= start + T (a host number; the caller's attention span). out: a [T, H * D]
    tensor to write the result into (Triton path; rows contiguous), e.g. rows of a larger one. causal=False: every
    block token sees all of the block (a DFlash drafter's bidirectional layers) and the cached columns before it.
    window > 0: a sliding window, position p sees the columns after p - window (at least MAX_BLOCK, so that a
    block's own tokens are always in it). tiles: the Triton kernel's tile set (default_tiles(head_dim); a benchmark's
    other candidates). gate [T, H, D] (any strides, contiguous rows): return attn * sigmoid(gate), the product in
    fp32 from the rounded attention, applied by the combine kernel. cached: the caller already wrote the block's keys
    and values to the cache (reviewer_kernels/attention_prep.py), so a block's write launch is skipped."""
    if window and window < MAX_BLOCK:
        raise ValueError(f"a sliding window spans at least {MAX_BLOCK} columns here, got {window}")
    H, T, D = q.shape
    if gate is not None and (gate.shape != (T, H, D) or gate.stride(-1) != 1):
        raise ValueError(f"gate must be [{T}, {H}, {D}] with contiguous rows, got {tuple(gate.shape)}")
    if use_triton is None:
        use_triton = triton_usable(q)
    if not use_triton:
        result = block_attention_torch(q, k_new, v_new, k_cache, v_cache, start, span, causal, window)
        if gate is not None:
            result = (result.float() * torch.sigmoid(gate.reshape(T, H * D).float())).to(result.dtype)
        return result if out is None else out.copy_(result)
    _check(q, k_new, v_new, k_cache, v_cache, start)
    hkv = k_new.shape[0]
    group = H // hkv
    if not supports(D):
        raise ValueError(f"head_dim must be a power of two >= 16, got {D}")
    for x in (q, k_new, v_new, k_cache, v_cache):
        if x.stride(-1) != 1:
            raise ValueError("the last dimension of every tensor must be contiguous")
    tiles = tiles or default_tiles(D)
    block_n = tiles.cols
    split_cols = max(block_n, SPLIT_BYTES // (4 * D) // block_n * block_n)  # K and V, 2 bytes each
    # long caches: wider slices, fixed by the cache's size (not the span or T), so every position of the cache sees
    # the same slice boundaries however it is reached
    split_cols = max(split_cols, math.ceil(k_cache.shape[1] / tiles.max_splits / block_n) * block_n)
    n_splits = max(1, math.ceil(int(span) / split_cols))
    rows = group * T
    block_m = tiles.rows
    n_chunks = math.ceil(rows / block_m)
    if T > 1 and causal and not cached:  # the block's keys and values go to the cache first: later rows read them
        # as cached columns
        _write_block_kernel[(hkv, T)](k_new, v_new, k_cache, v_cache, start, k_new.stride(0), k_new.stride(1),
                                      v_new.stride(0), v_new.stride(1), k_cache.stride(0), k_cache.stride(1),
                                      v_cache.stride(0), v_cache.stride(1), D=D, num_warps=1)
    if out is None:
        out = torch.empty(T, H * D, device=q.device, dtype=q.dtype)
    elif out.shape != (T, H * D) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{T}, {H * D}] {q.dtype} with contiguous rows, got {tuple(out.shape)}")
    part_rows = hkv * (n_splits + 1) * n_chunks * block_m
    po = torch.empty(part_rows, D, device=q.device, dtype=torch.float32)
    pm = torch.empty(part_rows, device=q.device, dtype=torch.float32)
    pl = torch.empty(part_rows, device=q.device, dtype=torch.float32)
    _partial_kernel[(n_chunks, hkv, n_splits + 1)](
        q, k_new, v_new, k_cache, v_cache, start, po, pm, pl, T, D ** -0.5,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        GROUP=group, D=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_T=16, SPLIT_COLS=split_cols, N_SPLITS=n_splits,
        N_CHUNKS=n_chunks, CAUSAL=causal, IEEE=q.dtype == torch.float32, WINDOW=int(window or 0),
        num_warps=tiles.warps, num_stages=tiles.stages)
    sp = tiles.split_tile
    dc = min(D, max(16, COMBINE_BYTES // (sp * 4)))  # head-dim columns a combine program: a tile of fixed bytes
    g = gate if gate is not None else out  # unused without a gate
    _combine_kernel[(hkv, rows, D // dc)](out, po, pm, pl, start, g, T, out.stride(0), g.stride(0),
                                          g.stride(1) if gate is not None else 0, GROUP=group, D=D, DC=dc,
                                          BLOCK_M=block_m, N_SPLITS=n_splits, N_CHUNKS=n_chunks, SP=sp,
                                          SPLIT_COLS=split_cols, CAUSAL=causal, HAS_GATE=gate is not None,
                                          num_warps=4)
    return out


def write_block(k_new, v_new, k_cache, v_cache, start, *, use_triton: bool | None = None) -> None:
    """k_new, v_new [Hkv, T, D] into the caches at columns start .. start + T - 1 (start: a one-element device
    tensor), in one launch where Triton runs (two index_copy_ elsewhere). Any T."""
    if use_triton is None:
        use_triton = triton_usable(k_new)
    hkv, T, D = k_new.shape
    if not use_triton or not supports(D) or k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
        positions = start.reshape(1).long() + torch.arange(T, device=k_new.device)
        k_cache.index_copy_(1, positions, k_new)
        v_cache.index_copy_(1, positions, v_new)
        return
    _write_block_kernel[(hkv, T)](k_new, v_new, k_cache, v_cache, start, k_new.stride(0), k_new.stride(1),
                                  v_new.stride(0), v_new.stride(1), k_cache.stride(0), k_cache.stride(1),
                                  v_cache.stride(0), v_cache.stride(1), D=D, num_warps=1)
