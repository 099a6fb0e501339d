"""Row-wise RMSNorms for prefill pieces (hundreds to thousands of rows), one launch each where Triton runs.

    normed = rms_norm(x, weight, eps)                      # (x * rsqrt(mean x^2 + eps) * weight), fp32 inside
    s, normed = add_rms_norm(x, y, weight, eps)            # s = x + y (rounded as a bf16 add), normed = rms_norm(s)
    out = gated_rms_norm(x, gate, weight, eps)             # per row: weight * rms_norm(x) * silu(gate)

The rounding points are those of transformers' Qwen3.5-MoE norms (the `*_torch` twins below are the model's glue:
backend/models/qwen3_5_moe.py imports them): `weight` is an fp32 vector ((1 + w) for Qwen's zero-centred norms)
multiplied in fp32 before the one cast; the gated norm casts the normed row, scales it by its weight in the input
dtype, and multiplies by SiLU(gate) in fp32. Eager PyTorch spends 8-12 launches on each (casts, pow, mean, rsqrt,
products), each over the whole [T, H] tensor in fp32: in an eager prefill piece that was ~20 launches a layer.

A row's result here does not depend on the other rows, only on the launch shape. Decode steps and verifies keep
their own kernels (norm_gemv, the compiled glue of the padded rows), whose bits the speculation's invariance relies
on, except the gated norm under the glue kernels (backend/models/numerics.py), which they call with one fixed launch
shape (PADDED_GATED_NORM) whatever the step's token count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reviewer_kernels.fused_moe import triton, triton_usable

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])  # rows change from piece to piece: no new variant on the request path
    def _rms_norm_kernel(x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, M, N, eps, stride_x, stride_y, stride_s, stride_o,
                         ADD: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
        """BR rows a program: (ADD: s = x + y, rounded, stored) then the norm of s (or of x)."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.arange(0, BN)
        ok = (rows < M)[:, None] & (cols < N)[None, :]
        r64 = rows[:, None].to(tl.int64)
        x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=ok, other=0.0)
        if ADD:
            y = tl.load(y_ptr + r64 * stride_y + cols[None, :], mask=ok, other=0.0)
            x = (x.to(tl.float32) + y.to(tl.float32)).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + r64 * stride_s + cols[None, :], x, mask=ok)
        xf = x.to(tl.float32)
        rs = tl.rsqrt(tl.sum(xf * xf, 1) / N + eps)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + r64 * stride_o + cols[None, :], (xf * rs[:, None] * w[None, :]).to(out_ptr.dtype.element_ty),
                 mask=ok)

    @triton.jit(do_not_specialize=["M"])
    def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, M, H, N, eps, stride_xt, stride_xh, stride_gt,
                               stride_gh, BR: tl.constexpr, BN: tl.constexpr):
        """BR rows (t, h) a program: weight * (normed x, cast) in the input dtype, times silu(gate) in fp32, cast;
        out [T, H * N] contiguous."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.arange(0, BN)
        ok = (rows < M)[:, None] & (cols < N)[None, :]
        t, h = (rows // H).to(tl.int64)[:, None], (rows % H)[:, None]
        r64 = rows[:, None].to(tl.int64)
        xf = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        normed = (xf * tl.rsqrt(tl.sum(xf * xf, 1) / N + eps)[:, None]).to(dt)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
        scaled = (w[None, :].to(tl.float32) * normed.to(tl.float32)).to(dt).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + h * stride_gh + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + r64 * N + cols[None, :], (scaled * (g * tl.sigmoid(g))).to(dt), mask=ok)


# The padded decode steps' and verifies' gated norm (backend/models/qwen3_5_moe.py with the glue kernels): 16 rows x 32
# heads = 512 rows of 128. The prefill shape (32 rows a program) gave them 16 programs: 103 us a step against 61 for
# the compiled glue on the H200 (2026-12-05). 4 rows a program is a guess, not a measurement: `python
# bench/kernel_sweep.py --only glue` times the candidates, each checked row for row against its rows alone.
PADDED_GATED_NORM = {"rows_per_program": 4, "num_warps": 2}


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5MoeRMSNorm; `weight` is (1 + w) in fp32, precomputed."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def gated_rms_norm_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5MoeRMSNormGated: normalise (fp32), cast, scale, then times SiLU(gate) in fp32."""
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * F.silu(gate.float())).to(x.dtype)


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{what} must be [rows, N] with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    return x


def _launch_shape(n: int) -> tuple[int, int]:
    """(rows a program, padded row width): ~4k elements a program."""
    bn = triton.next_power_of_2(n)
    return max(1, min(64, 4096 // bn)), bn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_triton: bool | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, N] -> rms_norm_torch(x, weight, eps), one launch; written to out [M, N] (contiguous rows) if given."""
    if use_triton is None:
        use_triton = triton_usable(x)
    if not use_triton:
        return rms_norm_torch(x, weight, eps) if out is None else out.copy_(rms_norm_torch(x, weight, eps))
    _rows(x, "x")
    M, N = x.shape
    out = torch.empty_like(x) if out is None else _rows(out, "out")
    if out.shape != x.shape:
        raise ValueError(f"out {tuple(out.shape)} must have x's shape {tuple(x.shape)}")
    br, bn = _launch_shape(N)
    _rms_norm_kernel[(triton.cdiv(M, br),)](x, x, weight, out, out, M, N, eps, x.stride(0), x.stride(0),
                                            out.stride(0), out.stride(0), ADD=False, BR=br, BN=bn, num_warps=4)
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it: (s, rms_norm(s)) with s = (x + y) added in fp32 and rounded once."""
    if x.shape != y.shape:
        raise ValueError(f"x and y must have one shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    if use_triton is None:
        use_triton = triton_usable(x)
    if not use_triton:
        s = (x.float() + y.float()).to(x.dtype)
        return s, rms_norm_torch(s, weight, eps)
    _rows(x, "x"), _rows(y, "y")
    M, N = x.shape
    s, out = torch.empty_like(x), torch.empty_like(x)
    br, bn = _launch_shape(N)
    _rms_norm_kernel[(triton.cdiv(M, br),)](x, y, weight, s, out, M, N, eps, x.stride(0), y.stride(0), s.stride(0),
                                            out.stride(0), ADD=True, BR=br, BN=bn, num_warps=4)
    return s, out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   use_triton: bool | None = None, rows_per_program: int | None = None,
                   num_warps: int = 4) -> torch.Tensor:
    """x, gate [T, H, N] (a row per head; any strides but contiguous rows), weight [N] in x's dtype -> [T, H * N],
    gated_rms_norm_torch's result per row. rows_per_program (a power of two) and num_warps set the launch shape (by
    default ~4k elements a program, for prefill pieces): a row's bits depend on them, never on the other rows, so a
    caller whose steps must agree bit for bit passes one fixed shape (PADDED_GATED_NORM)."""
    if use_triton is None:
        use_triton = triton_usable(x)
    if x.dim() != 3 or x.shape != gate.shape:
        raise ValueError(f"x and gate must both be [T, H, N], got {tuple(x.shape)} and {tuple(gate.shape)}")
    T, H, N = x.shape
    if not use_triton:
        return gated_rms_norm_torch(x.reshape(-1, N), gate.reshape(-1, N), weight, eps).reshape(T, H * N)
    if x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("gated_rms_norm needs contiguous rows (last dimension)")
    out = torch.empty(T, H * N, dtype=x.dtype, device=x.device)
    br, bn = _launch_shape(N)
    br = rows_per_program or br
    _gated_rms_norm_kernel[(triton.cdiv(T * H, br),)](x, gate, weight, out, T * H, H, N, eps, x.stride(0),
                                                      x.stride(1), gate.stride(0), gate.stride(1), BR=br, BN=bn,
                                                      num_warps=num_warps)
    return out
