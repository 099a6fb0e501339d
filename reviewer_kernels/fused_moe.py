"""Fused MoE experts: a Triton grouped GEMM over (token, expert) slots, with a PyTorch fallback.

    out[t] = sum_k w[t,k] * down[e_tk] @ (silu(gate[e_tk] @ x[t]) * up[e_tk] @ x[t])  (+ shared expert)

A "slot" is one (token, expert) pair: slots 0..M*K-1 are the routed ones (token = slot // K), slots
M*K..M*K+M-1 the shared expert's (token = slot - M*K), which the kernels treat as expert number E.

Launches (all shapes depend only on M, so the whole thing can be captured in a CUDA graph; nothing syncs):
  1. `_align_kernel` (one program; skipped in direct mode): sorts slots by expert (in registers up to
     ONE_CHUNK_SLOTS; above, torch.sort sorts them first) and cuts each expert's slots into blocks of BM rows
     -> block table (expert, start, count), unused blocks marked -1.
  2. `_gate_up_kernel`, grid (blocks, I/BN, split): one block's rows times one N-tile of gate and up,
     SiLU(gate)*up stored to `inter[slot]`. Each expert's weight tile is read once per block, i.e. once when it
     has <= BM tokens. With split > 1 each program covers a slice of K and stores fp32 partial sums; the last
     program of a (block, N-tile) to finish (an atomic counter, as reviewer_kernels/wide_linear.py) adds them in split
     order and stores SiLU(gate)*up. One program also computes the shared expert's sigmoid gate.
  3. `_down_kernel`, grid (blocks, H/BN): inter @ down^T, scaled by the routing weight in the epilogue,
     stored in fp32 to `rows[slot]`.
  4. `_sum_slots_kernel`: out[t] = sum of its K (+1) rows in a fixed order. The order of every addition is
     fixed whoever finishes first: results are deterministic, which greedy decoding relies on. With the config's
     "sum_in_down" the down kernel does it instead: each program counts an arrival per token and N-tile (atomic
     counters, left at zero), and the one that stores a token's last row adds them in the same order (same bits,
     one launch fewer; not with `norm`, which needs whole rows).
K splits were meant for one token (a decode step in the batch-invariant numerics, which must use the verify's tiles:
9 active experts, ~144 programs of 256 KB over 132 SMs, a wave and a bit). Measured on the H200 they do not pay: 4 or
8 splits took 26-38 us a layer at one token against 25 unsplit, and far longer at 16 tokens (bench/results/
moe_invariant_tiles_split_finish_h200_20261204_170057.json), so no shipped entry splits; the tuner may still try them.
(Before 2026-12-04 the down kernel added the partials, in every one of its programs: 52-83 us at one token.)
One token (a decode step) takes reviewer_kernels/moe_decode.py instead: two GEMV-shaped launches, no block table;
so do up to `gemv_tokens` tokens when the config says so, each token through the one-token programs; with
`gemv_sorted_from` N, through moe_decode's block kernels (one binary for every token count, each expert's rows read
once a call: slots sorted by expert from N tokens, an align launch; direct below).
Direct mode (small M, as vLLM does for small tokens*top_k): block b < M*K is slot b alone, the last block holds
the shared expert's M slots; no sorting launch. Each expert is then read once per token routed to it, which
costs nothing extra while M*K is small.

Tile sizes come from `fused_moe_configs.json` (written by `bench/fused_moe.py --tune`), keyed by device name,
shape and token count; nothing is tuned at serve time.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from reviewer_kernels.moe_decode import blocks_moe, decode_moe
from reviewer_kernels.moe_reference import SharedExpert, fused_moe_torch, rms_norm_scaled, shared_expert_torch
from reviewer_kernels.rows_linear import split_workspace

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch fallback is used
    triton = None

CONFIG_PATH = Path(__file__).with_name("fused_moe_configs.json")
# slots (tokens x top_k) up to which align_slots sorts in registers: a 16-token verify with top-8 routing
ONE_CHUNK_SLOTS = 128
# block rows of the one-token programs' sorted calls (gemv_sorted_from): an expert's slots in one block up to a
# verify's 16 tokens (a token takes an expert once), so its rows are read once
GEMV_BLOCK_ROWS = 16


def triton_usable(x: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or anywhere under its CPU interpreter (TRITON_INTERPRET=1)."""
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def dot_size(n: int) -> bool:
    """Whether n can be a tile side of tl.arange and tl.dot: a power of two, at least 16."""
    return n >= 16 and not n & (n - 1)


def fused_moe(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: SharedExpert | None = None,
    *,
    use_triton: bool | None = None,
    config: dict | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
) -> torch.Tensor:
    """MoE experts (+ optional shared expert) for hidden_states [M, H]; returns [M, H] in its dtype.

    gate_up_proj [E, 2I, H], down_proj [E, H, I] (transformers' layout), topk_weights / topk_ids [M, K].
    use_triton=None picks Triton when it can run (CUDA, or TRITON_INTERPRET=1), else the PyTorch fallback.
    config overrides the tuned tile sizes (used by the tuner); its "decode" entry holds reviewer_kernels/moe_decode.py's
    tiles for one token (None: DECODE_TILES; False: the grouped path at one token too, for comparisons), and
    "gemv_tokens" N sends calls of up to N tokens there too, each token through the one-token programs (a row's bits
    then do not depend on the token count, as with the grouped tiles, and a decode step costs what one-token
    decoding does); with "gemv_sorted_from" S as well, through moe_decode.blocks_moe for every token count (each
    expert's rows read once a call; its slots sorted by expert from S tokens, direct blocks below: same bits).
    residual [M, H]: return residual + MoE(x), rounded as `residual + fused_moe(...)` would be (the MoE output in
    the model dtype first), with the add done by the kernel that sums the slots: one launch less per layer.
    out [M, H]: write the result there (e.g. rows of a larger tensor) instead of a new tensor.
    norm = (weight, eps, normed_out): also write rms_norm_scaled(result, weight, eps) (the next layer's pre-norm) to
    normed_out [M, H] (contiguous rows); the Triton path computes it in the kernel that sums the slots.
    """
    _check_shapes(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, shared)
    if residual is not None and residual.shape != hidden_states.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must have the shape of hidden_states, "
                         f"{tuple(hidden_states.shape)}")
    for name, t in (("out", out), ("normed_out", norm[2] if norm is not None else None)):
        if t is not None and (t.shape != hidden_states.shape or t.stride(-1) != 1):
            raise ValueError(f"{name} must be [{hidden_states.shape[0]}, {hidden_states.shape[1]}] with contiguous "
                             "rows")
    if use_triton is None:
        use_triton = triton_usable(hidden_states)
    if not use_triton:
        result = fused_moe_torch(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, shared)
        result = result if residual is None else residual + result
    elif shared is not None and shared.gate_proj.shape[0] != down_proj.shape[-1]:
        # The kernels treat the shared expert as expert E, which needs the same intermediate size.
        routed = fused_moe_triton(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, None, config)
        result = (routed.float() + shared_expert_torch(hidden_states.to(gate_up_proj.dtype), shared)).to(routed.dtype)
        result = result if residual is None else residual + result
    else:
        return fused_moe_triton(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, shared, config,
                                residual, out, norm)
    return _normed(result if out is None else out.copy_(result), norm)


def _normed(result: torch.Tensor, norm) -> torch.Tensor:
    """fused_moe's `norm` where no kernel computed it (the fallback; the one-token programs, which have no slot sum:
    a caller in a CUDA graph norms with reviewer_kernels/norms.py's one launch instead): result unchanged."""
    if norm is not None:
        weight, eps, normed_out = norm
        normed_out.copy_(rms_norm_scaled(result, weight, eps))
    return result


def _check_shapes(x, gate_up_proj, down_proj, topk_weights, topk_ids, shared):
    if x.dim() != 2:
        raise ValueError(f"hidden_states must be [tokens, hidden], got {tuple(x.shape)}")
    num_experts, two_inter, hidden = gate_up_proj.shape
    if hidden != x.shape[1] or two_inter % 2 or tuple(down_proj.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"expected gate_up_proj [E, 2I, H] and down_proj [E, H, I] with H={x.shape[1]}, got "
                         f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_weights must both be [tokens, top_k], got {tuple(topk_ids.shape)} "
                         f"and {tuple(topk_weights.shape)} for {x.shape[0]} tokens")
    if shared is not None:
        inter = shared.gate_proj.shape[0]
        if shared.up_proj.shape != (inter, hidden) or shared.down_proj.shape != (hidden, inter):
            raise ValueError("shared expert weights must be gate/up [Is, H] and down [H, Is]")


# ---------------------------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------------------------


def shape_key(num_experts: int, hidden: int, inter: int, top_k: int, has_shared: bool) -> str:
    return f"E{num_experts}_H{hidden}_I{inter}_K{top_k}_S{int(has_shared)}"


def default_config(num_tokens: int, top_k: int) -> dict:
    """Used when the tuned table has no entry for this device and shape."""
    direct = num_tokens * top_k <= 16
    block_m = 16 if num_tokens <= 128 else 32
    return {"direct": direct, "BM": block_m,
            "gate_up": {"BN": 32, "BK": 128, "warps": 4, "stages": 3},
            "down": {"BN": 64, "BK": 128, "warps": 4, "stages": 3}}


@functools.lru_cache(maxsize=None)
def _tuned_table() -> dict:
    return json.loads(CONFIG_PATH.read_text()) if CONFIG_PATH.exists() else {}


@functools.lru_cache(maxsize=4096)
def get_config(device_name: str, key: str, num_tokens: int, top_k: int) -> dict:
    """Tuned entry for the smallest tuned token count >= num_tokens (else the largest tuned one)."""
    by_tokens = _tuned_table().get(device_name, {}).get(key)
    if not by_tokens:
        return default_config(num_tokens, top_k)
    counts = sorted(int(m) for m in by_tokens)
    chosen = next((m for m in counts if m >= num_tokens), counts[-1])
    cfg = dict(by_tokens[str(chosen)])
    if cfg["direct"] and num_tokens > cfg["BM"]:  # direct mode puts all shared-expert rows in one block
        cfg["direct"] = False
    return cfg


def invariant_config(device_name: str, key: str, top_k: int) -> dict:
    """One tile set for every call of 1..16 tokens, for batch-invariant steps (a row's bits must not depend on how
    many tokens share the call): the table's "<key>_invariant" entry, tuned under a real router's locality by
    bench/moe_invariant_tiles.py (direct mode up to `direct_tokens`, sorted above: same bits), else the 16-token
    entry's tiles with direct blocks while a call's routed slots fit one block (default_config's rule: 2 tokens at
    top-8), sorted above. Not the one-token kernels (reviewer_kernels/moe_decode.py), whose order of additions
    differs, unless the entry says gemv_tokens: then they run every token count, so a row's bits still do not
    depend on it."""
    entry = _tuned_table().get(device_name, {}).get(key + "_invariant")
    if entry:  # an entry with gemv_tokens runs the one-token kernels (for every token count up to it)
        return dict(entry, decode=entry.get("decode") if entry.get("gemv_tokens") else False)
    # No entry for this device (a GPU the tuner has not run on, the interpreter): the 16-token entry alone is sorted,
    # so every decode step paid the align launch, 5.2 us at each MoE layer on an untuned H100 (2026-12-07), where
    # direct blocks need none. A row's bits are the same both ways (see fused_moe_triton), so the mode may change
    # with the token count.
    return dict(get_config(device_name, key, 16, top_k), direct=True, direct_tokens=max(1, 16 // top_k), decode=False)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------

if triton is not None:

    # Token-count-dependent arguments are not specialised, so a new token count never recompiles while serving.
    _RUNTIME_SIZES = ["num_routed", "num_tokens", "num_blocks_max"]

    @triton.jit
    def _sort_one_chunk(ids_ptr, sorted_ptr, num_routed, EP: tl.constexpr, CH: tl.constexpr):
        """num_routed <= CH: every slot's sorted position is the number of slots before it in (expert, slot)
        order, from one CH x CH comparison in registers; returns the per-expert counts [EP]. (Two passes through
        a cursor in memory took a 16-token verify's 128 slots 7 us, at every MoE layer.)"""
        lane = tl.arange(0, CH)
        ok = lane < num_routed
        ids = tl.load(ids_ptr + lane, mask=ok, other=EP - 1).to(tl.int32)  # EP - 1: past every expert and the shared
        before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (lane[None, :] < lane[:, None]))
        pos = tl.sum((before & ok[None, :]).to(tl.int32), axis=1)
        tl.store(sorted_ptr + pos, lane, mask=ok)
        counts = tl.histogram(ids, EP)
        return tl.where(tl.arange(0, EP) == EP - 1, 0, counts)  # the padding lanes' bin

    @triton.jit(do_not_specialize=_RUNTIME_SIZES)
    def _align_kernel(ids_ptr, counts_ptr, sorted_ptr, bexp_ptr, bstart_ptr, bcount_ptr,
                      num_routed, num_tokens, num_blocks_max, E,
                      HAS_SHARED: tl.constexpr, EP: tl.constexpr, CH: tl.constexpr, BM: tl.constexpr,
                      IN_REGISTERS: tl.constexpr):
        """One program: the block table of slots sorted by expert (stable: by slot within an expert).

        IN_REGISTERS (num_routed <= CH, a verify block): _sort_one_chunk sorts them here. Else the caller
        sorted the routed slots into sorted_ptr and left each expert's count in counts_ptr (align_slots, by
        torch.sort, for a prefill piece's thousands of slots: a one-program sort over chunks took 21 ms of a
        1,700-token piece's 212 ms at the 35B-A3B shape)."""
        experts = tl.arange(0, EP)
        if IN_REGISTERS:
            counts = _sort_one_chunk(ids_ptr, sorted_ptr, num_routed, EP, CH)
        else:
            counts = tl.load(counts_ptr + experts, mask=experts < E, other=0)
        if HAS_SHARED:
            counts += tl.where(experts == E, num_tokens, 0)
        seg_start = tl.cumsum(counts, axis=0) - counts
        lane = tl.arange(0, CH)
        if HAS_SHARED:
            shared_start = tl.sum(tl.where(experts == E, seg_start, 0), axis=0)
            for t0 in range(0, num_tokens, CH):
                tok = t0 + lane
                tl.store(sorted_ptr + shared_start + tok, num_routed + tok, mask=tok < num_tokens)
        nblk = (counts + BM - 1) // BM
        first_block = tl.cumsum(nblk, axis=0) - nblk
        for j in range(0, tl.max(nblk, axis=0)):
            has = j < nblk
            tl.store(bexp_ptr + first_block + j, experts, mask=has)
            tl.store(bstart_ptr + first_block + j, seg_start + j * BM, mask=has)
            tl.store(bcount_ptr + first_block + j, tl.minimum(counts - j * BM, BM), mask=has)
        for b0 in range(tl.sum(nblk, axis=0), num_blocks_max, CH):
            blk = b0 + lane
            unused = blk < num_blocks_max
            tl.store(bexp_ptr + blk, tl.full([CH], -1, tl.int32), mask=unused)
            tl.store(bstart_ptr + blk, tl.zeros([CH], tl.int32), mask=unused)
            tl.store(bcount_ptr + blk, tl.zeros([CH], tl.int32), mask=unused)

    @triton.jit
    def _block_rows(pid_b, ids_ptr, sorted_ptr, bexp_ptr, bstart_ptr, bcount_ptr, num_routed, num_tokens, E,
                    DIRECT: tl.constexpr, BM: tl.constexpr):
        """Expert (E = shared, -1 = unused block), slot of each of the BM rows, and which rows are real."""
        r = tl.arange(0, BM)
        if DIRECT:
            if pid_b < num_routed:
                e = tl.load(ids_ptr + pid_b).to(tl.int32)
                slots = pid_b + r
                valid = r < 1
            else:
                e = E + 0 * pid_b
                slots = num_routed + r
                valid = r < num_tokens
        else:
            e = tl.load(bexp_ptr + pid_b)
            start = tl.load(bstart_ptr + pid_b)
            valid = r < tl.load(bcount_ptr + pid_b)
            slots = tl.load(sorted_ptr + start + r, mask=valid, other=0)
        return e, slots, valid

    @triton.jit
    def _finish_splits(acc_g, acc_u, part, own, stride_split, mask, count, I, SPLIT_K: tl.constexpr):
        """Store this split's fp32 partials (gate at part, up at part + I, split s at s * stride_split) and count
        the arrival; the last program of the tile to arrive gets every split's sums added in split order (whatever
        order the programs finished in: the bits are fixed) and last=True, and leaves the counter at zero."""
        tl.store(part + own, acc_g, mask=mask)
        tl.store(part + own + I, acc_u, mask=mask)
        # acq_rel: this program's partials are visible before the count; the last one sees all of them
        arrived = tl.atomic_add(count, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        if last:
            acc_g = tl.zeros_like(acc_g)
            acc_u = tl.zeros_like(acc_u)
            for r in tl.static_range(SPLIT_K):
                acc_g += tl.load(part + r * stride_split, mask=mask, other=0.0, cache_modifier=".cg")
                acc_u += tl.load(part + r * stride_split + I, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count, 0)  # ready for the next call (launches on a stream run in order)
        return acc_g, acc_u, last

    @triton.jit(do_not_specialize=_RUNTIME_SIZES[:2])
    def _gate_up_kernel(x_ptr, w_ptr, sg_ptr, su_ptr, sgw_ptr, inter_ptr, part_ptr, count_ptr, sgate_ptr,
                        ids_ptr, sorted_ptr, bexp_ptr, bstart_ptr, bcount_ptr,
                        num_routed, num_tokens, top_k, E, H, I, k_per_split,
                        stride_x, stride_we, stride_wn, stride_sn, stride_inter, stride_split,
                        HAS_SHARED_GATE: tl.constexpr, DIRECT: tl.constexpr, SPLIT_K: tl.constexpr,
                        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRECISION: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HP: tl.constexpr):
        """Grid (block, N-tile, K-split): inter[slot] = silu(x@g) * (x@u) in x's dtype. SPLIT_K > 1: each
        program stores fp32 partial g | u sums [split, slot, 2I] to part_ptr, and the last of the tile's splits to
        finish adds them in split order and stores inter (_finish_splits)."""
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        e, slots, valid = _block_rows(pid_b, ids_ptr, sorted_ptr, bexp_ptr, bstart_ptr, bcount_ptr,
                                      num_routed, num_tokens, E, DIRECT, BM)
        if e < 0:
            return
        slots64 = slots.to(tl.int64)
        tok = tl.where(slots < num_routed, slots // top_k, slots - num_routed).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        n_ok = offs_n < I
        k_lo = pid_s * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, H)
        if e == E:  # shared expert: its own nn.Linear weights
            wg = sg_ptr + offs_n[None, :] * stride_sn + (k_lo + offs_k)[:, None]
            wu = su_ptr + offs_n[None, :] * stride_sn + (k_lo + offs_k)[:, None]
        else:
            base = w_ptr + e.to(tl.int64) * stride_we
            wg = base + offs_n[None, :] * stride_wn + (k_lo + offs_k)[:, None]
            wu = base + (offs_n[None, :] + I) * stride_wn + (k_lo + offs_k)[:, None]
        xp = x_ptr + tok[:, None] * stride_x + (k_lo + offs_k)[None, :]
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        # The loaded tiles feed only the dots: the plain pipelined-matmul shape (an extra use of the x tile
        # here gave wrong, run-to-run varying results with Hopper's async wgmma in Triton 3.6).
        for k0 in range(k_lo, k_hi, BK):
            k_ok = (k0 + offs_k < k_hi) | EVEN_K
            xt = tl.load(xp, mask=valid[:, None] & k_ok[None, :], other=0.0)
            if EVEN_N and EVEN_K:
                gt = tl.load(wg)
                ut = tl.load(wu)
            else:
                gt = tl.load(wg, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                ut = tl.load(wu, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_g = tl.dot(xt, gt, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xt, ut, acc_u, input_precision=PRECISION)
            xp += BK
            wg += BK
            wu += BK
        out_mask = valid[:, None] & n_ok[None, :]
        if SPLIT_K > 1:
            part = part_ptr + slots64[:, None] * (2 * I) + offs_n[None, :]
            acc_g, acc_u, last = _finish_splits(acc_g, acc_u, part, pid_s.to(tl.int64) * stride_split,
                                                stride_split, out_mask, count_ptr + pid_b * tl.num_programs(1) + pid_n,
                                                I, SPLIT_K)
        else:
            last = True
        if last:
            h = acc_g * tl.sigmoid(acc_g) * acc_u
            tl.store(inter_ptr + slots64[:, None] * stride_inter + offs_n[None, :],
                     h.to(inter_ptr.dtype.element_ty), mask=out_mask)
        if HAS_SHARED_GATE:  # sigmoid(x @ shared_gate) for the shared expert's rows, by one program
            if (e == E) & (pid_n == 0) & (pid_s == 0):
                # unrolled over the padded width HP: the chunks' loads go out together, where a loop over a runtime
                # bound made this program's tail, after its share of the weights, one round trip per chunk (8 at the
                # 35B-A3B shape), and the launch lasts as long as its last program; same additions in the same order
                acc_s = tl.zeros([BM], tl.float32)
                for ks in tl.static_range(0, HP, BK):
                    kk = ks + offs_k
                    xs = tl.load(x_ptr + tok[:, None] * stride_x + kk[None, :],
                                 mask=valid[:, None] & (kk < H)[None, :], other=0.0)
                    sgw = tl.load(sgw_ptr + kk, mask=kk < H, other=0.0)
                    acc_s += tl.sum(xs.to(tl.float32) * sgw.to(tl.float32)[None, :], axis=1)
                tl.store(sgate_ptr + tok, tl.sigmoid(acc_s), mask=valid)

    @triton.jit
    def _sum_when_last(rows_ptr, out_ptr, res_ptr, count_ptr, slots, valid, offs_n, n_ok, num_routed,
                       stride_rows, stride_out, stride_res, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                       HAS_RESIDUAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """After a down program stored its rows: count one arrival for each row's token (count_ptr: this N-tile's
        counters, one a token; a block's rows are distinct tokens, since a token's experts are distinct); for each
        token whose last row (of TOP_K routed + the shared one) this was, add its rows in _sum_slots_kernel's order
        (k = 0..K-1, then the shared row; fp32, cast once, plus the residual rounded once more), store them, and
        leave its counter at zero. Whichever program arrives last, the additions and so the bits are the same."""
        # int32 offsets (slots x hidden stay below 2^31: 131k tokens at top-8 and H 2048); int64 pointer tiles
        # spilled a register in Triton 3.6's sm_90 build
        tok = tl.where(slots < num_routed, slots // TOP_K, slots - num_routed)
        # the rows this CTA stored are visible before any of its arrivals is (acq_rel at GPU scope, after a barrier)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tok, 1, mask=valid, sem="acq_rel")
        tl.debug_barrier()
        rows_a_token = TOP_K
        if HAS_SHARED:
            rows_a_token = TOP_K + 1
        last = valid & (arrived == rows_a_token - 1)
        mask = last[:, None] & n_ok[None, :]
        acc = tl.zeros([BM, BN], tl.float32)
        routed_rows = rows_ptr + (tok * TOP_K)[:, None] * stride_rows + offs_n[None, :]  # one pointer tile, offset
        for k in tl.static_range(TOP_K):  # unrolled: every row's load issued before the first add
            acc += tl.load(routed_rows + k * stride_rows, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_SHARED:
            acc += tl.load(rows_ptr + (num_routed + tok)[:, None] * stride_rows + offs_n[None, :], mask=mask,
                           other=0.0, cache_modifier=".cg")
        out = acc.to(out_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + tok[:, None] * stride_res + offs_n[None, :], mask=mask, other=0.0)
            out = (out.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + tok[:, None] * stride_out + offs_n[None, :], out, mask=mask)
        tl.atomic_xchg(count_ptr + tok, 0, mask=last)  # ready for the next call (launches on a stream run in order)

    @triton.jit(do_not_specialize=_RUNTIME_SIZES[:2])
    def _down_kernel(inter_ptr, w_ptr, sd_ptr, topk_w_ptr, sgate_ptr, rows_ptr,
                     ids_ptr, sorted_ptr, bexp_ptr, bstart_ptr, bcount_ptr,
                     out_ptr, res_ptr, count_ptr,
                     num_routed, num_tokens, E, H, I,
                     stride_inter, stride_we, stride_wn, stride_sn, stride_rows, stride_out, stride_res,
                     HAS_SHARED_GATE: tl.constexpr, DIRECT: tl.constexpr,
                     EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRECISION: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUM_IN_DOWN: tl.constexpr,
                     TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """Grid (block, N-tile): rows[slot] = routing weight * (inter[slot] @ down^T), fp32. SUM_IN_DOWN: the
        program that stores the last of a token's rows for an N-tile also sums them into out (_sum_when_last), and
        _sum_slots_kernel does not run."""
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        e, slots, valid = _block_rows(pid_b, ids_ptr, sorted_ptr, bexp_ptr, bstart_ptr, bcount_ptr,
                                      num_routed, num_tokens, E, DIRECT, BM)
        if e < 0:
            return
        slots64 = slots.to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        n_ok = offs_n < H
        if e == E:
            wp = sd_ptr + offs_n[None, :] * stride_sn + offs_k[:, None]
        else:
            wp = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        # each row's scale (routing weight, or the shared expert's gate) is loaded before the tiles, not after them:
        # read after the loop, its round trip was the last thing every program waited for
        routed = slots < num_routed
        scale = tl.load(topk_w_ptr + slots64, mask=valid & routed, other=0.0).to(tl.float32)
        if HAS_SHARED_GATE:
            sg = tl.load(sgate_ptr + (slots64 - num_routed), mask=valid & (slots >= num_routed), other=0.0)
            scale = tl.where(routed, scale, sg)
        else:
            scale = tl.where(routed, scale, 1.0)
        hp = inter_ptr + slots64[:, None] * stride_inter + offs_k[None, :]
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, I, BK):
            k_ok = (k0 + offs_k < I) | EVEN_K
            ht = tl.load(hp, mask=valid[:, None] & k_ok[None, :], other=0.0)
            if EVEN_N and EVEN_K:
                wt = tl.load(wp)
            else:
                wt = tl.load(wp, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(ht, wt, acc, input_precision=PRECISION)
            hp += BK
            wp += BK
        tl.store(rows_ptr + slots64[:, None] * stride_rows + offs_n[None, :], acc * scale[:, None],
                 mask=valid[:, None] & n_ok[None, :])
        if SUM_IN_DOWN:
            _sum_when_last(rows_ptr, out_ptr, res_ptr, count_ptr + pid_n * num_tokens, slots, valid, offs_n, n_ok,
                           num_routed, stride_rows, stride_out, stride_res, TOP_K, HAS_SHARED, HAS_RESIDUAL, BM, BN)

    @triton.jit(do_not_specialize=["num_routed"])
    def _sum_slots_kernel(rows_ptr, out_ptr, res_ptr, nw_ptr, normed_ptr, num_routed, H, eps, stride_rows,
                          stride_out, stride_res, stride_normed, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                          HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr, BH: tl.constexpr):
        """out[t] = sum over its routed slots in order k = 0..K-1, then the shared slot; fp32, cast once; then
        (HAS_RESIDUAL) plus res[t], rounded once more: the rounding of `res + out` in PyTorch. HAS_NORM (a program
        holds the whole row, BH >= H): also normed[t] = rms_norm_scaled(out[t], nw, eps), the next layer's pre-norm.
        TOP_K is the model's constant, so the slot loop unrolls: every load is issued before the first add (a loop
        over a runtime count waited for each slot's row in turn, one memory round trip a slot); the additions keep
        their order, so the bits are those of the loop."""
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BH + tl.arange(0, BH)
        ok = offs < H
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + t * stride_res + offs, mask=ok, other=0.0)
        if HAS_NORM:
            nw = tl.load(nw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        acc = tl.zeros([BH], tl.float32)
        for k in tl.static_range(TOP_K):
            acc += tl.load(rows_ptr + (t * TOP_K + k) * stride_rows + offs, mask=ok, other=0.0)
        if HAS_SHARED:
            acc += tl.load(rows_ptr + (num_routed + t) * stride_rows + offs, mask=ok, other=0.0)
        out = acc.to(out_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            out = (out.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * stride_out + offs, out, mask=ok)
        if HAS_NORM:
            of = tl.where(ok, out.to(tl.float32), 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(of * of, axis=0) / H + eps)
            tl.store(normed_ptr + t * stride_normed + offs, (of * rstd * nw).to(normed_ptr.dtype.element_ty),
                     mask=ok)


@functools.lru_cache(maxsize=None)
def _device_name_of(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _device_name(x: torch.Tensor) -> str:
    return _device_name_of(x.device)


def num_blocks_bound(num_slots: int, num_experts: int, block_m: int) -> int:
    """Blocks the block table can need: sum_e ceil(c_e / BM) <= sum_e c_e // BM + (number of active experts)."""
    return num_slots // block_m + min(num_experts, num_slots)


def align_workspace(num_blocks: int, num_slots: int, padded_experts: int, device):
    """align_slots' int32 outputs and scratch as slices of one allocation, each starting on a 16-byte boundary.
    Triton specialises a pointer argument on 16-byte alignment, so slices at offsets that follow the token count
    gave the align, gate_up and down kernels new variants to compile for new prompt lengths while serving (3 on
    the first turn of the 35B-A3B replay of 2026-12-03, all _align_kernel). Returns (block_expert, block_start,
    block_count, sorted_slots, expert_counts): expert_counts is the prefill path's per-expert counts."""
    up = lambda n: -(-n // 4) * 4  # noqa: E731  (4 int32 = 16 bytes)
    nb, ns = up(num_blocks), up(num_slots)
    work = torch.empty(3 * nb + ns + padded_experts, dtype=torch.int32, device=device)
    return (work[:num_blocks], work[nb:nb + num_blocks], work[2 * nb:2 * nb + num_blocks],
            work[3 * nb:3 * nb + num_slots], work[3 * nb + ns:3 * nb + ns + padded_experts])


def align_slots(topk_ids: torch.Tensor, num_experts: int, has_shared: bool, block_m: int):
    """Sort (token, expert) slots by expert and cut them into blocks of <= block_m rows, on the device.

    Returns (sorted_slots [slots], block_expert, block_start, block_count [num_blocks_bound]), int32; the shared
    expert is expert `num_experts` with slots M*K..M*K+M-1; unused blocks have expert -1 and count 0.
    """
    num_tokens, top_k = topk_ids.shape
    num_routed = num_tokens * top_k
    num_slots = num_routed + (num_tokens if has_shared else 0)
    num_blocks = num_blocks_bound(num_slots, num_experts + int(has_shared), block_m)
    padded_experts = triton.next_power_of_2(num_experts + 2)  # + the shared expert + _sort_one_chunk's padding id
    bexp, bstart, bcount, sorted_slots, expert_counts = align_workspace(num_blocks, num_slots, padded_experts,
                                                                 topk_ids.device)
    ids = topk_ids.contiguous()
    in_registers = num_routed <= ONE_CHUNK_SLOTS
    if not in_registers:  # a stable sort by expert is the (expert, slot) order; the counts by an exact integer scatter
        flat = ids.reshape(-1)
        # keys as narrow as the expert ids allow: a radix sort makes a pass per key byte (int64 ids: 8 launches a
        # MoE layer, 2.0 ms of a 1,700-token prefill at the 35B-A3B shape); a stable sort's order is the same
        key = flat.to(torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2 ** 15 else flat.dtype)
        sorted_slots[:num_routed].copy_(torch.sort(key, stable=True).indices)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
        expert_counts[:num_experts].copy_(counts.scatter_add_(0, flat, torch.ones_like(flat)))
    _align_kernel[(1,)](ids, expert_counts, sorted_slots, bexp, bstart, bcount, num_routed, num_tokens, num_blocks,
                        num_experts, HAS_SHARED=has_shared, EP=padded_experts, CH=ONE_CHUNK_SLOTS if in_registers
                        else 64, BM=block_m, IN_REGISTERS=in_registers, num_warps=8)
    return sorted_slots, bexp, bstart, bcount


@dataclass
class Blocks:
    """A grouped call's block table: direct (block b < M*K is slot b alone, the last block the shared slots) or
    sorted by expert (align_slots: each block's expert, first sorted slot and row count, -1 for unused blocks)."""
    direct: bool
    count: int  # blocks launched (the table's length when sorted)
    rows: int  # BM
    sorted_slots: torch.Tensor
    expert: torch.Tensor
    start: torch.Tensor
    size: torch.Tensor

    def args(self) -> tuple:
        return self.sorted_slots, self.expert, self.start, self.size


def fused_moe_triton(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, shared=None, config=None,
                     residual=None, out=None, norm=None):
    """The Triton path (see the module docstring). Inputs as for `fused_moe`; no host synchronisation."""
    if triton is None:
        raise RuntimeError("triton is not installed; use fused_moe(), which falls back to PyTorch")
    x = hidden_states.to(gate_up_proj.dtype).contiguous()  # as transformers' grouped_mm does
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up_proj.shape
    top_k = topk_ids.shape[1]
    num_routed = num_tokens * top_k
    if gate_up_proj.stride(-1) != 1 or down_proj.stride(-1) != 1:
        raise ValueError("expert weights must be contiguous along their last dimension")
    if shared is not None:
        shared = SharedExpert(*(w.contiguous() if w is not None else None for w in shared))
    cfg = config or get_config(_device_name(x), shape_key(num_experts, hidden, two_inter // 2, top_k,
                                                          shared is not None), num_tokens, top_k)
    # a decode step, or up to the config's gemv_tokens each through the one-token programs: two GEMV-shaped launches
    if num_tokens <= max(1, cfg.get("gemv_tokens", 1)) and cfg.get("decode") is not False:
        ids = topk_ids.contiguous()
        args = (x, gate_up_proj, down_proj, topk_weights.contiguous(), ids, shared,
                None if residual is None else residual.contiguous())
        if "gemv_sorted_from" in cfg:  # the block kernels: each expert's rows read once a call, sorted from N tokens
            table = (align_slots(ids, num_experts, shared is not None, GEMV_BLOCK_ROWS)
                     if num_tokens >= cfg["gemv_sorted_from"] else None)
            result = blocks_moe(*args, table, cfg.get("decode"), hidden_states.dtype, out)
        else:
            result = decode_moe(*args, cfg.get("decode"), hidden_states.dtype, out)
        return _normed(result, norm)
    ids = topk_ids.contiguous()
    # direct_tokens: direct mode up to that many tokens, sorted above (a row's bits are the same in both: each
    # block row is its own slot's dot products over the same tiles, whoever shares the block)
    if cfg["direct"] and num_tokens <= min(cfg["BM"], cfg.get("direct_tokens", cfg["BM"])):
        blocks = Blocks(True, num_routed + int(shared is not None), cfg["BM"], ids, ids, ids, ids)  # no table
    else:
        table = align_slots(ids, num_experts, shared is not None, cfg["BM"])
        blocks = Blocks(False, table[1].numel(), cfg["BM"], *table)
    inter_buf, sgate = _gate_up(x, gate_up_proj, shared, ids, blocks, cfg["gate_up"])
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=hidden_states.dtype, device=x.device)
    # sum_in_down: the down kernel sums each token's rows (one launch fewer); not with the next norm, which needs
    # whole rows where a down program has an N-tile
    sum_in_down = bool(cfg.get("sum_in_down")) and norm is None
    rows = _down(inter_buf, down_proj, shared, topk_weights.contiguous(), sgate, ids, blocks, cfg["down"], out,
                 residual if sum_in_down else None, sum_in_down)
    if sum_in_down:
        return out
    return sum_slots(rows, num_tokens, top_k, shared is not None, out, residual, norm)


def _gate_up(x, gate_up_proj, shared, ids, blocks: Blocks, gu: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The first grouped launch: inter [slots, I] = SiLU(x @ gate) * (x @ up) in x's dtype, and the shared expert's
    sigmoid gate per token (fp32)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up_proj.shape
    inter, top_k, dev = two_inter // 2, ids.shape[1], x.device
    num_routed = num_tokens * top_k
    num_slots = num_routed + (num_tokens if shared is not None else 0)
    split = gu.get("split", 1)
    inter_buf = torch.empty(num_slots, inter, dtype=x.dtype, device=dev)
    # fp32 partial sums [split, slot, gate | up] and one arrival counter per (block, N-tile): split > 1 only
    part = torch.empty(split, num_slots, 2 * inter, dtype=torch.float32, device=dev) if split > 1 else inter_buf
    n_tiles = triton.cdiv(inter, gu["BN"])
    count = split_workspace(dev, 0, 0, blocks.count * n_tiles)[2] if split > 1 else inter_buf
    has_gate = shared is not None and shared.gate is not None
    sgate = torch.empty(num_tokens if has_gate else 1, dtype=torch.float32, device=dev)
    sg, su = (shared.gate_proj, shared.up_proj) if shared is not None else (gate_up_proj, gate_up_proj)
    sgw = shared.gate.reshape(-1) if has_gate else x
    _gate_up_kernel[(blocks.count, n_tiles, split)](
        x, gate_up_proj, sg, su, sgw, inter_buf, part, count, sgate, ids, *blocks.args(),
        num_routed, num_tokens, top_k, num_experts, hidden, inter, triton.cdiv(hidden, split * gu["BK"]) * gu["BK"],
        x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), sg.stride(0), inter_buf.stride(0),
        num_slots * 2 * inter, HAS_SHARED_GATE=has_gate, DIRECT=blocks.direct, SPLIT_K=split,
        EVEN_K=hidden % (gu["BK"] * split) == 0, EVEN_N=inter % gu["BN"] == 0, PRECISION=_precision(x),
        BM=blocks.rows, BN=gu["BN"], BK=gu["BK"], HP=triton.next_power_of_2(hidden), num_warps=gu["warps"],
        num_stages=gu["stages"])
    return inter_buf, sgate


def _down(inter_buf, down_proj, shared, weights, sgate, ids, blocks: Blocks, dn: dict, out, residual,
          sum_in_down: bool) -> torch.Tensor:
    """The second grouped launch: rows [slots, H] = scale * (inter @ down^T) in fp32 (scale: the routing weight or
    the shared gate); with sum_in_down also out = each token's rows summed (+ residual), in this launch."""
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = down_proj.shape
    num_slots, dev = inter_buf.shape[0], inter_buf.device
    has_shared = shared is not None
    rows = torch.empty(num_slots, hidden, dtype=torch.float32, device=dev)
    sd = shared.down_proj if has_shared else down_proj
    d_tiles = triton.cdiv(hidden, dn["BN"])
    arrivals = split_workspace(dev, 0, 0, d_tiles * num_tokens)[2] if sum_in_down else inter_buf
    res = residual if residual is not None else out  # unused without a residual
    _down_kernel[(blocks.count, d_tiles)](
        inter_buf, down_proj, sd, weights, sgate, rows, ids, *blocks.args(), out, res, arrivals,
        num_tokens * top_k, num_tokens, num_experts, hidden, inter,
        inter_buf.stride(0), down_proj.stride(0), down_proj.stride(1), sd.stride(0), rows.stride(0), out.stride(0),
        res.stride(0), HAS_SHARED_GATE=has_shared and shared.gate is not None, DIRECT=blocks.direct,
        EVEN_K=inter % dn["BK"] == 0, EVEN_N=hidden % dn["BN"] == 0, PRECISION=_precision(inter_buf),
        BM=blocks.rows, BN=dn["BN"], BK=dn["BK"], SUM_IN_DOWN=sum_in_down, TOP_K=top_k, HAS_SHARED=has_shared,
        HAS_RESIDUAL=residual is not None, num_warps=dn["warps"], num_stages=dn["stages"])
    return rows


def _precision(x: torch.Tensor) -> str:
    """tl.dot's input precision: exact fp32 products for fp32 models (the tests' and the interpreter's), tf32 else
    (bf16 / fp16 inputs: exact either way)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def sum_slots(rows: torch.Tensor, num_tokens: int, top_k: int, has_shared: bool, out: torch.Tensor,
              residual: torch.Tensor | None = None, norm=None, num_warps: int | None = None) -> torch.Tensor:
    """The experts' last launch: out[t] = the sum of token t's routed fp32 rows (slots t*K .. t*K+K-1, in k order),
    then its shared-expert row (slot M*K + t), cast once; plus residual and the next norm as `fused_moe` says.
    num_warps overrides the launch (bench/kernel_sweep.py)."""
    hidden = rows.shape[1]
    # with the next norm, a program per row (it needs the whole row's sum of squares)
    block_h = triton.next_power_of_2(hidden) if norm is not None else min(256, triton.next_power_of_2(hidden))
    res = residual if residual is not None else out  # unused without a residual
    nw, eps, normed = norm if norm is not None else (out, 0.0, out)  # unused without a norm
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        rows, out, res, nw, normed, num_tokens * top_k, hidden, eps, rows.stride(0), out.stride(0), res.stride(0),
        normed.stride(0), TOP_K=top_k, HAS_SHARED=has_shared, HAS_RESIDUAL=residual is not None,
        HAS_NORM=norm is not None, BH=block_h, num_warps=num_warps or (4 if block_h <= 1024 else 8))
    return out
