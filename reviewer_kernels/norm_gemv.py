"""One token's pre-norm projection in one Triton launch: y = epilogue(W @ rms_norm(x)), the three places a Llama
layer (and its LM head) puts an RMSNorm in front of a matmul:

    norm_gemv(x, nw, w, eps)                            y = W a, a = rms_norm(x)      the LM head
    norm_gemv(x, nw, w, eps, swiglu=True)               y = silu(W_g a) * (W_u a)     gate/up, w = [W_g; W_u]
    norm_gemv(x, nw, w, eps, rope=(cos, sin, pos, n))   y = RoPE on rows < n of W a   the fused q/k/v projection

Why: a decode step of the SmolLM2-135M shape is ~10 launches per layer of ~2.5 us each on the H200 (the weights of a
layer take ~1 us to read): the norm, the cuBLAS GEMV, the RoPE or SiLU kernel each wait for the one before. Here the
norm, the projection and its elementwise tail are one launch. Each program loads its rows of W in one go over the
whole input (no loop over K: see reviewer_kernels/README.md "One token"), then normalises all of x (a few KB from L2)
while that load is in flight, so the norm costs no extra round trip.

The epilogues need two rows per output: SwiGLU pairs gate row n with up row n + N/2; RoPE pairs row j of a head with
row j + D/2 (rotate_half's partner). A program owns BN rows and their partners, so the pair meets in registers.
Rows at or past `n` under RoPE (the values) pass through unrotated.

Rounding follows backend/models/llama.py: the norm in fp32, cast to x's dtype, times the weight (cast again: PyTorch
multiplies the two bf16 tensors); each projection row accumulated in fp32 and cast (F.linear's output); the
epilogue computed in fp32 from those casts and cast once (what torch.compile makes of the model's glue).
`norm_gemv_torch` is the PyTorch twin, for where Triton cannot run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

PLAIN, SWIGLU, ROPE = 0, 1, 2
# Tiles chosen on the H200 at the SmolLM2-135M shapes (bench/kernel_sweep.py --only llama_one_token,
# bench/results/kernel_sweep_20261130_094827.json): rows per program (each with its partner for SwiGLU and RoPE).
# Small projections want many light programs (q/k/v 2.6 us, gate/up 3.5 us, vs 3.6 and 4.2 us for cuBLAS without
# the norm); the LM head (49,152 rows) wants fewer, one warp each (16.8 us, cuBLAS 16.6 us + a norm launch).
NORM_GEMV_TILES = {"BN": 2, "warps": 4}
LARGE_TILES, LARGE_ROWS = {"BN": 4, "warps": 1}, 16384
MAX_ROWS = 16  # input rows per call: a decode step (1) or a verify block (up to 16)
# A row per program row (grid (T, tiles)): a 16-row call launches 16x a one-row call's programs (on the H200 ~5x its
# time at the SmolLM2 shapes), but each row is computed exactly as alone. Tried and measured slower (2026-12-01):
# 4 rows per program as one [4, BN, K] product (one-row calls 1.6x slower), and a tensor-core kernel with a fixed
# 16-row tile (a row's bits independent of T too, but 8.3 us a launch against 2.2-3.2 us for one-row programs).

if triton is not None:
    _SWIGLU, _ROPE = tl.constexpr(SWIGLU), tl.constexpr(ROPE)  # what a jit'ed function sees

    @triton.jit
    def _norm_gemv_kernel(x_ptr, nw_ptr, w_ptr, y_ptr, cos_ptr, sin_ptr, pos_ptr, N_OUT, ROTATED, stride_wn,
                          stride_cs, eps, K: tl.constexpr, KP: tl.constexpr, EPILOGUE: tl.constexpr,
                          HALF: tl.constexpr, ROUND_NORMED: tl.constexpr, BN: tl.constexpr):
        """Grid (T, programs): input row t = program_id(0) (x [T, K], positions [T]); PLAIN rows p*BN..; SWIGLU
        gate rows p*BN.. with up rows N_OUT + those; ROPE rows j..j+BN of a head's first half (HALF = head_dim / 2)
        with their partners j + HALF. Every input row runs exactly the one-row program, so row t's result does not
        depend on T (batch invariance); the programs of one weight tile are neighbours in the launch order, so the
        tile comes from DRAM once and from L2 for the other rows."""
        t = tl.program_id(0)
        p = tl.program_id(1)
        lane = tl.arange(0, BN)
        if EPILOGUE == _ROPE:
            per_head = HALF // BN
            j = (p % per_head) * BN + lane  # position within the head's first half
            rows_a = (p // per_head) * (2 * HALF) + j
        else:
            rows_a = p * BN + lane
        a_ok = rows_a < N_OUT
        offs_k = tl.arange(0, KP)
        k_ok = offs_k < K
        w_a = tl.load(w_ptr + rows_a[:, None] * stride_wn + offs_k[None, :], mask=a_ok[:, None] & k_ok[None, :],
                      other=0.0)
        if EPILOGUE == _SWIGLU:
            rows_b = rows_a + N_OUT
        else:
            rows_b = rows_a + HALF
        if EPILOGUE != 0:
            w_b = tl.load(w_ptr + rows_b[:, None] * stride_wn + offs_k[None, :], mask=a_ok[:, None] & k_ok[None, :],
                          other=0.0)
        # the norm while the weight tiles are on their way
        x = tl.load(x_ptr + t * K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
        a = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * tl.load(nw_ptr + offs_k, mask=k_ok,
                                                                             other=0.0).to(tl.float32)
        if ROUND_NORMED:
            a = a.to(x_ptr.dtype.element_ty).to(tl.float32)
        ya = tl.sum(w_a.to(tl.float32) * a[None, :], axis=1).to(y_ptr.dtype.element_ty).to(tl.float32)
        y_row = y_ptr + t * N_OUT
        if EPILOGUE == _SWIGLU:
            yb = tl.sum(w_b.to(tl.float32) * a[None, :], axis=1).to(y_ptr.dtype.element_ty).to(tl.float32)
            tl.store(y_row + rows_a, (ya * tl.sigmoid(ya) * yb).to(y_ptr.dtype.element_ty), mask=a_ok)
        elif EPILOGUE == _ROPE:
            yb = tl.sum(w_b.to(tl.float32) * a[None, :], axis=1).to(y_ptr.dtype.element_ty).to(tl.float32)
            pos = tl.load(pos_ptr + t)
            cs = cos_ptr + pos * stride_cs
            sn = sin_ptr + pos * stride_cs
            cos_a, sin_a = tl.load(cs + j).to(tl.float32), tl.load(sn + j).to(tl.float32)
            cos_b, sin_b = tl.load(cs + j + HALF).to(tl.float32), tl.load(sn + j + HALF).to(tl.float32)
            rot = rows_a < ROTATED  # queries and keys; values pass through
            out_a = tl.where(rot, ya * cos_a - yb * sin_a, ya)
            out_b = tl.where(rot, yb * cos_b + ya * sin_b, yb)
            tl.store(y_row + rows_a, out_a.to(y_ptr.dtype.element_ty), mask=a_ok)
            tl.store(y_row + rows_b, out_b.to(y_ptr.dtype.element_ty), mask=a_ok)
        else:
            tl.store(y_row + rows_a, ya.to(y_ptr.dtype.element_ty), mask=a_ok)


def rms_norm_torch(x, weight, eps: float):
    """backend/models/llama.py's rms_norm (kept here so that reviewer_kernels/ does not import backend/)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm_gemv_torch(x, norm_weight, w, eps: float, *, swiglu: bool = False, rope=None):
    """The same in PyTorch: the eager functions of backend/models/llama.py, epilogue computed in fp32 and cast once."""
    y = F.linear(rms_norm_torch(x, norm_weight, eps), w)
    if swiglu:
        gate, up = y.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(y.dtype)
    if rope is not None:
        return rope_rows_torch(y, rope)
    return y


def rope_rows_torch(y, rope):
    """RoPE on the first `rotated` columns of y [T, N] (whole heads), row t at positions[t]; the rest passes through.
    rope = (cos, sin, positions, rotated). Computed in fp32 from y, cast once (the kernels' epilogue)."""
    cos, sin, pos, rotated = rope
    d = cos.shape[-1]
    T = y.shape[0]
    c, s = cos[pos.reshape(-1)[:T]].float()[:, None], sin[pos.reshape(-1)[:T]].float()[:, None]  # [T, 1, D]
    heads = y[:, :rotated].float().reshape(T, -1, d)
    half = d // 2
    turned = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    qk = (heads * c + turned * s).reshape(T, rotated).to(y.dtype)
    return torch.cat((qk, y[:, rotated:]), dim=-1)


def check_epilogue(w, swiglu: bool, rope, residual=None) -> None:
    """The epilogue arguments of norm_gemv and reviewer_kernels/rows_linear.py: one at a time, SwiGLU over [gate; up]
    rows, RoPE over whole heads of w's rows."""
    if sum([swiglu, rope is not None, residual is not None]) > 1:
        raise ValueError("one epilogue at a time: swiglu, rope or residual")
    if swiglu and w.shape[0] % 2:
        raise ValueError("swiglu needs w = [gate; up], an even number of rows")
    if rope is not None:
        cos, sin, pos, rotated = rope
        d = cos.shape[-1]
        if d % 2 or w.shape[0] % d or rotated % d or rotated > w.shape[0] or sin.shape != cos.shape:
            raise ValueError(f"rope needs whole heads of {d} rows: w has {w.shape[0]} rows, {rotated} rotated")


def norm_gemv(x, norm_weight, w, eps: float, *, swiglu: bool = False, rope=None, use_triton: bool | None = None,
              tiles=None):
    """x [T, K] (the residual stream, T <= MAX_ROWS), norm_weight [K], w [N, K]. Returns [T, N], or [T, N / 2] with
    swiglu. Row t's result is bitwise the same whatever T is (one kernel walks the rows in turn), so a position
    computed in a decode step and inside a verify block gets the same bits.
    rope = (cos, sin, positions, rotated): cos / sin [max_positions, D] tables (D = head size, rows of w grouped
    by head), positions a device tensor of at least T positions (a graph replays it), rotated the number of leading
    rows that get RoPE (queries and keys; the values after them pass through). tiles overrides NORM_GEMV_TILES /
    LARGE_TILES."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"norm_gemv takes x [T <= {MAX_ROWS}, K] and w [N, K], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} must be [K] = [{x.shape[1]}]")
    check_epilogue(w, swiglu, rope)
    if use_triton is None:
        from reviewer_kernels.fused_moe import triton_usable
        use_triton = triton_usable(x)
    if not use_triton:
        return norm_gemv_torch(x, norm_weight, w, eps, swiglu=swiglu, rope=rope)
    n, k = w.shape
    tiles = tiles or (LARGE_TILES if n >= LARGE_ROWS else NORM_GEMV_TILES)
    bn = tiles["BN"]
    x = x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    n_out = n // 2 if swiglu else n
    T = x.shape[0]
    y = torch.empty(T, n_out, dtype=x.dtype, device=x.device)
    cos = sin = pos = x  # unused unless rope
    half, rotated, stride_cs = 1, 0, 0
    if rope is not None:
        cos, sin, pos, rotated = rope
        half = cos.shape[-1] // 2
        bn = min(bn, half)
        if half % bn or cos.stride(-1) != 1 or sin.stride() != cos.stride():
            raise ValueError(f"rope: BN ({bn}) must divide half the head size ({half}); contiguous tables")
        stride_cs = cos.stride(0)
        programs = n // (2 * half) * (half // bn)
    else:
        programs = triton.cdiv(n_out, bn)
    _norm_gemv_kernel[(T, programs)](
        x, norm_weight, w, y, cos, sin, pos, n_out, rotated, w.stride(0), stride_cs, eps, K=k,
        KP=triton.next_power_of_2(k), EPILOGUE=SWIGLU if swiglu else (ROPE if rope is not None else PLAIN),
        HALF=half, ROUND_NORMED=norm_weight.dtype == x.dtype, BN=bn, num_warps=tiles["warps"])
    return y
