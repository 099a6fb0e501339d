"""The MoE experts for one token (a decode step): two GEMV-shaped Triton launches instead of three GEMM-shaped ones.

    inter[s]  = silu(gate[e_s] @ x) * (up[e_s] @ x)                       s = slot 0..K-1 (routed), K (shared)
    out       = sum_s scale_s * (down[e_s] @ inter[s])   (+ residual)     scale: routing weight, shared gate, or 1

Why a separate path: at one token the grouped GEMM of fused_moe.py runs 9 blocks (8 experts + the shared one) with
15 of its 16 rows empty, ~144 programs of 256 KB each over 132 SMs: one and a bit waves, so a few SMs do twice the
work and the gate_up launch took 17 us per layer against ~9 us of bandwidth on the H200 (35B-A3B shape). Here:

  1. `_gate_up_kernel`, grid (K+1 slots, I / BN): each program loads BN rows of its expert's gate and the matching
     up rows over the whole hidden size in one go (plain loads, fp32 multiply-adds, no tensor cores: one row of x),
     so ~4,600 programs of 8 KB spread evenly; SiLU(gate) * up stored in x's dtype. The program of the shared
     slot's first tile also computes the shared expert's sigmoid gate.
  2. `_down_kernel`, grid (H / BH): each program owns BH output columns and loads those rows of all K routed
     experts at once ([K, BH, I]) plus the shared expert's; the weighted sum of the slots happens in registers
     (fp32; cast once; residual added with PyTorch's rounding). No third launch, no atomics.
No loops: a first version walked the hidden size and the slots in loops, and each iteration waited for its own
loads (one DRAM round trip each): 13-14 us per launch in the step, no faster than the grouped path.

Rounding points are those of fused_moe.py's path: inter in x's dtype, rows in fp32 scaled by the routing weight,
one cast at the end. The order of the additions differs (inside each dot, and across the slots: a tree here, k
order there), so decode and verify agree to rounding, not bit for bit (as the two tile configurations already did).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: fused_moe falls back to PyTorch before reaching this module's kernels
    triton = None

# Tiles chosen on the H200 at the Qwen3.6-35B-A3B shape by bench/kernel_sweep.py (see reviewer_kernels/README.md).
DECODE_TILES = {"gate_up": {"BN": 1, "warps": 8}, "down": {"BH": 1, "warps": 1}}
# blocks_moe's gate/up programs per n-tile, each walking blocks until the table's first unused one: a decode step's 9
# slots get one each; a 16-token verify under a real router uses ~48 blocks (47 experts and the shared one), under
# random routing ~100 (two each). A guess until a GPU times it.
BLOCK_WORKERS = 48

if triton is not None:

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, sg_ptr, su_ptr, sgw_ptr, ids_ptr, inter_ptr, sgate_ptr,
                        top_k, slots, stride_x, stride_we, stride_wn, stride_sn,
                        H: tl.constexpr, I: tl.constexpr, HP: tl.constexpr, HAS_SHARED_GATE: tl.constexpr,
                        BN: tl.constexpr):
        """Grid (tokens x slots, I / BN): inter[token, slot, n-tile] = silu(g . x) * (u . x); slots = top_k (+ 1:
        slot top_k is the shared expert). Each program loads its whole [BN, H] gate and up tiles at once (no loop):
        a program's loads are all in flight together, and the many small programs of an SM cover each other's
        latency. A token's programs are the one-token call's, whatever the token count: the same code on its row."""
        tok = tl.program_id(0) // slots
        slot = tl.program_id(0) % slots
        pid_n = tl.program_id(1)
        x_ptr += tok.to(tl.int64) * stride_x
        ids_ptr += tok * top_k
        inter_ptr += tok.to(tl.int64) * slots * I
        sgate_ptr += tok
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, HP)
        n_ok = offs_n < I
        k_ok = offs_k < H
        if slot < top_k:
            e = tl.load(ids_ptr + slot).to(tl.int64)
            wg = w_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
            wu = wg + I * stride_wn
        else:
            wg = sg_ptr + offs_n[:, None] * stride_sn + offs_k[None, :]
            wu = su_ptr + offs_n[:, None] * stride_sn + offs_k[None, :]
        w_ok = n_ok[:, None] & k_ok[None, :]
        g = tl.load(wg, mask=w_ok, other=0.0)
        u = tl.load(wu, mask=w_ok, other=0.0)
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        acc_g = tl.sum(g.to(tl.float32) * x[None, :], axis=1)
        acc_u = tl.sum(u.to(tl.float32) * x[None, :], axis=1)
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(inter_ptr + slot * I + offs_n, h.to(inter_ptr.dtype.element_ty), mask=n_ok)
        if HAS_SHARED_GATE:
            if (slot == top_k) & (pid_n == 0):  # sigmoid(x . shared_gate), in fp32 like fused_moe.py
                sgw = tl.load(sgw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                tl.store(sgate_ptr, tl.sigmoid(tl.sum(x * sgw, axis=0)))

    @triton.jit
    def _down_kernel(inter_ptr, w_ptr, sd_ptr, topk_w_ptr, sgate_ptr, ids_ptr, res_ptr, out_ptr,
                     slots, stride_we, stride_wn, stride_sn, stride_res, stride_out,
                     H: tl.constexpr, I: tl.constexpr, IP: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                     HAS_SHARED: tl.constexpr, HAS_SHARED_GATE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     BH: tl.constexpr):
        """Grid (tokens, H / BH): out[token, h-tile] = sum over its routed slots of weight * (down_e @ inter[slot]),
        plus the shared slot (times its gate), then + residual. One load brings the BH rows of all K routed experts
        ([K, BH, I]). Tokens vary fastest, so the tokens of an h-tile run side by side and an expert they share is
        read from memory once and from L2 after; each token's program is the one-token call's."""
        tok = tl.program_id(0).to(tl.int64)
        offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
        inter_ptr += tok * slots * I
        topk_w_ptr += tok * TOP_K
        ids_ptr += tok * TOP_K
        sgate_ptr += tok
        res_ptr += tok * stride_res
        out_ptr += tok * stride_out
        offs_i = tl.arange(0, IP)
        ks = tl.arange(0, KP)
        h_ok = offs_h < H
        i_ok = offs_i < I
        k_ok = ks < TOP_K
        e = tl.load(ids_ptr + ks, mask=k_ok, other=0).to(tl.int64)
        w = tl.load(w_ptr + e[:, None, None] * stride_we + offs_h[None, :, None] * stride_wn + offs_i[None, None, :],
                    mask=k_ok[:, None, None] & h_ok[None, :, None] & i_ok[None, None, :], other=0.0)
        if HAS_SHARED:
            ws = tl.load(sd_ptr + offs_h[:, None] * stride_sn + offs_i[None, :],
                         mask=h_ok[:, None] & i_ok[None, :], other=0.0)
        hv = tl.load(inter_ptr + ks[:, None] * I + offs_i[None, :], mask=k_ok[:, None] & i_ok[None, :],
                     other=0.0).to(tl.float32)
        scale = tl.load(topk_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        rows = tl.sum(w.to(tl.float32) * hv[:, None, :], axis=2)  # [K, BH], fp32
        acc = tl.sum(rows * scale[:, None], axis=0)
        if HAS_SHARED:
            hs = tl.load(inter_ptr + TOP_K * I + offs_i, mask=i_ok, other=0.0).to(tl.float32)
            row = tl.sum(ws.to(tl.float32) * hs[None, :], axis=1)
            if HAS_SHARED_GATE:
                row = row * tl.load(sgate_ptr)
            acc += row
        out = acc.to(out_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + offs_h, mask=h_ok, other=0.0)
            out = (out.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_h, out, mask=h_ok)


@dataclass
class Operands:
    """What both pairs of launches take besides the routing: the shared expert's weights (the routed tensors stand in
    where there is none: never read), its gate vector, slots a token (top_k + shared), the intermediate rows
    [T * slots, I] and the shared gates [T], the output and the residual (out again without one: never read)."""
    sg: torch.Tensor
    su: torch.Tensor
    sd: torch.Tensor
    sgw: torch.Tensor
    has_gate: bool
    slots: int
    inter_buf: torch.Tensor
    sgate: torch.Tensor
    out: torch.Tensor
    res: torch.Tensor


def operands(x, gate_up_proj, down_proj, topk_ids, shared, residual, out_dtype, out) -> Operands:
    num_tokens, hidden = x.shape
    has_gate = shared is not None and shared.gate is not None
    sg, su, sd = (shared.gate_proj, shared.up_proj, shared.down_proj) if shared is not None else (
        gate_up_proj, gate_up_proj, down_proj)
    slots = topk_ids.shape[1] + int(shared is not None)  # a token's: rows token * slots + 0..K-1, then the shared one
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=out_dtype or x.dtype, device=x.device)
    return Operands(sg, su, sd, shared.gate.reshape(-1) if has_gate else x, has_gate, slots,
                    torch.empty(num_tokens * slots, down_proj.shape[-1], dtype=x.dtype, device=x.device),
                    torch.empty(num_tokens, dtype=torch.float32, device=x.device), out,
                    residual if residual is not None else out)


def decode_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, shared=None, residual=None, tiles=None,
               out_dtype=None, out=None):
    """fused_moe for x [T, H] (inputs already checked and made contiguous by fused_moe_triton): a decode step's one
    token, or T tokens each through exactly the one-token programs (the grids gain a token axis), so a token's row
    has the same bits whatever T is (fused_moe's config "gemv_tokens"). tiles overrides DECODE_TILES
    (bench/kernel_sweep.py). out: the [T, H] tensor to write (rows of a larger one, contiguous along H), else new."""
    tiles = tiles or DECODE_TILES
    gu, dn = tiles["gate_up"], tiles["down"]
    num_tokens, hidden = x.shape
    inter, top_k = down_proj.shape[-1], topk_ids.shape[1]
    o = operands(x, gate_up_proj, down_proj, topk_ids, shared, residual, out_dtype, out)
    _gate_up_kernel[(num_tokens * o.slots, triton.cdiv(inter, gu["BN"]))](
        x, gate_up_proj, o.sg, o.su, o.sgw, topk_ids, o.inter_buf, o.sgate, top_k, o.slots, x.stride(0),
        gate_up_proj.stride(0), gate_up_proj.stride(1), o.sg.stride(0),
        H=hidden, I=inter, HP=triton.next_power_of_2(hidden), HAS_SHARED_GATE=o.has_gate, BN=gu["BN"],
        num_warps=gu["warps"])
    _down_kernel[(num_tokens, triton.cdiv(hidden, dn["BH"]))](
        o.inter_buf, down_proj, o.sd, topk_weights, o.sgate, topk_ids, o.res, o.out,
        o.slots, down_proj.stride(0), down_proj.stride(1), o.sd.stride(0), o.res.stride(0), o.out.stride(0),
        H=hidden, I=inter, IP=triton.next_power_of_2(inter), TOP_K=top_k, KP=triton.next_power_of_2(top_k),
        HAS_SHARED=shared is not None, HAS_SHARED_GATE=o.has_gate, HAS_RESIDUAL=residual is not None,
        BH=dn["BH"], num_warps=dn["warps"])
    return o.out


# ---------------------------------------------------------------------------------------------------------------
# The one-token programs for a verify block: each expert's weights read once (fused_moe's "gemv_sorted_from")
# ---------------------------------------------------------------------------------------------------------------
# decode_moe's token axis (gemv_tokens) gives a 16-token verify 16 one-token calls side by side: a row's bits are its
# one-token call's, but every token re-reads its 9 experts' 57 MB (35B-A3B shape), from L2 when a neighbour shares
# the expert, and L2 on Hopper is barely faster than HBM. Here the gate/up launch takes one block per expert (its
# slots sorted together by fused_moe.align_slots), loads the expert's rows once and walks its slots; the down launch
# takes one h-tile per program and walks the tokens, so the rows of an expert two tokens share come from L1. Both
# run the same binary for every token count (the count, the block table and direct-or-sorted are runtime values,
# none specialised), and a token's arithmetic inside the walk is the same instruction sequence each time: a row's
# bits cannot depend on how many tokens the call has. They are not decode_moe's bits (another kernel), so a
# configuration takes these for every token count or not at all.

if triton is not None:

    @triton.jit
    def _block(b, nd, blocks, num_routed, E, ids_ptr, bexp_ptr, bstart_ptr, bcount_ptr):
        """Block b's (expert, first table entry, slots): align_slots' table (sorted: nd), or slot b alone (direct: b <
        T*K routed, then token b - T*K's shared slot). Past the launch's blocks, or an unused sorted block: no slots.
        Branch-free, so both modes run one body."""
        inside = b < blocks
        e_direct = tl.load(ids_ptr + b, mask=(~nd) & (b < num_routed), other=E).to(tl.int32)
        e = tl.where(nd, tl.load(bexp_ptr + b, mask=nd & inside, other=-1), e_direct)
        start = tl.where(nd, tl.load(bstart_ptr + b, mask=nd & inside, other=0), b)
        count = tl.where(nd, tl.load(bcount_ptr + b, mask=nd & inside, other=0), 1)
        return e, start, tl.where(inside, count, 0)

    @triton.jit
    def _gate_up_slot(s, g, u, sgw_ptr, x_ptr, inter_ptr, sgate_ptr, num_routed, top_k, slots, stride_x, offs_n, n_ok,
                      offs_k, k_ok, pid_n, I: tl.constexpr, HAS_SHARED_GATE: tl.constexpr):
        """One slot of a block: inter[token, k, n-tile] = silu(g . x) * (u . x), the one-token program's arithmetic on
        the slot's token (and the shared gate's sigmoid, once per token)."""
        routed = s < num_routed
        tok = tl.where(routed, s // top_k, s - num_routed).to(tl.int64)
        k = tl.where(routed, s % top_k, top_k)
        x = tl.load(x_ptr + tok * stride_x + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        acc_g = tl.sum(g.to(tl.float32) * x[None, :], axis=1)
        acc_u = tl.sum(u.to(tl.float32) * x[None, :], axis=1)
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(inter_ptr + (tok * slots + k) * I + offs_n, h.to(inter_ptr.dtype.element_ty), mask=n_ok)
        if HAS_SHARED_GATE:
            if (k == top_k) & (pid_n == 0):  # sigmoid(x . shared_gate), in fp32 like fused_moe.py; its weights
                # loaded here only (every program loading them was 18 MB of L2 reads a decode layer)
                sgw = tl.load(sgw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                tl.store(sgate_ptr + tok, tl.sigmoid(tl.sum(x * sgw, axis=0)))

    @triton.jit(do_not_specialize=["num_tokens", "direct", "blocks"])
    def _gate_up_blocks_kernel(x_ptr, w_ptr, sg_ptr, su_ptr, sgw_ptr, ids_ptr, slots_ptr, bexp_ptr, bstart_ptr,
                               bcount_ptr, inter_ptr, sgate_ptr, num_tokens, direct, blocks, E, top_k, slots,
                               stride_x, stride_we, stride_wn, stride_sn, H: tl.constexpr, I: tl.constexpr,
                               HP: tl.constexpr, HAS_SHARED_GATE: tl.constexpr, BN: tl.constexpr):
        """Grid (I / BN, workers): worker w takes blocks w, w + workers, ... (_block: an expert's sorted slots, or one
        slot in direct mode) until the first without slots (align_slots puts the used blocks first, and bounds the
        table by far more than a verify uses: a program per table entry would launch ~100 empty ones an n-tile). For
        each block it loads the expert's [BN, H] gate and up rows once (expert E: the shared one), then walks the
        block's slots (_gate_up_slot)."""
        pid_n = tl.program_id(0)
        b = tl.program_id(1)
        num_routed = num_tokens * top_k
        nd = (tl.full([], 0, tl.int32) + direct) == 0  # a tensor, also where the interpreter passes a Python int
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, HP)
        n_ok = offs_n < I
        k_ok = offs_k < H
        w_ok = n_ok[:, None] & k_ok[None, :]
        e, start, count = _block(b, nd, blocks, num_routed, E, ids_ptr, bexp_ptr, bstart_ptr, bcount_ptr)
        while count > 0:
            if e < E:
                wg = w_ptr + e.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
                wu = wg + I * stride_wn
            else:
                wg = sg_ptr + offs_n[:, None] * stride_sn + offs_k[None, :]
                wu = su_ptr + offs_n[:, None] * stride_sn + offs_k[None, :]
            g = tl.load(wg, mask=w_ok, other=0.0)  # widened inside the walk: a slot's x load issues before they land
            u = tl.load(wu, mask=w_ok, other=0.0)
            for j in range(count):
                s = tl.where(nd, tl.load(slots_ptr + start + j, mask=nd, other=0), start)
                _gate_up_slot(s, g, u, sgw_ptr, x_ptr, inter_ptr, sgate_ptr, num_routed, top_k, slots, stride_x, offs_n,
                              n_ok, offs_k, k_ok, pid_n, I, HAS_SHARED_GATE)
            b += tl.num_programs(1)
            e, start, count = _block(b, nd, blocks, num_routed, E, ids_ptr, bexp_ptr, bstart_ptr, bcount_ptr)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _down_tokens_kernel(inter_ptr, w_ptr, sd_ptr, topk_w_ptr, sgate_ptr, ids_ptr, res_ptr, out_ptr, num_tokens,
                            slots, stride_we, stride_wn, stride_sn, stride_res, stride_out,
                            H: tl.constexpr, I: tl.constexpr, IP: tl.constexpr, TOP_K: tl.constexpr,
                            KP: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_SHARED_GATE: tl.constexpr,
                            HAS_RESIDUAL: tl.constexpr, BH: tl.constexpr):
        """Grid (H / BH): for each token in turn, out[token, h-tile] = sum over its routed slots of weight *
        (down_e @ inter[slot]), plus the shared slot (times its gate), then + residual: _down_kernel's arithmetic
        for one token. The shared expert's rows are loaded once; a routed expert's rows, from L1 when an earlier
        token of the walk had it."""
        offs_h = tl.program_id(0) * BH + tl.arange(0, BH)
        offs_i = tl.arange(0, IP)
        ks = tl.arange(0, KP)
        h_ok = offs_h < H
        i_ok = offs_i < I
        k_ok = ks < TOP_K
        if HAS_SHARED:
            ws = tl.load(sd_ptr + offs_h[:, None] * stride_sn + offs_i[None, :],
                         mask=h_ok[:, None] & i_ok[None, :], other=0.0).to(tl.float32)
        for t in range(num_tokens):
            tok = t  # offsets stay small: T x slots x I elements
            e = tl.load(ids_ptr + tok * TOP_K + ks, mask=k_ok, other=0).to(tl.int64)
            w = tl.load(w_ptr + e[:, None, None] * stride_we + offs_h[None, :, None] * stride_wn
                        + offs_i[None, None, :], mask=k_ok[:, None, None] & h_ok[None, :, None] & i_ok[None, None, :],
                        other=0.0)
            hv = tl.load(inter_ptr + tok * slots * I + ks[:, None] * I + offs_i[None, :],
                         mask=k_ok[:, None] & i_ok[None, :], other=0.0).to(tl.float32)
            scale = tl.load(topk_w_ptr + tok * TOP_K + ks, mask=k_ok, other=0.0).to(tl.float32)
            rows = tl.sum(w.to(tl.float32) * hv[:, None, :], axis=2)  # [K, BH], fp32
            acc = tl.sum(rows * scale[:, None], axis=0)
            if HAS_SHARED:
                hs = tl.load(inter_ptr + tok * slots * I + TOP_K * I + offs_i, mask=i_ok, other=0.0).to(tl.float32)
                row = tl.sum(ws * hs[None, :], axis=1)
                if HAS_SHARED_GATE:
                    row = row * tl.load(sgate_ptr + tok)
                acc += row
            out = acc.to(out_ptr.dtype.element_ty)
            if HAS_RESIDUAL:
                res = tl.load(res_ptr + tok * stride_res + offs_h, mask=h_ok, other=0.0)
                out = (out.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + tok * stride_out + offs_h, out, mask=h_ok)


def blocks_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, shared=None, residual=None, table=None,
               tiles=None, out_dtype=None, out=None):
    """decode_moe's math for x [T, H] with each expert's weights read once per call: table None runs direct blocks
    (a slot each: a decode step, no sorting launch), else fused_moe.align_slots' (sorted_slots, expert, start, count)
    for the shared expert too (one block per expert when its block rows are >= T). Same binary for both and for
    every T: a row's bits depend on its token alone. Inputs checked and contiguous as for decode_moe."""
    tiles = tiles or DECODE_TILES
    gu, dn = tiles["gate_up"], tiles["down"]
    num_tokens, hidden = x.shape
    num_experts, inter, top_k = down_proj.shape[0], down_proj.shape[-1], topk_ids.shape[1]
    o = operands(x, gate_up_proj, down_proj, topk_ids, shared, residual, out_dtype, out)
    if table is None:  # direct: block b is slot b (the routed ones, then each token's shared slot); the table's
        # int32 placeholder is never read, and keeps the kernel's argument types (so its binary) the sorted call's
        blocks, direct, table = num_tokens * o.slots, 1, (torch.empty(1, dtype=torch.int32, device=x.device),) * 4
    else:
        blocks, direct = table[1].numel(), 0
    _gate_up_blocks_kernel[(triton.cdiv(inter, gu["BN"]), min(blocks, BLOCK_WORKERS))](
        x, gate_up_proj, o.sg, o.su, o.sgw, topk_ids, *table, o.inter_buf, o.sgate, num_tokens, direct, blocks,
        num_experts, top_k, o.slots, x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), o.sg.stride(0),
        H=hidden, I=inter, HP=triton.next_power_of_2(hidden), HAS_SHARED_GATE=o.has_gate, BN=gu["BN"],
        num_warps=gu["warps"])
    _down_tokens_kernel[(triton.cdiv(hidden, dn["BH"]),)](
        o.inter_buf, down_proj, o.sd, topk_weights, o.sgate, topk_ids, o.res, o.out, num_tokens,
        o.slots, down_proj.stride(0), down_proj.stride(1), o.sd.stride(0), o.res.stride(0), o.out.stride(0),
        H=hidden, I=inter, IP=triton.next_power_of_2(inter), TOP_K=top_k, KP=triton.next_power_of_2(top_k),
        HAS_SHARED=shared is not None, HAS_SHARED_GATE=o.has_gate, HAS_RESIDUAL=residual is not None,
        BH=dn["BH"], num_warps=dn["warps"])
    return o.out
