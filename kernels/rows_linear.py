"""A decode step's or a verify block's projection (T <= 16 rows) on the tensor cores, one launch, the same kernel
whatever T is:

    rows_linear(x, w, norm=(nw, eps))                         y = W rms_norm(x)            the LM head
    rows_linear(x, w, norm=(nw, eps), swiglu=True)            y = silu(W_g a) * (W_u a)    gate/up, w = [W_g; W_u]
    rows_linear(x, w, norm=(nw, eps), rope=(cos, sin, pos, n))  RoPE on rows < n of W a    the fused q/k/v projection
    rows_linear(x, w, residual=r)                             r + W x                      output and down projections

Why: speculative decoding is token-identical to plain decoding only if a position's logits come out bitwise the
same from a one-token decode step and from inside a 16-token verify. cuBLAS (and kernels/norm_gemv.py's one-row
programs) compute a row differently for 1 and 16 rows, or pay 16x the programs for a verify. Here every program
holds a fixed 16-row tile of the input (rows past T are zeros) and walks K in fixed chunks into one fp32
accumulator through tl.dot: the tile shapes, the chunk order and the instructions are the same for T = 1 and T = 16,
and an MMA computes each output row from its own input row, so row t's bits do not depend on T (nor on the row's
slot). The weights are read once per call whatever T is; the 15 idle rows of a decode step cost tensor-core work,
which is free in a memory-bound step.

Rounding follows backend/models/llama.py (as kernels/norm_gemv.py does): the norm in fp32, cast to x's dtype, times
the norm weight and cast again (the tensor cores take x's dtype); accumulation in fp32, cast once (F.linear's
output); the epilogue in fp32 from those casts, cast once. `rows_linear_torch` is the PyTorch twin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fused_moe import triton, triton_usable

PLAIN, SWIGLU, ROPE = 0, 1, 2
BLOCK_ROWS = 16  # the input tile: a verify block's largest size
MAX_ROWS = BLOCK_ROWS
# Output columns per program and K per step. Chosen on the H200 at the SmolLM2-135M shapes (see kernels/README.md).
ROWS_TILES = {"BN": 16, "BK": 64, "warps": 2, "stages": 4}

if triton is not None:
    import triton.language as tl

    _SWIGLU, _ROPE = tl.constexpr(SWIGLU), tl.constexpr(ROPE)

    @triton.jit(do_not_specialize=["T"])
    def _rows_linear_kernel(x_ptr, nw_ptr, w_ptr, y_ptr, res_ptr, cos_ptr, sin_ptr, pos_ptr, T, N_OUT, ROTATED,
                            stride_wn, stride_cs, eps, K: tl.constexpr, BK: tl.constexpr, EPILOGUE: tl.constexpr,
                            NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HALF: tl.constexpr,
                            BN: tl.constexpr, IEEE: tl.constexpr, STAGES: tl.constexpr):
        """Grid (programs,): PLAIN columns p*BN..; SWIGLU gate columns p*BN.. with up columns N_OUT + those; ROPE
        columns j..j+BN of a head's first half (HALF = head_dim / 2) with their partners j + HALF."""
        BM: tl.constexpr = 16
        p = tl.program_id(0)
        rows = tl.arange(0, BM)
        r_ok = rows < T
        lane = tl.arange(0, BN)
        if EPILOGUE == _ROPE:
            per_head = HALF // BN
            j = (p % per_head) * BN + lane  # position within the head's first half
            cols_a = (p // per_head) * (2 * HALF) + j
            cols_b = cols_a + HALF
        else:
            cols_a = p * BN + lane
            cols_b = cols_a + N_OUT
        a_ok = cols_a < N_OUT
        if NORM:  # each row's sum of squares, chunk by chunk in a fixed order
            ss = tl.zeros([BM], tl.float32)
            for k0 in range(0, K, BK):
                offs_k = k0 + tl.arange(0, BK)
                xk = tl.load(x_ptr + rows[:, None] * K + offs_k[None, :],
                             mask=r_ok[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
                ss += tl.sum(xk * xk, axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc_a = tl.zeros([BM, BN], tl.float32)
        acc_b = tl.zeros([BM, BN], tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < K
            xk = tl.load(x_ptr + rows[:, None] * K + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                a = (xk.to(tl.float32) * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
                a = (a * tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :])
                a = a.to(x_ptr.dtype.element_ty)
            else:
                a = xk
            wa = tl.load(w_ptr + cols_a[:, None] * stride_wn + offs_k[None, :], mask=a_ok[:, None] & k_ok[None, :],
                         other=0.0)
            acc_a = tl.dot(a, tl.trans(wa), acc_a, input_precision="ieee" if IEEE else "tf32")
            if EPILOGUE != 0:
                wb = tl.load(w_ptr + cols_b[:, None] * stride_wn + offs_k[None, :],
                             mask=a_ok[:, None] & k_ok[None, :], other=0.0)
                acc_b = tl.dot(a, tl.trans(wb), acc_b, input_precision="ieee" if IEEE else "tf32")
        ya = acc_a.to(y_ptr.dtype.element_ty).to(tl.float32)
        out = y_ptr + rows[:, None] * N_OUT
        ok = r_ok[:, None] & a_ok[None, :]
        if EPILOGUE == _SWIGLU:
            yb = acc_b.to(y_ptr.dtype.element_ty).to(tl.float32)
            tl.store(out + cols_a[None, :], (ya * tl.sigmoid(ya) * yb).to(y_ptr.dtype.element_ty), mask=ok)
        elif EPILOGUE == _ROPE:
            yb = acc_b.to(y_ptr.dtype.element_ty).to(tl.float32)
            pos = tl.load(pos_ptr + rows, mask=r_ok, other=0)
            cs = cos_ptr + pos[:, None] * stride_cs + j[None, :]
            sn = sin_ptr + pos[:, None] * stride_cs + j[None, :]
            cos_a, sin_a = tl.load(cs).to(tl.float32), tl.load(sn).to(tl.float32)
            cos_b, sin_b = tl.load(cs + HALF).to(tl.float32), tl.load(sn + HALF).to(tl.float32)
            rot = (cols_a < ROTATED)[None, :]  # queries and keys; values pass through
            tl.store(out + cols_a[None, :], tl.where(rot, ya * cos_a - yb * sin_a, ya).to(y_ptr.dtype.element_ty),
                     mask=ok)
            tl.store(out + cols_b[None, :], tl.where(rot, yb * cos_b + ya * sin_b, yb).to(y_ptr.dtype.element_ty),
                     mask=ok)
        else:
            if HAS_RESIDUAL:  # residual + y, each rounded as PyTorch rounds the two steps
                res = tl.load(res_ptr + rows[:, None] * N_OUT + cols_a[None, :], mask=ok, other=0.0)
                ya = (res.to(tl.float32) + ya).to(y_ptr.dtype.element_ty).to(tl.float32)
            tl.store(out + cols_a[None, :], ya.to(y_ptr.dtype.element_ty), mask=ok)


def _rms_norm(x, weight, eps: float):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rows_linear_torch(x, w, *, norm=None, swiglu: bool = False, rope=None, residual=None):
    """The same in PyTorch (not batch-invariant on the CPU: its BLAS picks algorithms by row count)."""
    y = F.linear(_rms_norm(x, norm[0], norm[1]) if norm is not None else x, w)
    if swiglu:
        gate, up = y.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(y.dtype)
    if rope is not None:
        cos, sin, pos, rotated = rope
        d, T = cos.shape[-1], y.shape[0]
        c, s = cos[pos.reshape(-1)[:T]].float()[:, None], sin[pos.reshape(-1)[:T]].float()[:, None]
        heads = y[:, :rotated].float().reshape(T, -1, d)
        half = d // 2
        turned = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
        qk = (heads * c + turned * s).reshape(T, rotated).to(y.dtype)
        return torch.cat((qk, y[:, rotated:]), dim=-1)
    return y if residual is None else (residual.float() + y.float()).to(y.dtype)


def rows_linear(x, w, *, norm=None, swiglu: bool = False, rope=None, residual=None, use_triton: bool | None = None,
                tiles=None):
    """x [T, K] (T <= 16), w [N, K]. norm = (weight [K], eps): RMS-normalise each row first. swiglu: w = [gate; up],
    returns [T, N / 2]. rope = (cos, sin, positions, rotated): RoPE tables [max_positions, D] (rows of w grouped by
    head), positions a device tensor of >= T positions, rotated the leading rows that get RoPE. residual [T, N]:
    return residual + y. One epilogue at a time. Row t's bits do not depend on T."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"rows_linear takes x [T <= {MAX_ROWS}, K] and w [N, K], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if sum((swiglu, rope is not None, residual is not None)) > 1:
        raise ValueError("one epilogue at a time: swiglu, rope or residual")
    if norm is not None and norm[0].shape != (x.shape[1],):
        raise ValueError(f"norm weight {tuple(norm[0].shape)} must be [K] = [{x.shape[1]}]")
    if swiglu and w.shape[0] % 2:
        raise ValueError("swiglu needs w = [gate; up], an even number of rows")
    if residual is not None and tuple(residual.shape) != (x.shape[0], w.shape[0]):
        raise ValueError(f"residual {tuple(residual.shape)} must be [T, N] = [{x.shape[0]}, {w.shape[0]}]")
    tiles = tiles or ROWS_TILES
    bn = tiles["BN"]
    if rope is not None:
        cos, sin, pos, rotated = rope
        d = cos.shape[-1]
        if d % 2 or w.shape[0] % d or rotated % d or rotated > w.shape[0] or sin.shape != cos.shape:
            raise ValueError(f"rope needs whole heads of {d} rows: w has {w.shape[0]} rows, {rotated} rotated")
        if (d // 2) % bn:
            raise ValueError(f"rope: the column tile ({bn}) must divide half the head size ({d // 2})")
    if use_triton is None:
        use_triton = triton_usable(x)
    if not use_triton:
        return rows_linear_torch(x, w, norm=norm, swiglu=swiglu, rope=rope, residual=residual)
    T, k = x.shape
    n = w.shape[0]
    x = x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    n_out = n // 2 if swiglu else n
    y = torch.empty(T, n_out, dtype=x.dtype, device=x.device)
    nw, eps = norm if norm is not None else (x, 0.0)
    res = residual.contiguous() if residual is not None else y
    cos = sin = pos = x  # unused unless rope
    half, rotated, stride_cs = 1, 0, 0
    if rope is not None:
        cos, sin, pos, rotated = rope
        half = cos.shape[-1] // 2
        if cos.stride(-1) != 1 or sin.stride() != cos.stride():
            raise ValueError("rope: contiguous tables")
        stride_cs = cos.stride(0)
        programs = n // (2 * half) * (half // bn)
    else:
        programs = triton.cdiv(n_out, bn)
    _rows_linear_kernel[(programs,)](
        x, nw, w, y, res, cos, sin, pos, T, n_out, rotated, w.stride(0), stride_cs, float(eps), K=k,
        BK=tiles["BK"], EPILOGUE=SWIGLU if swiglu else (ROPE if rope is not None else PLAIN),
        NORM=norm is not None, HAS_RESIDUAL=residual is not None, HALF=half, BN=bn,
        IEEE=x.dtype == torch.float32, STAGES=tiles["stages"], num_warps=tiles["warps"])
    return y
