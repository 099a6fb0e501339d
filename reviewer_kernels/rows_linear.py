"""A decode step's and a verify block's projections through tensor cores, each row computed the same way for 1..16
input rows (batch invariance), in one launch with the norm before and the elementwise step after:

    rows_linear(x, w)                                   y = W x
    rows_linear(x, w, norm_weight=nw, eps=eps)          y = W rms_norm(x)                 the LM head
    rows_linear(x, w, nw, eps, swiglu=True)             y = silu(W_g a) * (W_u a)         gate/up, w = [W_g; W_u]
    rows_linear(x, w, nw, eps, rope=(cos, sin, pos, n)) y = RoPE on rows < n of W a       the fused q/k/v projection
    rows_linear(x, w, residual=r)                       r + W x                           output / down projection

Why: reviewer_kernels/norm_gemv.py and reviewer_kernels/gemv.py reduce each input row on CUDA cores, so a 16-row verify
costs ~16 rows of ALU work (bench/results/kernel_sweep_20261201_144447.json: 8.4 us against 2.5 for q/k/v, 144 us
against 16 for the LM head, however the rows are spread over programs). Here every call is one [16, K] x [K, N] MMA: the
rows past T are masked to zero, so a 1-row call and a 16-row call run the same instructions on the same tiles, and a
row's bits cannot depend on T. The MMA is free at these sizes; what a launch costs is the weight read and the latency
chain.

Parallelism without breaking invariance: K is split into SPLITS ranges fixed by the shape (never by T). Each program
multiplies its range and stores an fp32 partial; the last program of an output tile to finish (an atomic counter)
adds the partials in split order 0..SPLITS-1, so the sum's order is fixed whatever order the programs ran in, and
applies the epilogue. The norm's sum of squares is split the same way (each program sums its own K range).

Rounding: the norm is applied as W (x * nw) * rstd: x * nw rounded to x's dtype (PyTorch's bf16 multiply), the MMA
in fp32, the row's rstd (fp32) on the accumulated sum; each projection row is cast to the output dtype (F.linear's
output) before the epilogue, which runs in fp32 and is cast once. This differs from the model's eager order
(normalise, round, scale) by bf16 rounding; decode and verify share it, which is what lossless speculation needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reviewer_kernels.norm_gemv import check_epilogue, rope_rows_torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

PLAIN, SWIGLU, ROPE = 0, 1, 2
MAX_ROWS = 16  # the MMA's M: every call computes 16 rows, the ones past T masked
BK = 64  # K per MMA step
TARGET_PROGRAMS = 264  # two per SM on the H200: enough loads in flight to reach the weight bandwidth

if triton is not None:
    _SWIGLU, _ROPE = tl.constexpr(SWIGLU), tl.constexpr(ROPE)

    @triton.jit
    def _epilogue_inputs(res_ptr, cos_ptr, sin_ptr, pos_ptr, m, m_ok, rows_a, j, a_ok, N_OUT, stride_cs,
                         EPILOGUE: tl.constexpr, HALF: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BN: tl.constexpr):
        """What the epilogue reads besides the sums: the residual's [16, BN] tile, or the rows' cos / sin (each
        row's position first). Loaded before the K loop: read after the sums, these were two dependent round trips
        (position, then its cos / sin rows) at the end of every program, which a launch waits for; unused ones are
        zeros."""
        ok = m_ok[:, None] & a_ok[None, :]
        res = tl.zeros([16, BN], dtype=tl.float32)
        cos_a = res
        sin_a = res
        cos_b = res
        sin_b = res
        if EPILOGUE == _ROPE:
            pos = tl.load(pos_ptr + m, mask=m_ok, other=0)
            cs = cos_ptr + pos[:, None] * stride_cs + j[None, :]
            sn = sin_ptr + pos[:, None] * stride_cs + j[None, :]
            cos_a, sin_a = tl.load(cs, mask=ok, other=0.0).to(tl.float32), tl.load(sn, mask=ok, other=0.0).to(tl.float32)
            cos_b = tl.load(cs + HALF, mask=ok, other=0.0).to(tl.float32)
            sin_b = tl.load(sn + HALF, mask=ok, other=0.0).to(tl.float32)
        elif EPILOGUE == 0 and HAS_RESIDUAL:
            res = tl.load(res_ptr + m[:, None] * N_OUT + rows_a[None, :], mask=ok, other=0.0).to(tl.float32)
        return res, cos_a, sin_a, cos_b, sin_b

    @triton.jit
    def _epilogue(acc_a, acc_b, ss, m, m_ok, rows_a, rows_b, a_ok, y_ptr, res, cos_a, sin_a, cos_b, sin_b, N_OUT,
                  ROTATED, eps, K: tl.constexpr, NORM: tl.constexpr, EPILOGUE: tl.constexpr,
                  HAS_RESIDUAL: tl.constexpr):
        """The finished [16, BN] sums of one output tile: the norm's rstd, the cast, the epilogue (its inputs from
        _epilogue_inputs), the store."""
        dt = y_ptr.dtype.element_ty
        if NORM:
            rstd = 1.0 / tl.sqrt(ss / K + eps)
            acc_a = acc_a * rstd[:, None]
            acc_b = acc_b * rstd[:, None]
        ya = acc_a.to(dt).to(tl.float32)
        ok = m_ok[:, None] & a_ok[None, :]
        out = y_ptr + m[:, None] * N_OUT
        if EPILOGUE == _SWIGLU:
            yb = acc_b.to(dt).to(tl.float32)
            tl.store(out + rows_a[None, :], (ya * tl.sigmoid(ya) * yb).to(dt), mask=ok)
        elif EPILOGUE == _ROPE:
            yb = acc_b.to(dt).to(tl.float32)
            rot = (rows_a < ROTATED)[None, :]  # queries and keys; values pass through
            tl.store(out + rows_a[None, :], tl.where(rot, ya * cos_a - yb * sin_a, ya).to(dt), mask=ok)
            tl.store(out + rows_b[None, :], tl.where(rot, yb * cos_b + ya * sin_b, yb).to(dt), mask=ok)
        else:
            if HAS_RESIDUAL:  # residual + y, each rounded as PyTorch rounds the two steps
                ya = res + ya
            tl.store(out + rows_a[None, :], ya.to(dt), mask=ok)

    @triton.jit
    def _k_step(acc_a, acc_b, ss, k0, x_ptr, nw_ptr, w_ptr, m, m_ok, rows_a, rows_b, a_ok, stride_wn,
                K: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr, EPILOGUE: tl.constexpr, IEEE: tl.constexpr):
        """One BK step of K from column k0: the rows' norm prologue and the MMA(s) into the accumulators."""
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < K
        xk = tl.load(x_ptr + m[:, None] * K + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            xf = xk.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
            nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            xk = (xf * nw[None, :]).to(x_ptr.dtype.element_ty)
        # input_precision matters for fp32 inputs only (the interpreter's tests); "tf32" is also what Triton takes
        # when none is given, so the bf16 kernels compile as before this expression replaced an if/else
        wa = tl.load(w_ptr + rows_a[:, None] * stride_wn + offs_k[None, :], mask=a_ok[:, None] & k_ok[None, :],
                     other=0.0)
        acc_a = tl.dot(xk, tl.trans(wa), acc_a, input_precision="ieee" if IEEE else "tf32")
        if EPILOGUE != 0:
            wb = tl.load(w_ptr + rows_b[:, None] * stride_wn + offs_k[None, :], mask=a_ok[:, None] & k_ok[None, :],
                         other=0.0)
            acc_b = tl.dot(xk, tl.trans(wb), acc_b, input_precision="ieee" if IEEE else "tf32")
        return acc_a, acc_b, ss

    # T is never specialised: a decode step and a verify block run one binary
    @triton.jit(do_not_specialize=["T"])
    def _rows_linear_kernel(x_ptr, nw_ptr, w_ptr, y_ptr, res_ptr, cos_ptr, sin_ptr, pos_ptr, part_ptr, ss_ptr,
                            count_ptr, T, N_OUT, ROTATED, stride_wn, stride_cs, eps, K: tl.constexpr,
                            KS: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr, NORM: tl.constexpr,
                            EPILOGUE: tl.constexpr, HALF: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                            BN: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr):
        """Grid (output tiles, SPLITS): tile p, K range [s * KS, (s + 1) * KS). PLAIN tiles are rows p*BN..; SWIGLU
        gate rows p*BN.. with up rows N_OUT + those; ROPE rows j..j+BN of a head's first half with partners
        j + HALF (as reviewer_kernels/norm_gemv.py)."""
        p = tl.program_id(0)
        s = tl.program_id(1)
        lane = tl.arange(0, BN)
        j = lane
        lane_ok = lane < BN
        if EPILOGUE == _ROPE:
            if BN > HALF:  # heads under 32: a 16-row tile (the MMA's least N) holds half a head, padded
                j = lane
                rows_a = p * (2 * HALF) + j
                lane_ok = lane < HALF
            else:
                per_head = HALF // BN
                j = (p % per_head) * BN + lane
                rows_a = (p // per_head) * (2 * HALF) + j
            rows_b = rows_a + HALF
        elif EPILOGUE == _SWIGLU:
            rows_a = p * BN + lane
            rows_b = rows_a + N_OUT
        else:
            rows_a = p * BN + lane
            rows_b = rows_a
        a_ok = (rows_a < N_OUT) & lane_ok
        m = tl.arange(0, 16)
        m_ok = m < T
        acc_a = tl.zeros([16, BN], dtype=tl.float32)
        acc_b = tl.zeros([16, BN], dtype=tl.float32)
        ss = tl.zeros([16], dtype=tl.float32)
        res, cos_a, sin_a, cos_b, sin_b = _epilogue_inputs(res_ptr, cos_ptr, sin_ptr, pos_ptr, m, m_ok, rows_a, j,
                                                           a_ok, N_OUT, stride_cs, EPILOGUE, HALF, HAS_RESIDUAL, BN)
        # STAGES 0: the K steps unrolled, each load waited for where it is used; else Triton's software pipeline
        # keeps STAGES - 1 steps' loads in flight. The sums run in the same order either way.
        if STAGES == 0:
            for kk in tl.static_range(0, KS, BK):
                acc_a, acc_b, ss = _k_step(acc_a, acc_b, ss, s * KS + kk, x_ptr, nw_ptr, w_ptr, m, m_ok, rows_a,
                                           rows_b, a_ok, stride_wn, K, BK, NORM, EPILOGUE, IEEE)
        else:
            for kk in tl.range(0, KS, BK, num_stages=STAGES):
                acc_a, acc_b, ss = _k_step(acc_a, acc_b, ss, s * KS + kk, x_ptr, nw_ptr, w_ptr, m, m_ok, rows_a,
                                           rows_b, a_ok, stride_wn, K, BK, NORM, EPILOGUE, IEEE)
        if SPLITS == 1:
            _epilogue(acc_a, acc_b, ss, m, m_ok, rows_a, rows_b, a_ok, y_ptr, res, cos_a, sin_a, cos_b, sin_b, N_OUT,
                      ROTATED, eps, K, NORM, EPILOGUE, HAS_RESIDUAL)
        else:
            tiles = tl.num_programs(0)
            cell = m[:, None] * BN + lane[None, :]
            here = (s * tiles + p) * 2 * 16 * BN
            tl.store(part_ptr + here + cell, acc_a)
            if EPILOGUE != 0:
                tl.store(part_ptr + here + 16 * BN + cell, acc_b)
            if NORM:
                tl.store(ss_ptr + (s * tiles + p) * 16 + m, ss)
            # acq_rel: this program's partials are visible before the count; the last one sees all of them
            arrived = tl.atomic_add(count_ptr + p, 1, sem="acq_rel")
            if arrived == SPLITS - 1:
                acc_a = tl.zeros([16, BN], dtype=tl.float32)
                acc_b = tl.zeros([16, BN], dtype=tl.float32)
                ss = tl.zeros([16], dtype=tl.float32)
                for r in tl.static_range(SPLITS):  # split order, whatever order the programs finished in
                    there = (r * tiles + p) * 2 * 16 * BN
                    acc_a += tl.load(part_ptr + there + cell, cache_modifier=".cg")
                    if EPILOGUE != 0:
                        acc_b += tl.load(part_ptr + there + 16 * BN + cell, cache_modifier=".cg")
                    if NORM:
                        ss += tl.load(ss_ptr + (r * tiles + p) * 16 + m, cache_modifier=".cg")
                _epilogue(acc_a, acc_b, ss, m, m_ok, rows_a, rows_b, a_ok, y_ptr, res, cos_a, sin_a, cos_b, sin_b,
                          N_OUT, ROTATED, eps, K, NORM, EPILOGUE, HAS_RESIDUAL)
                tl.atomic_xchg(count_ptr + p, 0)  # ready for the next call (launches on a stream run in order)


def plan(tiles: int, k: int, bn: int, bk: int = BK) -> dict:
    """SPLITS and KS for `tiles` output tiles of BN rows over K columns: enough programs to keep the weight loads in
    flight (TARGET_PROGRAMS), whole BK steps per split. A function of the shape only, never of T."""
    chunks = -(-k // bk)
    splits = min(chunks, max(1, -(-TARGET_PROGRAMS // tiles)))
    per_split = -(-chunks // splits)
    return {"BN": bn, "SPLITS": -(-chunks // per_split), "KS": per_split * bk, "warps": 4}


# Launch shapes measured fastest on the H200 at the SmolLM2-135M projections, for 1 and 16 rows (bench/kernel_sweep.py
# --only rows, bench/results/kernel_sweep_20261202_103433.json; the K loop software-pipelined, "stages" 3: o 3.39 ->
# 2.85 us, gate_up 7.64 -> 7.08, down 5.19 -> 4.98, the LM head 20.9 -> 17.6), keyed by (rows of w, K, epilogue);
# others take plan(). The q/k/v projection (RoPE tiles) stays on plan(): no swept shape beat it (4.5 us).
TUNED = {
    (3072, 576, SWIGLU): {"BN": 32, "BK": 64, "SPLITS": 2, "KS": 320, "warps": 4, "stages": 3},
    (576, 576, PLAIN): {"BN": 16, "BK": 256, "SPLITS": 1, "KS": 768, "warps": 4, "stages": 3},
    (576, 1536, PLAIN): {"BN": 16, "BK": 256, "SPLITS": 2, "KS": 768, "warps": 4, "stages": 3},
    (49152, 576, PLAIN): {"BN": 128, "BK": 64, "SPLITS": 1, "KS": 576, "warps": 4, "stages": 3},
}

_WORKSPACES: dict = {}  # device -> (partials, sums of squares, counters); grown, never shrunk or freed


def split_workspace(device, partial_floats: int, ss_floats: int, counters: int):
    """Scratch for the split-K partials (here and in reviewer_kernels/wide_linear.py), shared by every call on a device
    (launches on a stream run one after another; each call leaves its counters at zero). Grown before CUDA-graph
    capture (the engine's warm-up runs every shape eagerly first); old buffers are kept alive because graphs captured
    earlier still point at them."""
    key = str(device)
    held = _WORKSPACES.setdefault(key, [])
    if held:
        part, ss, count = held[-1]
        if part.numel() >= partial_floats and ss.numel() >= ss_floats and count.numel() >= counters:
            return part, ss, count
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a split-K kernel (rows_linear, wide_linear) needs a larger workspace during "
                               "CUDA-graph capture: run the shape eagerly once first")
        partial_floats, ss_floats = max(partial_floats, part.numel()), max(ss_floats, ss.numel())
        counters = max(counters, count.numel())
    new = (torch.empty(max(partial_floats, 1), dtype=torch.float32, device=device),
           torch.empty(max(ss_floats, 1), dtype=torch.float32, device=device),
           torch.zeros(max(counters, 1), dtype=torch.int32, device=device))
    held.append(new)
    return new


def rows_linear_torch(x, w, norm_weight=None, eps: float = 1e-6, *, swiglu: bool = False, rope=None, residual=None):
    """The same in PyTorch, with the rounding described above (for the kernel's tests and where Triton cannot run)."""
    xf = x.float()
    a = x
    rstd = None
    if norm_weight is not None:
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        a = (xf * norm_weight.float()).to(x.dtype)
    y = a.float() @ w.float().t()
    if rstd is not None:
        y = y * rstd
    y = y.to(x.dtype)
    if swiglu:
        gate, up = y.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(y.dtype)
    if rope is not None:
        return rope_rows_torch(y, rope)
    return y if residual is None else (residual.float() + y.float()).to(y.dtype)


def rows_linear(x, w, norm_weight=None, eps: float = 1e-6, *, swiglu: bool = False, rope=None, residual=None,
                use_triton: bool | None = None, tiles: dict | None = None):
    """x [T, K] (T <= 16), w [N, K]; norm_weight [K] for the RMSNorm before the projection. Returns [T, N] ([T, N / 2]
    with swiglu). Row t's bits do not depend on T. rope = (cos, sin, positions, rotated) as in
    reviewer_kernels/norm_gemv.py (positions: a device tensor of at least T positions). residual [T, N]: returns
    residual + y. tiles overrides plan()'s {"BN", "SPLITS", "KS", "warps"} and the pipeline depth "stages" (a sweep)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"rows_linear takes x [T <= {MAX_ROWS}, K] and w [N, K], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if norm_weight is not None and norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} must be [K] = [{x.shape[1]}]")
    check_epilogue(w, swiglu, rope, residual)
    if residual is not None and tuple(residual.shape) != (x.shape[0], w.shape[0]):
        raise ValueError(f"residual {tuple(residual.shape)} must be [T, N] = [{x.shape[0]}, {w.shape[0]}]")
    if use_triton is None:
        from reviewer_kernels.fused_moe import triton_usable
        use_triton = triton_usable(x)
    if not use_triton:
        return rows_linear_torch(x, w, norm_weight, eps, swiglu=swiglu, rope=rope, residual=residual)
    n, k = w.shape
    T = x.shape[0]
    x = x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    n_out = n // 2 if swiglu else n
    cos = sin = pos = x  # unused unless rope
    half, rotated, stride_cs = 1, 0, 0
    pair = swiglu or rope is not None
    bn = 16 if pair else 32
    if rope is not None:
        cos, sin, pos, rotated = rope
        half = cos.shape[-1] // 2
        bn = min(bn, half)
        bn = (tiles or {}).get("BN", bn)
        if half < 16:
            bn = 16  # one padded tile per half head
        elif half % bn or bn < 16:
            raise ValueError(f"rope: BN ({bn}) must be at least 16 and divide half the head size ({half})")
        if cos.stride(-1) != 1 or sin.stride() != cos.stride():
            raise ValueError("rope: contiguous cos / sin tables")
        stride_cs = cos.stride(0)
    else:
        tiles = tiles or TUNED.get((n, k, SWIGLU if swiglu else PLAIN))
        bn = (tiles or {}).get("BN", bn)
    n_tiles = n // (2 * half) * max(1, half // bn) if rope is not None else triton.cdiv(n_out, bn)
    bk = (tiles or {}).get("BK", BK)  # tiles may name BN, BK, SPLITS + KS (together), warps, stages
    cfg = dict(plan(n_tiles, k, bn, bk), **(tiles or {}))
    splits = cfg["SPLITS"]
    part, ss, count = split_workspace(x.device, splits * n_tiles * 2 * 16 * bn if splits > 1 else 0,
                                      splits * n_tiles * 16 if splits > 1 and norm_weight is not None else 0,
                                      n_tiles if splits > 1 else 0)
    y = torch.empty(T, n_out, dtype=x.dtype, device=x.device)
    nw = norm_weight if norm_weight is not None else x
    res = residual.contiguous() if residual is not None else y
    _rows_linear_kernel[(n_tiles, splits)](
        x, nw, w, y, res, cos, sin, pos, part, ss, count, T, n_out, rotated, w.stride(0), stride_cs, eps, K=k,
        KS=cfg["KS"], BK=bk, SPLITS=splits, NORM=norm_weight is not None,
        EPILOGUE=SWIGLU if swiglu else (ROPE if rope is not None else PLAIN), HALF=half,
        HAS_RESIDUAL=residual is not None, BN=bn, STAGES=cfg.get("stages", 0), IEEE=x.dtype == torch.float32,
        num_warps=cfg["warps"])
    return y
