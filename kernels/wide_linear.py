"""The invariant steps' dense projections at bandwidth-bound sizes (the Qwen3.6-35B-A3B in- and out-projections),
with the elementwise step in front of them, in one launch whose row bits cannot depend on the other rows:

    wide_linear(x, w)                                       y = W x
    wide_linear(x, w, norm_weight=nw, eps=eps)              y = W rms_norm(x)               the mixers' in-projections
    wide_linear(x, w, gate=z, head_norm=hw, eps=eps)        y = W gated_rms_norm(x, z)      Gated DeltaNet's output
    wide_linear(x, w, gate=g)                               y = W (x * sigmoid(g))          gated attention's output
    wide_linear(..., residual=r)                            r + y

Why: a speculative engine runs every decode step and verify block on 16 padded rows (backend/models/qwen3_5_moe.py
_padded_rows), where these projections were cuBLAS (the output projections as split-K plus a reduction kernel) behind
a compiled norm or gate kernel: 3-4 launches a projection, the output projections at ~2.3x their bandwidth floor
(kernels/README.md, "Where an invariant step's time goes").

How: every call is one [BN, BK] x [BK, 16] MMA per step with the weight as the wide operand ("swap AB": the weight
rows fill the MMA's M, the 16 input rows its N), so Hopper's wgmma runs it and Triton pipelines the weight loads
(`num_stages`); rows past T are masked to zero. An output element is the dot product of one weight row with one input
row, accumulated over K in a fixed order, so a row's bits do not depend on T or on its neighbours. K is split into
SPLITS ranges fixed by the shape: each program stores its fp32 partial and the last program of a tile to arrive (an
atomic counter) adds them in split order and applies the epilogue, as kernels/rows_linear.py does.

Rounding: the RMSNorm is applied as W (x * nw) * rstd (x * nw rounded to x's dtype, the row's rstd in fp32 on the
sum: kernels/rows_linear.py's order); the gated norm and the sigmoid gate are computed per K step exactly as
kernels/gemv.py computes them (BK is a multiple of the head size, so a head never straddles two steps); y is cast
once, then the residual is added as PyTorch adds two bf16 tensors. A PyTorch twin (`wide_linear_torch`) runs where
Triton cannot.
"""

from __future__ import annotations

import torch

from kernels.gemv import prologue_torch
from kernels.rows_linear import split_workspace

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

PLAIN, NORM, GATED_NORM, SIGMOID_GATE = 0, 1, 2, 3
MAX_ROWS = 16  # the MMA's N: every call computes 16 rows, the ones past T masked
DEFAULT_TILES = {"BN": 64, "BK": 128, "SPLITS": 2, "stages": 4, "warps": 4}
# Launch shapes measured fastest on the H200 (bench/kernel_sweep.py --only wide), keyed by (N, K, prologue).
TUNED: dict = {}

if triton is not None:
    _NORM, _GATED_NORM, _SIGMOID_GATE = tl.constexpr(NORM), tl.constexpr(GATED_NORM), tl.constexpr(SIGMOID_GATE)

    @triton.jit
    def _prologue(x_ptr, g_ptr, nw_ptr, m, m_ok, offs_k, k_ok, eps, K: tl.constexpr, BK: tl.constexpr,
                  PROLOGUE: tl.constexpr, D: tl.constexpr, ROUND_NORMED: tl.constexpr):
        """One K step's inputs [16, BK] in x's dtype, after the gate or gated norm; and their squares' row sums
        (NORM: the RMSNorm's statistics, applied on the finished sum)."""
        dt = x_ptr.dtype.element_ty
        ok = m_ok[:, None] & k_ok[None, :]
        xk = tl.load(x_ptr + m[:, None] * K + offs_k[None, :], mask=ok, other=0.0)
        ss = tl.zeros([16], dtype=tl.float32)
        if PROLOGUE == _NORM:
            xf = xk.to(tl.float32)
            ss = tl.sum(xf * xf, axis=1)
            nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            xk = (xf * nw[None, :]).to(dt)
        elif PROLOGUE == _GATED_NORM:  # per head of D columns; BK % D == 0, so a step holds whole heads
            xf = tl.reshape(xk.to(tl.float32), [16, BK // D, D])
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=2) / D + eps)
            normed = (xf * rstd[:, :, None]).to(dt).to(tl.float32)
            normed = normed * tl.load(nw_ptr + tl.arange(0, D)).to(tl.float32)[None, None, :]
            if ROUND_NORMED:
                normed = normed.to(dt).to(tl.float32)
            gv = tl.reshape(tl.load(g_ptr + m[:, None] * K + offs_k[None, :], mask=ok, other=0.0).to(tl.float32),
                            [16, BK // D, D])
            xk = tl.reshape((normed * (gv * tl.sigmoid(gv))).to(dt), [16, BK])
        elif PROLOGUE == _SIGMOID_GATE:
            gv = tl.load(g_ptr + m[:, None] * K + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
            s = tl.sigmoid(gv).to(dt).to(tl.float32)
            xk = (xk.to(tl.float32) * s).to(dt)
        return xk, ss

    @triton.jit
    def _epilogue(acc, ss, m, m_ok, rows, r_ok, y_ptr, res_ptr, N, eps, K: tl.constexpr, PROLOGUE: tl.constexpr,
                  HAS_RESIDUAL: tl.constexpr):
        """The finished [BN, 16] sums of one tile: the norm's rstd, the cast, the residual, the store (transposed)."""
        dt = y_ptr.dtype.element_ty
        if PROLOGUE == _NORM:
            acc = acc * (1.0 / tl.sqrt(ss / K + eps))[None, :]
        y = acc.to(dt)
        ok = r_ok[:, None] & m_ok[None, :]
        at = m[None, :] * N + rows[:, None]
        if HAS_RESIDUAL:  # residual + y, each rounded as PyTorch rounds the two steps
            y = (tl.load(res_ptr + at, mask=ok, other=0.0).to(tl.float32) + y.to(tl.float32)).to(dt)
        tl.store(y_ptr + at, y, mask=ok)

    # T is never specialised: a decode step and a verify block run one binary
    @triton.jit(do_not_specialize=["T"])
    def _wide_kernel(x_ptr, g_ptr, nw_ptr, w_ptr, y_ptr, res_ptr, part_ptr, ss_ptr, count_ptr, T, N, stride_wn, eps,
                     K: tl.constexpr, KS: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr, BN: tl.constexpr,
                     PROLOGUE: tl.constexpr, D: tl.constexpr, ROUND_NORMED: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr):
        """Grid (N / BN, SPLITS): weight rows p*BN.. over K range [s * KS, (s + 1) * KS)."""
        p = tl.program_id(0)
        s = tl.program_id(1)
        rows = p * BN + tl.arange(0, BN)
        r_ok = rows < N
        m = tl.arange(0, 16)
        m_ok = m < T
        acc = tl.zeros([BN, 16], dtype=tl.float32)
        ss = tl.zeros([16], dtype=tl.float32)
        for kk in tl.range(0, KS, BK, num_stages=STAGES):
            offs_k = s * KS + kk + tl.arange(0, BK)
            k_ok = offs_k < K
            w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0)
            xk, part_ss = _prologue(x_ptr, g_ptr, nw_ptr, m, m_ok, offs_k, k_ok, eps, K, BK, PROLOGUE, D,
                                    ROUND_NORMED)
            ss += part_ss
            if IEEE:
                acc = tl.dot(w, tl.trans(xk), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(xk), acc)
        if SPLITS == 1:
            _epilogue(acc, ss, m, m_ok, rows, r_ok, y_ptr, res_ptr, N, eps, K, PROLOGUE, HAS_RESIDUAL)
        else:
            tiles = tl.num_programs(0)
            cell = tl.arange(0, BN)[:, None] * 16 + m[None, :]
            tl.store(part_ptr + (s * tiles + p) * BN * 16 + cell, acc)
            if PROLOGUE == _NORM:
                tl.store(ss_ptr + (s * tiles + p) * 16 + m, ss)
            # acq_rel: this program's partials are visible before the count; the last one sees all of them
            arrived = tl.atomic_add(count_ptr + p, 1, sem="acq_rel")
            if arrived == SPLITS - 1:
                acc = tl.zeros([BN, 16], dtype=tl.float32)
                ss = tl.zeros([16], dtype=tl.float32)
                for r in tl.static_range(SPLITS):  # split order, whatever order the programs finished in
                    acc += tl.load(part_ptr + (r * tiles + p) * BN * 16 + cell, cache_modifier=".cg")
                    if PROLOGUE == _NORM:
                        ss += tl.load(ss_ptr + (r * tiles + p) * 16 + m, cache_modifier=".cg")
                _epilogue(acc, ss, m, m_ok, rows, r_ok, y_ptr, res_ptr, N, eps, K, PROLOGUE, HAS_RESIDUAL)
                tl.atomic_xchg(count_ptr + p, 0)  # ready for the next call (launches on a stream run in order)


def wide_linear_torch(x, w, norm_weight=None, eps: float = 1e-6, *, gate=None, head_norm=None, residual=None):
    """The same in PyTorch, with the rounding described above (fp32 sums: the order of additions differs)."""
    if norm_weight is not None:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = ((xf * norm_weight.float()).to(x.dtype).float() @ w.float().t() * rstd).to(x.dtype)
    else:
        y = (prologue_torch(x, gate, head_norm, eps).float() @ w.float().t()).to(x.dtype)
    return y if residual is None else (residual.float() + y.float()).to(y.dtype)


def check_inputs(x, w, norm_weight, gate, head_norm, residual) -> None:
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"wide_linear takes x [T <= {MAX_ROWS}, K] and w [N, K], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if norm_weight is not None and (gate is not None or norm_weight.shape != (x.shape[1],)):
        raise ValueError(f"the RMSNorm's weight must be [K] = [{x.shape[1]}], without a gate")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must have x's shape {tuple(x.shape)}")
    if head_norm is not None:
        d = head_norm.numel()
        if gate is None or x.shape[1] % d or d & (d - 1):
            raise ValueError("the gated norm needs a gate and a head size that is a power of two dividing K")
    if residual is not None and tuple(residual.shape) != (x.shape[0], w.shape[0]):
        raise ValueError(f"residual {tuple(residual.shape)} must be [T, N] = [{x.shape[0]}, {w.shape[0]}]")


def wide_linear(x, w, norm_weight=None, eps: float = 1e-6, *, gate=None, head_norm=None, residual=None,
                use_triton: bool | None = None, tiles: dict | None = None):
    """x [T, K] (T <= 16), w [N, K] -> [T, N]: y = W prologue(x) (+ residual), the prologue an RMSNorm over K
    (norm_weight [K]), the per-head gated RMSNorm (gate [T, K], head_norm [D]) or the sigmoid gate (gate alone).
    Row t's bits do not depend on T or on the other rows. tiles overrides the launch shape (a sweep)."""
    check_inputs(x, w, norm_weight, gate, head_norm, residual)
    if use_triton is None:
        from kernels.fused_moe import triton_usable
        use_triton = triton_usable(x)
    if not use_triton:
        return wide_linear_torch(x, w, norm_weight, eps, gate=gate, head_norm=head_norm, residual=residual)
    n, k = w.shape
    prologue = NORM if norm_weight is not None else (
        PLAIN if gate is None else (GATED_NORM if head_norm is not None else SIGMOID_GATE))
    cfg = dict(DEFAULT_TILES, **(tiles or TUNED.get((n, k, prologue), {})))
    d = head_norm.numel() if head_norm is not None else 1
    bk = max(min(cfg["BK"], triton.next_power_of_2(k)), d)
    chunks = -(-k // bk)
    per_split = -(-chunks // min(cfg["SPLITS"], chunks))
    splits, ks = -(-chunks // per_split), per_split * bk
    bn = cfg["BN"]
    n_tiles = triton.cdiv(n, bn)
    part, ss, count = split_workspace(x.device, splits * n_tiles * 16 * bn if splits > 1 else 0,
                                 splits * n_tiles * 16 if splits > 1 and prologue == NORM else 0,
                                 n_tiles if splits > 1 else 0)
    x = x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    g = gate.contiguous() if gate is not None else x
    nw = norm_weight if norm_weight is not None else (head_norm if head_norm is not None else x)
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    res = residual.contiguous() if residual is not None else y
    _wide_kernel[(n_tiles, splits)](
        x, g, nw, w, y, res, part, ss, count, x.shape[0], n, w.stride(0), eps, K=k, KS=ks, BK=bk, SPLITS=splits,
        BN=bn, PROLOGUE=prologue, D=d, ROUND_NORMED=head_norm is not None and head_norm.dtype == x.dtype,
        HAS_RESIDUAL=residual is not None, STAGES=cfg["stages"], IEEE=x.dtype == torch.float32,
        num_warps=cfg["warps"])
    return y

