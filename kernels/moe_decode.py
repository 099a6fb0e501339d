"""The MoE experts for one token (a decode step): two GEMV-shaped Triton launches instead of three GEMM-shaped ones.

    inter[s]  = silu(gate[e_s] @ x) * (up[e_s] @ x)                       s = slot 0..K-1 (routed), K (shared)
    out       = sum_s scale_s * (down[e_s] @ inter[s])   (+ residual)     scale: routing weight, shared gate, or 1

Why a separate path: at one token the grouped GEMM of fused_moe.py runs 9 blocks (8 experts + the shared one) with
15 of its 16 rows empty, ~144 programs of 256 KB each over 132 SMs: one and a bit waves, so a few SMs do twice the
work and the gate_up launch took 17 us per layer against ~9 us of bandwidth on the H200 (35B-A3B shape). Here:

  1. `_gate_up_kernel`, grid (K+1 slots, I / BN): each program reads BN rows of its expert's gate and the matching
     up rows over the whole hidden size (plain loads, fp32 multiply-adds, no tensor cores: one row of x), so ~576
     programs of ~64 KB spread evenly; SiLU(gate) * up stored in x's dtype. The program of the shared slot's first
     tile also computes the shared expert's sigmoid gate.
  2. `_down_kernel`, grid (H / BH): each program owns BH output columns and walks the K+1 slots in order, so the
     weighted sum of the slots happens in registers in the order of fused_moe.py's slot-sum kernel (routed k = 0..K-1,
     then the shared one; fp32; cast once; residual added with PyTorch's rounding). No third launch, no atomics.

Rounding points are those of fused_moe.py's path: inter in x's dtype, rows in fp32 scaled by the routing weight,
one cast at the end. Only the order of the multiply-adds inside each dot differs (a dot is not a tensor-core tile
here), so decode and verify agree to rounding, not bit for bit (as the two tile configurations already did).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: fused_moe falls back to PyTorch before reaching this module's kernels
    triton = None

# Tiles chosen on the H200 at the Qwen3.6-35B-A3B shape by bench/kernel_sweep.py (see kernels/README.md).
DECODE_TILES = {"gate_up": {"BN": 8, "BK": 512, "warps": 4}, "down": {"BH": 8, "BI": 512, "warps": 4}}

if triton is not None:

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, sg_ptr, su_ptr, sgw_ptr, ids_ptr, inter_ptr, sgate_ptr,
                        top_k, H, I, stride_we, stride_wn, stride_sn,
                        HAS_SHARED_GATE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """Grid (slots, I / BN): inter[slot, n-tile] = silu(g . x) * (u . x); slot top_k is the shared expert."""
        slot = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        n_ok = offs_n < I
        if slot < top_k:
            e = tl.load(ids_ptr + slot).to(tl.int64)
            wg = w_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
            wu = wg + I * stride_wn
        else:
            wg = sg_ptr + offs_n[:, None] * stride_sn + offs_k[None, :]
            wu = su_ptr + offs_n[:, None] * stride_sn + offs_k[None, :]
        acc_g = tl.zeros([BN], tl.float32)
        acc_u = tl.zeros([BN], tl.float32)
        for k0 in range(0, H, BK):
            k_ok = k0 + offs_k < H
            xk = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            w_ok = n_ok[:, None] & k_ok[None, :]
            g = tl.load(wg + k0, mask=w_ok, other=0.0).to(tl.float32)
            u = tl.load(wu + k0, mask=w_ok, other=0.0).to(tl.float32)
            acc_g += tl.sum(g * xk[None, :], axis=1)
            acc_u += tl.sum(u * xk[None, :], axis=1)
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(inter_ptr + slot * I + offs_n, h.to(inter_ptr.dtype.element_ty), mask=n_ok)
        if HAS_SHARED_GATE:
            if (slot == top_k) & (pid_n == 0):  # sigmoid(x . shared_gate), in fp32 like fused_moe.py
                acc_s = tl.zeros([BK], tl.float32)
                for k0 in range(0, H, BK):
                    k_ok = k0 + offs_k < H
                    xk = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                    acc_s += xk * tl.load(sgw_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                tl.store(sgate_ptr, tl.sigmoid(tl.sum(acc_s, axis=0)))

    @triton.jit
    def _slot_row(inter_ptr, w_row_ptr, offs_h, h_ok, offs_i, I, stride_n, BH: tl.constexpr, BI: tl.constexpr):
        """(down_e @ inter_slot) for the BH output columns at offs_h, fp32."""
        row = tl.zeros([BH], tl.float32)
        for i0 in range(0, I, BI):
            i_ok = i0 + offs_i < I
            hv = tl.load(inter_ptr + i0 + offs_i, mask=i_ok, other=0.0).to(tl.float32)
            w = tl.load(w_row_ptr + offs_h[:, None] * stride_n + (i0 + offs_i)[None, :],
                        mask=h_ok[:, None] & i_ok[None, :], other=0.0).to(tl.float32)
            row += tl.sum(w * hv[None, :], axis=1)
        return row

    @triton.jit
    def _down_kernel(inter_ptr, w_ptr, sd_ptr, topk_w_ptr, sgate_ptr, ids_ptr, res_ptr, out_ptr,
                     H, I, stride_we, stride_wn, stride_sn,
                     TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_SHARED_GATE: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, BH: tl.constexpr, BI: tl.constexpr):
        """Grid (H / BH): out[h-tile] = sum over slots in order of scale * (down_e @ inter[slot]), then + residual."""
        offs_h = tl.program_id(0) * BH + tl.arange(0, BH)
        offs_i = tl.arange(0, BI)
        h_ok = offs_h < H
        acc = tl.zeros([BH], tl.float32)
        for k in tl.static_range(TOP_K):
            e = tl.load(ids_ptr + k).to(tl.int64)
            scale = tl.load(topk_w_ptr + k).to(tl.float32)
            row = _slot_row(inter_ptr + k * I, w_ptr + e * stride_we, offs_h, h_ok, offs_i, I, stride_wn, BH, BI)
            acc += row * scale
        if HAS_SHARED:
            row = _slot_row(inter_ptr + TOP_K * I, sd_ptr, offs_h, h_ok, offs_i, I, stride_sn, BH, BI)
            if HAS_SHARED_GATE:
                row = row * tl.load(sgate_ptr)
            acc += row
        out = acc.to(out_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + offs_h, mask=h_ok, other=0.0)
            out = (out.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_h, out, mask=h_ok)


def decode_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, shared=None, residual=None, tiles=None,
               out_dtype=None):
    """fused_moe for x [1, H] (inputs already checked and made contiguous by fused_moe_triton). tiles overrides
    DECODE_TILES (bench/kernel_sweep.py)."""
    tiles = tiles or DECODE_TILES
    gu, dn = tiles["gate_up"], tiles["down"]
    hidden = x.shape[1]
    inter = down_proj.shape[-1]
    top_k = topk_ids.shape[1]
    has_shared = shared is not None
    has_gate = has_shared and shared.gate is not None
    dev = x.device
    sg, su, sd = (shared.gate_proj, shared.up_proj, shared.down_proj) if has_shared else (
        gate_up_proj, gate_up_proj, down_proj)
    sgw = shared.gate.reshape(-1) if has_gate else x
    inter_buf = torch.empty(top_k + int(has_shared), inter, dtype=x.dtype, device=dev)
    sgate = torch.empty(1, dtype=torch.float32, device=dev)
    _gate_up_kernel[(top_k + int(has_shared), triton.cdiv(inter, gu["BN"]))](
        x, gate_up_proj, sg, su, sgw, topk_ids, inter_buf, sgate, top_k, hidden, inter,
        gate_up_proj.stride(0), gate_up_proj.stride(1), sg.stride(0),
        HAS_SHARED_GATE=has_gate, BN=gu["BN"], BK=gu["BK"], num_warps=gu["warps"])
    out = torch.empty(1, hidden, dtype=out_dtype or x.dtype, device=dev)
    res = residual if residual is not None else out  # unused without a residual
    _down_kernel[(triton.cdiv(hidden, dn["BH"]),)](
        inter_buf, down_proj, sd, topk_weights, sgate, topk_ids, res, out, hidden, inter,
        down_proj.stride(0), down_proj.stride(1), sd.stride(0),
        TOP_K=top_k, HAS_SHARED=has_shared, HAS_SHARED_GATE=has_gate, HAS_RESIDUAL=residual is not None,
        BH=dn["BH"], BI=dn["BI"], num_warps=dn["warps"])
    return out
