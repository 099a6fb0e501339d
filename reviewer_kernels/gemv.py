"""One token's projection y = W @ prologue(x) in one Triton launch, the prologue being the elementwise step that
Qwen3.5/3.6's mixers put in front of their output projections:

    gemv(x, w)                                          y = W x
    gemv(x, w, gate=z, norm_weight=nw, eps=eps)         y = W gated_rms_norm(x, z)   per head of nw.numel() values
    gemv(x, w, gate=g)                                  y = W (x * sigmoid(g))       gated attention's output gate
    gemv(..., residual=r)                               r + y                        the residual add too

Why: at a decode step cuBLAS runs these 2048 x 4096 matrices (16.8 MB) as a split-K GEMM plus a reduction kernel
(8.6 us on the H200 against 4.1 us of bandwidth), and the norm or gate before it is one more launch (3.7 us for the
gated norm). Here each program owns BN rows of W and loads them in one go over the whole input (no loop: a loop's
iterations each wait for their own DRAM round trip, which made a first version slower than cuBLAS); it computes the
prologue over all of x (8 KB from L2) while that load is in flight, instead of waiting for another kernel to write
it. One row of x: plain loads and fp32 multiply-adds, no tensor cores.

Rounding follows backend/models/qwen3_5_moe.py's eager functions: gated norm = x * rsqrt(mean(x^2) + eps) cast to
x's dtype, times the norm weight (cast again when the weight has x's dtype, as PyTorch's bf16 multiply does), times
SiLU(gate) in fp32, cast; the sigmoid gate is cast before the multiply. y is accumulated in fp32, cast once.
A PyTorch twin (`gemv_torch`) runs where Triton cannot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

PLAIN, GATED_NORM, SIGMOID_GATE = 0, 1, 2
# Tiles chosen on the H200 for the 35B-A3B output projections (2048 x 4096) by bench/kernel_sweep.py.
GEMV_TILES = {"BN": 4, "warps": 16}
MAX_ROWS = 16  # input rows per call: a decode step (1) or a verify block (up to 16)

if triton is not None:
    _GATED_NORM, _SIGMOID_GATE = tl.constexpr(GATED_NORM), tl.constexpr(SIGMOID_GATE)  # what a jit'ed function sees

    @triton.jit
    def _gemv_kernel(x_ptr, g_ptr, nw_ptr, w_ptr, res_ptr, y_ptr, N, stride_wn, eps,
                     K: tl.constexpr, KP: tl.constexpr, PROLOGUE: tl.constexpr, D: tl.constexpr,
                     ROUND_NORMED: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BN: tl.constexpr):
        """Grid (T, N / BN): y[t, n-tile] = W[n-tile] @ prologue(x[t]), t = program_id(0). The weight tile [BN, K] is
        loaded in one go, before the prologue's arithmetic, so its DRAM round trip overlaps it. Every row runs the
        one-row program (row t's bits do not depend on T); a tile's row programs are neighbours in the launch, so
        the tile is read from DRAM once. GATED_NORM needs D | K, D a power of two."""
        t = tl.program_id(0)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, KP)
        n_ok = offs_n < N
        k_ok = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if PROLOGUE == _GATED_NORM:
            offs2 = tl.arange(0, KP // D)[:, None] * D + tl.arange(0, D)[None, :]  # [heads, D]
            ok2 = offs2 < K
            xv = tl.load(x_ptr + t * K + offs2, mask=ok2, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) / D + eps)
            normed = (xv * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
            normed = normed * tl.load(nw_ptr + tl.arange(0, D)).to(tl.float32)[None, :]
            if ROUND_NORMED:
                normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
            gv = tl.load(g_ptr + t * K + offs2, mask=ok2, other=0.0).to(tl.float32)
            a2 = (normed * (gv * tl.sigmoid(gv))).to(x_ptr.dtype.element_ty).to(tl.float32)
            a = tl.reshape(a2, [KP])
        else:
            a = tl.load(x_ptr + t * K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            if PROLOGUE == _SIGMOID_GATE:
                gv = tl.load(g_ptr + t * K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                s = tl.sigmoid(gv).to(x_ptr.dtype.element_ty).to(tl.float32)
                a = (a * s).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * a[None, :], axis=1).to(y_ptr.dtype.element_ty)
        if HAS_RESIDUAL:  # residual + y, each rounded as PyTorch rounds the two steps
            res = tl.load(res_ptr + t * N + offs_n, mask=n_ok, other=0.0)
            y = (res.to(tl.float32) + y.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + t * N + offs_n, y, mask=n_ok)


def gemv_torch(x, w, gate=None, norm_weight=None, eps: float = 1e-6, residual=None):
    """The same in PyTorch, with the rounding of backend/models/qwen3_5_moe.py's eager functions."""
    if norm_weight is not None:
        d = norm_weight.numel()
        xf = x.reshape(-1, d).float()
        normed = norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        a = (normed * F.silu(gate.reshape(-1, d).float())).to(x.dtype).reshape(x.shape)
    elif gate is not None:
        a = x * torch.sigmoid(gate)
    else:
        a = x
    y = F.linear(a, w)
    return y if residual is None else (residual.float() + y.float()).to(y.dtype)


def gemv(x, w, gate=None, norm_weight=None, eps: float = 1e-6, residual=None, *, use_triton: bool | None = None,
         tiles=None):
    """y [T, N] = w [N, K] @ prologue(x [T, K]) (see the module docstring), T <= MAX_ROWS; gate [T, K] like x;
    norm_weight [D] with K % D == 0 for the per-head gated RMSNorm. residual [T, N]: return residual + y (rounded as
    PyTorch's `residual + y` of the two tensors), the transformer's residual add in the same launch. Row t's bits do
    not depend on T. tiles overrides GEMV_TILES (bench/kernel_sweep.py)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"gemv takes x [T <= {MAX_ROWS}, K] and w [N, K], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must have x's shape {tuple(x.shape)}")
    if norm_weight is not None and (gate is None or x.shape[1] % norm_weight.numel()):
        raise ValueError("the gated norm needs a gate and a norm weight whose size divides K")
    if residual is not None and tuple(residual.shape) != (x.shape[0], w.shape[0]):
        raise ValueError(f"residual {tuple(residual.shape)} must be [T, N] = [{x.shape[0]}, {w.shape[0]}]")
    if use_triton is None:
        from reviewer_kernels.fused_moe import triton_usable
        use_triton = triton_usable(x)
    if not use_triton:
        return gemv_torch(x, w, gate, norm_weight, eps, residual)
    tiles = tiles or GEMV_TILES
    n, k = w.shape
    x = x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    prologue = PLAIN if gate is None else (GATED_NORM if norm_weight is not None else SIGMOID_GATE)
    d = norm_weight.numel() if norm_weight is not None else 1
    if d & (d - 1):
        raise ValueError(f"the gated norm's head size ({d}) must be a power of two")
    g = gate.contiguous() if gate is not None else x
    nw = norm_weight if norm_weight is not None else x
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    res = residual.contiguous() if residual is not None else y
    _gemv_kernel[(x.shape[0], triton.cdiv(n, tiles["BN"]))](
        x, g, nw, w, res, y, n, w.stride(0), eps, K=k, KP=max(triton.next_power_of_2(k), d), PROLOGUE=prologue,
        D=d, ROUND_NORMED=norm_weight is not None and norm_weight.dtype == x.dtype,
        HAS_RESIDUAL=residual is not None, BN=tiles["BN"], num_warps=tiles["warps"])
    return y
