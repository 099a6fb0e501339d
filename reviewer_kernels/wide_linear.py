"""The invariant steps' dense projections at bandwidth-bound sizes (the Qwen3.6-35B-A3B in- and out-projections) as a
skinny GEMM whose row bits cannot depend on the other rows:

    wide_linear(x, w)                   y = x W^T        x [T <= 16, K], w [N, K]

Why: a speculative engine runs every decode step and verify block on 16 padded rows (backend/models/qwen3_5_moe.py
_padded_rows). There cuBLAS computes the output projections (2048 x 4096) as split-K plus a reduction kernel, ~2x
their bandwidth floor, and that it computes a row the same for any row count is an observation about one cuBLAS build
(backend/models/cublas_rows.py), not a promise.

How: every call is one [BN, BK] x [BK, 16] MMA per step with the weight as the wide operand ("swap AB": the weight
rows fill the MMA's M, the 16 input rows its N), so Hopper's wgmma runs it and Triton pipelines both operands' loads
(`num_stages`; nothing stands between a load and the MMA, which a prologue computed inside the loop did, costing
the loop a round trip per step: reviewer_kernels/README.md); rows past T are masked to zero. An output element is the
dot product of one weight row with one input row, accumulated over K in a fixed order, so a row's bits do not depend on
T or on its neighbours. K is split into SPLITS ranges fixed by the shape: each program stores its fp32 partial and the
last program of a tile to arrive (an atomic counter) adds them in split order and applies the epilogue, as
reviewer_kernels/rows_linear.py does. y is cast once.
"""

from __future__ import annotations

import torch

from reviewer_kernels.rows_linear import split_workspace

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_ROWS = 16  # the MMA's N: every call computes 16 rows, the ones past T masked
SMS = 132  # the H200's multiprocessors: untuned shapes split K until every one has a program
# Launch shapes measured fastest on the H200 (bench/kernel_sweep.py --only wide, bench/results/
# kernel_sweep_20261202_072920.json), keyed by (N, K): the 35B-A3B output projections, 8.5 us against cuBLAS's 9.9.
TUNED = {(2048, 4096): {"BN": 64, "BK": 256, "SPLITS": 4, "stages": 4, "warps": 4}}

if triton is not None:
    @triton.jit
    def _residual(res_ptr, m, m_ok, rows, r_ok, N, RESIDUAL: tl.constexpr):
        """The residual's [BN, 16] tile (zeros without one). Loaded before the sums are done: read after them, its
        round trip was the last thing a tile waited for."""
        if RESIDUAL:
            return tl.load(res_ptr + m[None, :] * N + rows[:, None], mask=r_ok[:, None] & m_ok[None, :], other=0.0)
        return tl.zeros([rows.shape[0], 16], res_ptr.dtype.element_ty)

    @triton.jit
    def _store(acc, res, m, m_ok, rows, r_ok, y_ptr, N, ss_ptr, p, RESIDUAL: tl.constexpr, SUMSQ: tl.constexpr):
        """The finished [BN, 16] sums of one tile, cast and stored transposed; RESIDUAL: plus the residual's rows
        (`res`), rounded once more (PyTorch's `res + y` in bf16); SUMSQ: the sum of squares of this tile's columns of
        each row, fp32, at ss[p, row] (an RMSNorm after it adds the tiles in order)."""
        ok = r_ok[:, None] & m_ok[None, :]
        y = acc.to(y_ptr.dtype.element_ty)
        if RESIDUAL:
            y = (y.to(tl.float32) + res.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + m[None, :] * N + rows[:, None], y, mask=ok)
        if SUMSQ:
            yf = tl.where(ok, y.to(tl.float32), 0.0)
            tl.store(ss_ptr + p * 16 + m, tl.sum(yf * yf, axis=0))

    # T is never specialised: a decode step and a verify block run one binary
    @triton.jit(do_not_specialize=["T"])
    def _wide_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, res_ptr, ss_ptr, T, N, stride_wn, K: tl.constexpr,
                     KS: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr, BN: tl.constexpr,
                     STAGES: tl.constexpr, IEEE: tl.constexpr, RESIDUAL: tl.constexpr, SUMSQ: tl.constexpr):
        """Grid (N / BN, SPLITS): weight rows p*BN.. over K range [s * KS, (s + 1) * KS)."""
        p = tl.program_id(0)
        s = tl.program_id(1)
        rows = p * BN + tl.arange(0, BN)
        r_ok = rows < N
        m = tl.arange(0, 16)
        m_ok = m < T
        acc = tl.zeros([BN, 16], dtype=tl.float32)
        if SPLITS == 1:
            res = _residual(res_ptr, m, m_ok, rows, r_ok, N, RESIDUAL)
        for kk in tl.range(0, KS, BK, num_stages=STAGES):
            offs_k = s * KS + kk + tl.arange(0, BK)
            k_ok = offs_k < K
            w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0)
            xt = tl.load(x_ptr + m[None, :] * K + offs_k[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(w, xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc)
        if SPLITS == 1:
            _store(acc, res, m, m_ok, rows, r_ok, y_ptr, N, ss_ptr, p, RESIDUAL, SUMSQ)
        else:
            tiles = tl.num_programs(0)
            cell = tl.arange(0, BN)[:, None] * 16 + m[None, :]
            tl.store(part_ptr + (s * tiles + p) * BN * 16 + cell, acc)
            # acq_rel: this program's partials are visible before the count; the last one sees all of them
            arrived = tl.atomic_add(count_ptr + p, 1, sem="acq_rel")
            if arrived == SPLITS - 1:
                acc = tl.zeros([BN, 16], dtype=tl.float32)
                for r in tl.static_range(SPLITS):  # split order, whatever order the programs finished in
                    acc += tl.load(part_ptr + (r * tiles + p) * BN * 16 + cell, cache_modifier=".cg")
                _store(acc, _residual(res_ptr, m, m_ok, rows, r_ok, N, RESIDUAL), m, m_ok, rows, r_ok, y_ptr, N,
                       ss_ptr, p, RESIDUAL, SUMSQ)
                tl.atomic_xchg(count_ptr + p, 0)  # ready for the next call (launches on a stream run in order)


def wide_linear_torch(x, w):
    """The same in PyTorch: fp32 sums (in another order), one cast."""
    return (x.float() @ w.float().t()).to(x.dtype)


def default_tiles(n: int, k: int) -> dict:
    """A launch shape for an untuned (N, K): 128 weight rows a tile for tall matrices, 64 for short ones, K split
    until the tiles times the splits fill the SMs once. A function of the shape only, never of T."""
    bn = 128 if n >= 64 * SMS else 64
    return {"BN": bn, "BK": 256, "SPLITS": max(1, SMS // -(-n // bn)), "stages": 3, "warps": 4}


def wide_linear(x, w, *, use_triton: bool | None = None, tiles: dict | None = None,
                residual: torch.Tensor | None = None, sumsq: bool = False):
    """x [T, K] (T <= 16), w [N, K] -> x W^T [T, N]. Row t's bits do not depend on T or on the other rows. tiles
    overrides the launch shape (a sweep). residual [T, N]: return residual + x W^T, rounded as PyTorch adds two bf16
    tensors. sumsq: return (y, partials), partials [P, 16] fp32 holding each row's sum of squares of y over P ranges
    of columns (rows past T zero), for an RMSNorm of y to add in order (moe_routing's `sumsq=`)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"wide_linear takes x [T <= {MAX_ROWS}, K] and w [N, K], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if residual is not None and (residual.shape != (x.shape[0], w.shape[0]) or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous [{x.shape[0]}, {w.shape[0]}], got {tuple(residual.shape)}")
    if use_triton is None:
        from reviewer_kernels.fused_moe import triton_usable
        use_triton = triton_usable(x)
    if not use_triton:
        y = wide_linear_torch(x, w)
        y = y if residual is None else (residual.float() + y.float()).to(y.dtype)
        return (y, sumsq_partials_torch(y, 1)) if sumsq else y
    n, k = w.shape
    cfg = dict(default_tiles(n, k), **(tiles or TUNED.get((n, k), {})))
    bk = min(cfg["BK"], triton.next_power_of_2(k))
    if x.element_size() > 2:  # fp32 stages take twice the shared memory: the bf16 shapes' would not fit (227 KB)
        bk = min(bk, 128)
    chunks = -(-k // bk)
    per_split = -(-chunks // min(cfg["SPLITS"], chunks))
    splits, ks = -(-chunks // per_split), per_split * bk
    bn = cfg["BN"]
    n_tiles = triton.cdiv(n, bn)
    part, _, count = split_workspace(x.device, splits * n_tiles * 16 * bn if splits > 1 else 0, 0,
                                     n_tiles if splits > 1 else 0)
    x = x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    ss = torch.empty(n_tiles, 16, dtype=torch.float32, device=x.device) if sumsq else y  # unused without sumsq
    _wide_kernel[(n_tiles, splits)](
        x, w, y, part, count, residual if residual is not None else y, ss, x.shape[0], n, w.stride(0), K=k, KS=ks,
        BK=bk, SPLITS=splits, BN=bn, STAGES=cfg["stages"], IEEE=x.dtype == torch.float32,
        RESIDUAL=residual is not None, SUMSQ=sumsq, num_warps=cfg["warps"])
    return (y, ss) if sumsq else y


def sumsq_partials_torch(y: torch.Tensor, parts: int) -> torch.Tensor:
    """[parts, 16] fp32: each row's sum of squares of y [T <= 16, N] over `parts` equal column ranges, rows past T
    zero (wide_linear's `sumsq` off Triton)."""
    out = torch.zeros(parts, 16, dtype=torch.float32, device=y.device)
    out[:, :y.shape[0]] = y.float().pow(2).reshape(y.shape[0], parts, -1).sum(-1).t()
    return out
