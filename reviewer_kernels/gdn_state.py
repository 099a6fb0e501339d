"""Gated DeltaNet (Qwen3.5/3.6 linear attention) recurrence, with the state after every token when asked.

For one sequence, value head h (its query/key head is h // (Hv / Hk)), state S [Dk, Dv] in fp32, per token t:
    q, k   = l2norm(q_t), l2norm(k_t);  q *= Dk ** -0.5
    S      = exp(g_t) * S                            # gated decay, g_t <= 0
    delta  = beta_t * (v_t - S^T k)                  # the delta rule: write only what S does not already predict
    S      = S + k delta^T
    o_t    = S^T q
(transformers' `torch_recurrent_gated_delta_rule` with use_qk_l2norm_in_kernel=True; same order of operations.)

Why a kernel of our own: a speculative verify runs a block of tokens through the recurrence, and only a prefix of
them is accepted. Two ways to get the state after the accepted prefix:
  - `gdn_recurrent(..., every_position=True)` writes S after each token into `states_out[t]`, and rolling back is a
    copy (vLLM and SGLang do this). At the 35B-A3B shape that is 2 MB of state per token and layer: a 16-token verify
    writes 1 GB, ~0.25 ms of the H200's bandwidth, for states of which one is kept.
  - `gdn_verify(..., record)` writes only the block's inputs (q, k, v and the gates: ~33 KB per token and layer) and
    leaves the state alone; `gdn_replay(record, state, n)` then runs the first n of them through the recurrence for
    every layer in one launch, in place. This is what the engine does.
The per-token arithmetic is the same code whether the kernel runs 1 token or 16, from live inputs or recorded ones
(recorded in their own dtype, the gates as the fp32 values the kernel computed), so the state after token j of a
verify is bit-for-bit the state plain decoding reaches from the same inputs.

    gdn_recurrent(q, k, v, g, beta, state_in, states_out, every_position)   # decode / verify (Triton or loop)
    gdn_recurrent(q, k, v, a, b, ..., gates=(neg_A, dt_bias))                # the same, gates computed inside
    gdn_verify(q, k, v, a, b, state_in, record.layer(i), gates=...)          # verify: outputs, inputs recorded
    gdn_replay(record, states, n)                                           # then: all layers' states after n
    gdn_chunked(q, k, v, g, beta, state)                                    # prefill (chunks of 64)

Shapes (batch 1): q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; states [Hv, Dk, Dv] fp32. Outputs [T, Hv, Dv]
in v's dtype. The Triton path runs on CUDA (or under TRITON_INTERPRET=1, fp32/fp16 only); elsewhere a PyTorch loop
with the same arithmetic runs. Nothing synchronises with the host, so both can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from reviewer_kernels.fused_moe import dot_size, triton, triton_usable

L2_EPS = 1e-6  # transformers' / flash-linear-attention's l2norm epsilon
# launch shape of the Triton kernel (value columns per program, warps, next-token prefetch): the per-token chain of
# loads and reductions is the cost (a verify is 16 dependent steps), bench/kernel_sweep.py measures the choices
BLOCK_V, NUM_WARPS, PREFETCH = 16, 1, True  # H200, 35B-A3B shape: verify 29 -> 17 us, decode 3.2 -> 2.7 us
# the prefill's chunk walk (_gdn_chunks_kernel): value columns of the state per program, warps (the state slice
# [Dk, CHUNK_V] fp32 stays in registers across the chunks); 16, 8 still the fastest in the 2026-12-04 sweep
CHUNK_V, CHUNK_WARPS = 16, 8  # H200, 35B-A3B shape, 2048 tokens: 2.3 ms (32, 4: 12.5 ms; the PyTorch loop 5.6)
# the prefill's per-chunk terms (_gdn_chunk_prep_kernel): warps a (head, chunk) program, and the form of its two
# [64, Dk] x [Dk, 64] products (A and qk): "tf32" on tensor cores (10-bit mantissas in, fp32 sums: finer than the bf16
# inputs of flash-linear-attention's kernels, which transformers runs on GPUs), since "ieee" (CUDA-core FMAs) made the
# terms + solve + walk 2.0 ms a layer at 1,024 tokens on the H200 against 0.62 ms (bench/results/
# kernel_sweep_gdn_prefill_h200_20261204.json; state within 1e-4 of the fp32 loop). The walk keeps fp32 FMAs ("ieee",
# CHUNK_DOT): its products carry the state from chunk to chunk (in tf32 the prefill gained 4% and the state's error
# grew tenfold, to 9e-4: kernel_sweep_gdn_prefill_walk_h200_20261204.json; "tf32x3" hit an illegal memory access)
PREP_WARPS, PREP_DOT, CHUNK_DOT = 8, "tf32", "ieee"
# the solve (I + A) u = rhs of every (head, chunk): "triton" (_gdn_chunk_solve_kernel: blocks of SOLVE_BLOCK rows,
# fp32 FMAs, in place) or "cublas" (torch.linalg.solve_triangular: batched trsm after copies into its column-major
# layout); the walk's software-pipeline stages. H200, 35B-A3B shape, a 1,700-token piece, the whole gdn_chunked:
# cuBLAS 1,025 us, the Triton solve 846, and the walk in 2 stages 763, the same error against the fp32 loop
# (bench/results/kernel_sweep_gdn_prefill_solve_h200_20261204.json)
SOLVE, SOLVE_BLOCK, SOLVE_WARPS, CHUNK_STAGES = "triton", 16, 4, 2
# the walk's form: "fused" (_gdn_chunks_kernel: each chunk's output inside the walk, four products a chunk on the
# sequential path, q_decayed and qk read by each of a head's Dv / CHUNK_V programs) or "split" (_gdn_walk_kernel
# carries only the state: u and S, two products a chunk, storing each chunk's starting state and u; then
# _gdn_chunk_out_kernel computes every chunk's output at once, OUT_V columns a program, products in OUT_DOT). The
# split walk keeps the state in memory and multiplies it in WALK_K-row slices (no spills on sm_90: _gdn_walk_kernel).
# OUT_DOT "tf32": the outputs are stored in bf16, whose rounding (2^-9) is coarser than tf32's products with fp32
# sums, and they carry nothing forward; in "ieee" the build for sm_90 spills 15 KB a thread (Triton's FMA products
# hold whole operand rows in registers)
WALK, WALK_K, OUT_V, OUT_WARPS, OUT_DOT = "fused", 16, 64, 4, "tf32"

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _softplus(x):
        """torch's softplus (threshold 20) with an accurate log1p: log(u) * e / (u - 1), u = 1 + e (Goldberg)."""
        e = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + e
        return tl.where(x > 20.0, x, tl.where(u == 1.0, e, tl.log(u) * e / (u - 1.0)))

    @triton.jit
    def _gdn_inputs(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t, hk, h, rk, rv, k_ok, v_ok,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                    neg_a, dt_bias, RAW_GATES: tl.constexpr):
        """Token t's q, k (its key head), v (this program's columns), g and beta, in fp32. RAW_GATES: g_ptr and
        beta_ptr hold the projections a and b, and g = neg_a * softplus(a + dt_bias), beta = sigmoid(b) here."""
        q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + rk, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + rk, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + rv, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + h).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_bt + h).to(tl.float32)
        if RAW_GATES:
            g = neg_a * _softplus(g + dt_bias)
            beta = tl.sigmoid(beta).to(beta_ptr.dtype.element_ty).to(tl.float32)  # rounded as b.sigmoid() is
        return q, k, v, g, beta

    @triton.jit(do_not_specialize=["T"])
    def _gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, neg_a_ptr, dt_bias_ptr, state_in_ptr,
                              states_out_ptr, o_ptr, rq_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, T, scale,
                              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                              stride_ot, stride_oh, layer_q, layer_k, layer_v, layer_g, layer_b, layer_s,
                              HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                              DKP: tl.constexpr, BV: tl.constexpr, EVERY_POSITION: tl.constexpr,
                              PREFETCH: tl.constexpr, RAW_GATES: tl.constexpr, RECORD: tl.constexpr,
                              STORE_OUT: tl.constexpr, STORE_STATE: tl.constexpr):
        """Grid (value heads, value column blocks, layers). The layer axis is gdn_replay's (layer_* are the per-layer
        strides of inputs and states; 0 with one layer). RECORD: the inputs of every token go to rq..rb (q, k, v in
        their dtype, the gates in fp32), in the record's layout [T, heads, D]."""
        h = tl.program_id(0)  # value head
        vb = tl.program_id(1)  # block of BV value columns: programs never share state elements
        layer = tl.program_id(2).to(tl.int64)
        q_ptr += layer * layer_q
        k_ptr += layer * layer_k
        v_ptr += layer * layer_v
        g_ptr += layer * layer_g
        beta_ptr += layer * layer_b
        state_in_ptr += layer * layer_s
        states_out_ptr += layer * layer_s
        hk = h // GROUP
        rk = tl.arange(0, DKP)
        rv = vb * BV + tl.arange(0, BV)
        k_ok = rk < DK
        v_ok = rv < DV
        s_mask = k_ok[:, None] & v_ok[None, :]
        s_offs = h * DK * DV + rk[:, None] * DV + rv[None, :]
        qk_writer = (vb == 0) & (h % GROUP == 0)  # one program per key head records q and k
        S = tl.load(state_in_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)
        neg_a = 0.0
        dt_bias = 0.0
        if RAW_GATES:
            neg_a = tl.load(neg_a_ptr + h).to(tl.float32)
            dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        q, k, v, g, beta = _gdn_inputs(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, 0, hk, h, rk, rv, k_ok, v_ok,
                                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                                       stride_gt, stride_bt, neg_a, dt_bias, RAW_GATES)
        for t in range(T):
            if PREFETCH:  # the next token's inputs are loaded before this token's arithmetic waits on them
                nq, nk, nv, ng, nbeta = _gdn_inputs(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tl.minimum(t + 1, T - 1),
                                                    hk, h, rk, rv, k_ok, v_ok, stride_qt, stride_qh, stride_kt,
                                                    stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                                                    neg_a, dt_bias, RAW_GATES)
            else:
                nq, nk, nv, ng, nbeta = q, k, v, g, beta
            if RECORD:
                if qk_writer:
                    tl.store(rq_ptr + (t * (HV // GROUP) + hk) * DK + rk, q.to(rq_ptr.dtype.element_ty), mask=k_ok)
                    tl.store(rk_ptr + (t * (HV // GROUP) + hk) * DK + rk, k.to(rk_ptr.dtype.element_ty), mask=k_ok)
                tl.store(rv_ptr + (t * HV + h) * DV + rv, v.to(rv_ptr.dtype.element_ty), mask=v_ok)
                if vb == 0:
                    tl.store(rg_ptr + t * HV + h, g)
                    tl.store(rb_ptr + t * HV + h, beta)
            q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
            k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
            S = S * tl.exp(g)
            delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
            S = S + k[:, None] * delta[None, :]
            if STORE_OUT:
                o = tl.sum(S * q[:, None], axis=0)
                tl.store(o_ptr + t * stride_ot + h * stride_oh + rv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
            if EVERY_POSITION:
                tl.store(states_out_ptr + t * HV * DK * DV + s_offs, S, mask=s_mask)
            if PREFETCH:
                q, k, v, g, beta = nq, nk, nv, ng, nbeta
            else:
                q, k, v, g, beta = _gdn_inputs(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tl.minimum(t + 1, T - 1),
                                               hk, h, rk, rv, k_ok, v_ok, stride_qt, stride_qh, stride_kt,
                                               stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                                               neg_a, dt_bias, RAW_GATES)
        if STORE_STATE and not EVERY_POSITION:
            tl.store(states_out_ptr + s_offs, S, mask=s_mask)

    # do_not_specialize: a piece's length and chunk count change from request to request; specialised (divisible by
    # 16, equal to 1) they would compile new variants on the request path
    @triton.jit(do_not_specialize=["T", "n_chunks"])
    def _gdn_chunk_prep_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, qd_ptr, qk_ptr, ke_ptr,
                               decay_ptr, T, n_chunks, scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                               stride_vh, stride_gt, stride_bt, EPS: tl.constexpr, GROUP: tl.constexpr,
                               C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DOT: tl.constexpr):
        """gdn_chunked's per-chunk terms for value head h and chunk i (see gdn_chunked), straight from the
        projections' layout: l2-normed q, k; the cumulative log-decay c; A (strictly lower: the triangular solve
        reads nothing else) and the solve's right-hand sides [beta v | beta e^c k]; qk, q_decayed, k_to_end and the
        chunk's decay; written as [Hv, n, C, *]. Positions past T load as zeros (k = v = beta = g = 0), as
        gdn_chunked's padding."""
        h = tl.program_id(0)
        i = tl.program_id(1)
        r = tl.arange(0, C)
        t = i * C + r
        ok = t < T
        kk = tl.arange(0, DK)
        vv = tl.arange(0, DV)
        hk = h // GROUP
        q = tl.load(q_ptr + t[:, None] * stride_qt + hk * stride_qh + kk[None, :], mask=ok[:, None],
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t[:, None] * stride_kt + hk * stride_kh + kk[None, :], mask=ok[:, None],
                    other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + h, mask=ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_bt + h, mask=ok, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 1) + EPS)[:, None] * scale
        k = k * tl.rsqrt(tl.sum(k * k, 1) + EPS)[:, None]
        c = tl.cumsum(g, 0)
        decay = tl.exp(tl.where(r[:, None] >= r[None, :], c[:, None] - c[None, :], float("-inf")))  # j <= t
        kb = k * beta[:, None]
        chunk = (h * n_chunks + i).to(tl.int64)
        cc_offs = chunk * C * C + r[:, None] * C + r[None, :]
        tl.store(a_ptr + cc_offs, tl.where(r[:, None] > r[None, :],
                                           tl.dot(kb, tl.trans(k), input_precision=DOT) * decay, 0.0))
        tl.store(qk_ptr + cc_offs, tl.dot(q, tl.trans(k), input_precision=DOT) * decay)
        ec = tl.exp(c)
        c_last = tl.sum(tl.where(r == C - 1, c, 0.0), 0)
        k_offs = chunk * C * DK + r[:, None] * DK + kk[None, :]
        b_rows = chunk * C * (DV + DK) + r[:, None] * (DV + DK)
        tl.store(b_ptr + b_rows + DV + kk[None, :], kb * ec[:, None])
        tl.store(qd_ptr + k_offs, q * ec[:, None])
        tl.store(ke_ptr + k_offs, k * tl.exp(c_last - c)[:, None])
        tl.store(decay_ptr + chunk, tl.exp(c_last))
        v = tl.load(v_ptr + t[:, None] * stride_vt + h * stride_vh + vv[None, :], mask=ok[:, None],
                    other=0.0).to(tl.float32)
        tl.store(b_ptr + b_rows + vv[None, :], v * beta[:, None])

    @triton.jit
    def _gdn_chunk_solve_kernel(a_ptr, u_ptr, C: tl.constexpr, W: tl.constexpr, B: tl.constexpr,
                                WB: tl.constexpr, DOT: tl.constexpr):
        """(I + A) u = rhs for one (value head, chunk): A [C, C] strictly lower (zeros on and above the diagonal),
        rhs [C, W] rows, overwritten by u. Block forward substitution over the C // B diagonal blocks of B rows:
          1. each diagonal block's inverse, all blocks at once as one [C // B, B, B] tile: B - 1 steps of
             row i <- e_i - sum_{j < i} A_ij row j (the reductions stay inside a block, B = 16 wide; the 64-step
             substitution of whole chunks through cross-warp reductions cost 2 ms a layer);
          2. per WB columns, block by block: u_b = inv_b (rhs_b - sum_{c < b} A_bc u_c), the u_c read back from
             where this program stored them (a barrier after each store).
        Products in DOT (fp32 FMAs, "ieee": the walk carries u into the state)."""
        pid = tl.program_id(0).to(tl.int64)  # (head, chunk), flattened as A and rhs are laid out
        a_ptr += pid * C * C
        u_ptr += pid * C * W
        NB: tl.constexpr = C // B
        nb = tl.arange(0, NB)
        rb = tl.arange(0, B)
        X = tl.zeros([NB, B, B], tl.float32) + (rb[:, None] == rb[None, :]).to(tl.float32)[None, :, :]
        for i in tl.static_range(1, B):
            # row i of every diagonal block of A; its columns i.. are zeros, so the sum may run over all j
            a = tl.load(a_ptr + (nb[:, None] * B + i) * C + nb[:, None] * B + rb[None, :])
            X += tl.where(rb[None, :, None] == i, -tl.sum(a[:, :, None] * X, axis=1)[:, None, :], 0.0)
        cols = tl.arange(0, WB)
        for w in range(0, W, WB):
            for b in tl.static_range(NB):
                rows = b * B + rb
                acc = tl.load(u_ptr + rows[:, None] * W + w + cols[None, :])
                for c in tl.static_range(b):
                    a_bc = tl.load(a_ptr + rows[:, None] * C + c * B + rb[None, :])
                    u_c = tl.load(u_ptr + (c * B + rb)[:, None] * W + w + cols[None, :])
                    acc -= tl.dot(a_bc, u_c, input_precision=DOT)
                inv_b = tl.sum(tl.where(nb[:, None, None] == b, X, 0.0), axis=0)
                tl.store(u_ptr + rows[:, None] * W + w + cols[None, :], tl.dot(inv_b, acc, input_precision=DOT))
                tl.debug_barrier()  # the next blocks read these rows back

    @triton.jit(do_not_specialize=["n_chunks", "T", "stride_uh", "stride_un"])
    def _gdn_chunks_kernel(u_ptr, qd_ptr, qk_ptr, ke_ptr, decay_ptr, s_ptr, out_ptr, n_chunks, T,
                           stride_uh, stride_un, stride_ur, stride_uc, stride_ot, stride_oh, C: tl.constexpr,
                           DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
        """gdn_chunked's walk for value head h and state columns cols, chunk by chunk (inputs [Hv, n, C, *]; u's
        rows are [u_free | u_state], DV + DK wide, in the solver's layout: its strides):
            u   = u_free - u_state @ S;   out = q_decayed @ S + qk @ u;   S = S * decay + k_to_end^T @ u
        in fp32 (DOT "ieee": CUDA-core FMAs, CHUNK_DOT); out [T, Hv, DV] in its own dtype, the rows of positions
        past T not written."""
        h = tl.program_id(0)
        cols = tl.program_id(1) * BV + tl.arange(0, BV)
        r = tl.arange(0, C)
        kk = tl.arange(0, DK)
        s_offs = h * DK * DV + kk[:, None] * DV + cols[None, :]
        S = tl.load(s_ptr + s_offs)
        for i in range(n_chunks):
            chunk = (h * n_chunks + i).to(tl.int64)
            k_offs = chunk * C * DK + r[:, None] * DK + kk[None, :]
            u_rows = u_ptr + h * stride_uh + i * stride_un + r[:, None] * stride_ur
            u_state = tl.load(u_rows + (DV + kk[None, :]) * stride_uc)
            u = tl.load(u_rows + cols[None, :] * stride_uc) - tl.dot(u_state, S, input_precision=DOT)
            qk = tl.load(qk_ptr + chunk * C * C + r[:, None] * C + r[None, :])
            o = tl.dot(tl.load(qd_ptr + k_offs), S, input_precision=DOT) + tl.dot(qk, u, input_precision=DOT)
            t = i * C + r
            tl.store(out_ptr + t[:, None].to(tl.int64) * stride_ot + h * stride_oh + cols[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=(t < T)[:, None])
            ke = tl.load(ke_ptr + k_offs)
            S = S * tl.load(decay_ptr + chunk) + tl.dot(tl.trans(ke), u, input_precision=DOT)
        tl.store(s_ptr + s_offs, S)

    @triton.jit
    def _tf32_high(x):
        """x with its mantissa cut to tf32's 10 bits: exact on tensor cores in tf32."""
        return (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)

    @triton.jit
    def _walk_dot(a, b, DOT: tl.constexpr):
        """a @ b in fp32 sums: DOT "3xtf32" as three tf32 tensor-core products of the operands' high and low parts
        (hi.hi + hi.lo + lo.hi: the dropped lo.lo is below fp32's rounding of the sum, about 2^-20 of it), written
        out here because Triton 3.6's own "tf32x3" hit an illegal memory access on the H200; else tl.dot in DOT."""
        if DOT == "3xtf32":
            a_hi = _tf32_high(a)
            b_hi = _tf32_high(b)
            small = tl.dot(a_hi, b - b_hi, input_precision="tf32") + tl.dot(a - a_hi, b_hi, input_precision="tf32")
            return small + tl.dot(a_hi, b_hi, input_precision="tf32")
        else:
            return tl.dot(a, b, input_precision=DOT)

    @triton.jit(do_not_specialize=["n_chunks", "stride_uh", "stride_un"])
    def _gdn_walk_kernel(u_ptr, ke_ptr, decay_ptr, s_ptr, starts_ptr, n_chunks, stride_uh, stride_un, stride_ur,
                         stride_uc, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                         KS: tl.constexpr, DOT: tl.constexpr):
        """The split walk (WALK "split") for value head h and state columns cols. The state lives in starts
        [Hv, n, DK, DV] (chunk i's starting state at [h, i]; the first copied from s), not in registers: per chunk,
            u = u_free - u_state @ S_i          (written over u_free: this program owns these columns)
            S_i+1 = S_i * decay + k_to_end^T @ u (into [h, i + 1]; after the last chunk into s)
        each product as DK / KS products of KS rows of S, read back from where this program stored them (a barrier
        after each chunk: the threads that read a row are not those that wrote it). Why not registers: Triton's
        fp32 FMA products hold whole operand rows in registers, and with S and the [C, DK] tiles there the build
        for sm_90 spilled at 255 registers a thread; in KS-row slices it takes 128 (KS 16, 8 warps) and spills
        nothing, so two programs share an SM and the 256 programs of the 35B-A3B shape run in one wave."""
        h = tl.program_id(0)
        cols = tl.program_id(1) * BV + tl.arange(0, BV)
        r = tl.arange(0, C)
        ks = tl.arange(0, KS)
        first = starts_ptr + h.to(tl.int64) * n_chunks * DK * DV
        for j in tl.static_range(DK // KS):
            rows = j * KS + ks
            tile = rows[:, None] * DV + cols[None, :]
            tl.store(first + tile, tl.load(s_ptr + h * DK * DV + tile))
        tl.debug_barrier()
        for i in range(n_chunks):
            chunk = (h * n_chunks + i).to(tl.int64)
            here = starts_ptr + chunk * DK * DV
            u_rows = u_ptr + h * stride_uh + i * stride_un + r[:, None] * stride_ur
            u = tl.load(u_rows + cols[None, :] * stride_uc)
            for j in tl.static_range(DK // KS):
                rows = j * KS + ks
                u -= _walk_dot(tl.load(u_rows + (DV + rows[None, :]) * stride_uc),
                               tl.load(here + rows[:, None] * DV + cols[None, :]), DOT)
            tl.store(u_rows + cols[None, :] * stride_uc, u)
            decay = tl.load(decay_ptr + chunk)
            after = tl.where(i == n_chunks - 1, s_ptr + h * DK * DV, here + DK * DV)
            for j in tl.static_range(DK // KS):
                rows = j * KS + ks
                tile = rows[:, None] * DV + cols[None, :]
                ke_t = tl.load(ke_ptr + chunk * C * DK + r[None, :] * DK + rows[:, None])  # [KS, C]
                tl.store(after + tile, tl.load(here + tile) * decay + _walk_dot(ke_t, u, DOT))
            tl.debug_barrier()  # the next chunk reads these rows

    @triton.jit(do_not_specialize=["n_chunks", "T", "stride_uh", "stride_un"])
    def _gdn_chunk_out_kernel(u_ptr, qd_ptr, qk_ptr, starts_ptr, out_ptr, n_chunks, T, stride_uh, stride_un,
                              stride_ur, stride_uc, stride_ot, stride_oh, C: tl.constexpr, DK: tl.constexpr,
                              DV: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
        """The split walk's outputs, every (value head, chunk, BV columns) at once: out = q_decayed @ S_start +
        qk @ u, in out's dtype; the rows of positions past T not written."""
        h = tl.program_id(0)
        i = tl.program_id(1)
        cols = tl.program_id(2) * BV + tl.arange(0, BV)
        r = tl.arange(0, C)
        kk = tl.arange(0, DK)
        chunk = (h * n_chunks + i).to(tl.int64)
        S = tl.load(starts_ptr + chunk * DK * DV + kk[:, None] * DV + cols[None, :])
        u = tl.load(u_ptr + h * stride_uh + i * stride_un + r[:, None] * stride_ur + cols[None, :] * stride_uc)
        qd = tl.load(qd_ptr + chunk * C * DK + r[:, None] * DK + kk[None, :])
        qk = tl.load(qk_ptr + chunk * C * C + r[:, None] * C + r[None, :])
        o = tl.dot(qd, S, input_precision=DOT) + tl.dot(qk, u, input_precision=DOT)
        t = i * C + r
        tl.store(out_ptr + t[:, None].to(tl.int64) * stride_ot + h * stride_oh + cols[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=(t < T)[:, None])


def _check(q, k, v, g, beta, state_in, states_out, every_position):
    T, hk, dk = q.shape
    _, hv, dv = v.shape
    if k.shape != q.shape or v.shape[0] != T or g.shape != (T, hv) or beta.shape != (T, hv) or hv % hk:
        raise ValueError(f"bad shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} "
                         f"beta {tuple(beta.shape)}")
    if state_in.shape != (hv, dk, dv) or state_in.dtype != torch.float32:
        raise ValueError(f"state_in must be fp32 [{hv}, {dk}, {dv}], got {state_in.dtype} {tuple(state_in.shape)}")
    want = (T, hv, dk, dv) if every_position else (hv, dk, dv)
    if tuple(states_out.shape) != want or states_out.dtype != torch.float32:
        raise ValueError(f"states_out must be fp32 {list(want)}, got {states_out.dtype} {tuple(states_out.shape)}")
    if not (state_in.is_contiguous() and states_out.is_contiguous()):
        raise ValueError("state tensors must be contiguous")


def gdn_gates(a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor, dt_bias: torch.Tensor):
    """transformers' gates from the projections a, b [T, Hv]: g = -exp(A_log) softplus(a + dt_bias) (fp32) and
    beta = sigmoid(b) (b's dtype). neg_A = -exp(A_log), fp32."""
    return neg_A * F.softplus(a.float() + dt_bias), b.sigmoid()


def gdn_recurrent(q, k, v, g, beta, state_in: torch.Tensor, states_out: torch.Tensor, every_position: bool,
                  *, gates: tuple[torch.Tensor, torch.Tensor] | None = None, use_triton: bool | None = None,
                  block_v: int | None = None, num_warps: int | None = None, prefetch: bool | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Run T tokens through the recurrence from `state_in`; returns the outputs [T, Hv, Dv] (v's dtype).

    every_position=False: the final state goes to `states_out` [Hv, Dk, Dv] (may be `state_in` itself: decode
    updates the live state in place). every_position=True: the state after token t goes to `states_out[t]`
    ([T, Hv, Dk, Dv]; a view of the first T rows of a larger snapshot buffer is fine), `state_in` is only read.
    gates=(neg_A, dt_bias): g and beta are the raw projections a and b, turned into gates by the kernel itself
    (gdn_gates' math; two elementwise launches fewer per layer).
    block_v / num_warps / prefetch override the launch shape (bench/kernel_sweep.py). out: a tensor like v to write
    the outputs into (e.g. rows of a larger one).
    """
    _check(q, k, v, g, beta, state_in, states_out, every_position)
    if use_triton is None:
        use_triton = triton_usable(v)
    if not use_triton:
        if gates is not None:
            g, beta = gdn_gates(g, beta, *gates)
        result = gdn_recurrent_torch(q, k, v, g, beta, state_in, states_out, every_position)
        return result if out is None else out.copy_(result)
    T, hk, dk = q.shape
    _, hv, dv = v.shape
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (g, beta))
    neg_a, dt_bias = gates if gates is not None else (g, g)  # unused without gates
    if out is None:
        out = torch.empty_like(v)
    elif out.shape != v.shape or out.dtype != v.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be like v {tuple(v.shape)} {v.dtype}, got {tuple(out.shape)} {out.dtype}")
    _launch(q, k, v, g, beta, neg_a, dt_bias, state_in, states_out, out, None, T, 1,
            every_position=every_position, raw_gates=gates is not None, store_out=True, store_state=True,
            block_v=block_v, num_warps=num_warps, prefetch=prefetch)
    return out


def _launch(q, k, v, g, beta, neg_a, dt_bias, state_in, states_out, out, record, T: int, layers: int, *,
            every_position: bool, raw_gates: bool, store_out: bool, store_state: bool, block_v=None, num_warps=None,
            prefetch=None) -> None:
    """One launch of the Triton kernel over `layers` layers (inputs and states with a leading layer axis when
    layers > 1: gdn_replay)."""
    hk, dk = q.shape[-2], q.shape[-1]
    hv, dv = v.shape[-2], v.shape[-1]
    if block_v is None:
        block_v = min(BLOCK_V, triton.next_power_of_2(dv))  # Dv / BLOCK_V programs per head
    rec = record if record is not None else (v, v, v, v, v)  # unused without RECORD
    per_layer = (lambda x: x.stride(0)) if layers > 1 else (lambda x: 0)  # noqa: E731
    o = out if out is not None else v
    _gdn_recurrent_kernel[(hv, triton.cdiv(dv, block_v), layers)](
        q, k, v, g, beta, neg_a, dt_bias, state_in, states_out, o, *rec, T, dk ** -0.5,
        q.stride(-3), q.stride(-2), k.stride(-3), k.stride(-2), v.stride(-3), v.stride(-2), g.stride(-2),
        beta.stride(-2), o.stride(-3), o.stride(-2),
        per_layer(q), per_layer(k), per_layer(v), per_layer(g), per_layer(beta), per_layer(state_in),
        HV=hv, GROUP=hv // hk, DK=dk, DV=dv, DKP=triton.next_power_of_2(dk), BV=block_v,
        EVERY_POSITION=every_position, PREFETCH=PREFETCH if prefetch is None else prefetch,
        RAW_GATES=raw_gates, RECORD=record is not None, STORE_OUT=store_out, STORE_STATE=store_state,
        num_warps=num_warps or NUM_WARPS)


class GdnRecord(NamedTuple):
    """A verify's recurrence inputs, for gdn_replay: q, k [.., T, Hk, Dk] and v [.., T, Hv, Dv] in the model dtype,
    the gates g, beta [.., T, Hv] in fp32 (as the kernel computed them), with a leading layer axis for a cache."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @classmethod
    def empty(cls, layers: int, tokens: int, key_heads: int, key_dim: int, value_heads: int, value_dim: int,
              device, dtype) -> GdnRecord:
        e = lambda *s, dt=dtype: torch.zeros(layers, tokens, *s, device=device, dtype=dt)  # noqa: E731
        return cls(e(key_heads, key_dim), e(key_heads, key_dim), e(value_heads, value_dim),
                   e(value_heads, dt=torch.float32), e(value_heads, dt=torch.float32))

    def layer(self, i: int) -> GdnRecord:
        return GdnRecord(*(x[i] for x in self))


def gdn_verify(q, k, v, g, beta, state_in: torch.Tensor, record: GdnRecord, *,
               gates: tuple[torch.Tensor, torch.Tensor] | None = None, use_triton: bool | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """A verify block of T tokens from `state_in` (only read): returns the outputs [T, Hv, Dv], and writes the block's
    inputs into the first T tokens of `record` (one layer's GdnRecord) for gdn_replay. No state is written."""
    _check(q, k, v, g, beta, state_in, state_in, False)
    T = q.shape[0]
    if record.v.shape[0] < T or record.q.shape[1:] != q.shape[1:] or record.v.shape[1:] != v.shape[1:]:
        raise ValueError(f"record holds {record.v.shape[0]} tokens of q {tuple(record.q.shape[1:])}, v "
                         f"{tuple(record.v.shape[1:])}; got {T} tokens of q {tuple(q.shape[1:])}, "
                         f"v {tuple(v.shape[1:])}")
    if use_triton is None:
        use_triton = triton_usable(v)
    if not use_triton:
        if gates is not None:
            g, beta = gdn_gates(g, beta, *gates)
        for dst, src in zip(record, (q, k, v, g, beta)):
            dst[:T].copy_(src)
        result = gdn_recurrent_torch(q, k, v, g, beta, state_in, None, False)
        return result if out is None else out.copy_(result)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (g, beta))
    neg_a, dt_bias = gates if gates is not None else (g, g)
    if out is None:
        out = torch.empty_like(v)
    _launch(q, k, v, g, beta, neg_a, dt_bias, state_in, state_in, out, tuple(record), T, 1, every_position=False,
            raw_gates=gates is not None, store_out=True, store_state=False)
    return out


def gdn_replay(record: GdnRecord, states: torch.Tensor, n: int, *, use_triton: bool | None = None) -> None:
    """states [L, Hv, Dk, Dv] (fp32) <- each layer's state after the first n tokens of `record` (leading layer axis
    L), in place, in one launch: the same per-token arithmetic as the verify that recorded them."""
    if not 1 <= n <= record.v.shape[1]:
        raise ValueError(f"replay 1..{record.v.shape[1]} tokens, got {n}")
    if states.dtype != torch.float32 or states.shape[0] != record.v.shape[0] or not states.is_contiguous():
        raise ValueError(f"states must be contiguous fp32 [{record.v.shape[0]}, Hv, Dk, Dv], got {states.dtype} "
                         f"{tuple(states.shape)}")
    if use_triton is None:
        use_triton = triton_usable(states)
    if not use_triton:
        for i in range(states.shape[0]):
            r = record.layer(i)
            gdn_recurrent_torch(r.q[:n], r.k[:n], r.v[:n], r.g[:n], r.beta[:n], states[i], states[i], False)
        return
    r = record
    _launch(r.q, r.k, r.v, r.g, r.beta, r.g, r.g, states, states, None, None, n, states.shape[0],
            every_position=False, raw_gates=False, store_out=False, store_state=True)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _expand_heads(q, k, hv):
    group = hv // q.shape[1]
    if group > 1:  # each query/key head serves `group` consecutive value heads
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q, k


def gdn_recurrent_torch(q, k, v, g, beta, state_in, states_out, every_position: bool) -> torch.Tensor:
    """The PyTorch twin of the kernel: a loop over tokens, exact (fp32 state, inputs upcast)."""
    T, hv = v.shape[0], v.shape[1]
    q, k = _expand_heads(q.float(), k.float(), hv)
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    vf, g, beta = v.float(), g.float(), beta.float()
    S = state_in.clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        delta = (vf[t] - (S * k[t][:, :, None]).sum(dim=1)) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = (S * q[t][:, :, None]).sum(dim=1)
        if every_position:
            states_out[t].copy_(S)
    if states_out is not None and not every_position:  # None: a verify (gdn_verify), the state is not written
        states_out.copy_(S)
    return out.to(v.dtype)


def gdn_chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64, *,
                use_triton: bool | None = None) -> torch.Tensor:
    """Prefill form: the same recurrence over T tokens, a chunk of tokens per step (matmuls instead of a token loop).
    Updates `state` [Hv, Dk, Dv] fp32 in place to the state after the last token; returns outputs [T, Hv, Dv].

    Within a chunk, with c_t the cumulative log-decay from the chunk start and S0 the state before it:
      the corrections u_t solve (I + A) U = beta V - beta e^c (K S0), A[t, j] = beta_t e^(c_t - c_j) k_t.k_j (j < t)
      o_t = e^(c_t) S0^T q_t + sum_{j <= t} e^(c_t - c_j) (q_t.k_j) u_j
      S'  = e^(c_last) S0 + sum_j e^(c_last - c_j) k_j u_j^T
    Padded positions (k = v = beta = g = 0) leave the state untouched. The per-chunk terms do not depend on S0, so
    they are computed for all chunks at once; then a walk from chunk to chunk carries the state. Where Triton runs,
    three launches (_gdn_chunk_prep_kernel reads q, k, v, g, beta where they lie; _gdn_chunk_solve_kernel solves
    for u; _gdn_chunks_kernel walks and writes the output in v's layout and dtype); elsewhere batched PyTorch and a loop.
    """
    if use_triton is None:
        use_triton = triton_usable(v) and _chunks_fit(q.shape[-1], v.shape[-1], chunk)
    if use_triton:
        return _chunked_triton(q, k, v, g, beta, state, chunk)
    T, hv = v.shape[0], v.shape[1]
    terms = _chunk_terms_torch(q, k, v, g, beta, chunk)
    out = _chunk_loop_torch(*terms, state)
    return out.reshape(hv, -1, out.shape[-1])[:, :T].transpose(0, 1).to(v.dtype)


def _chunk_terms_torch(q, k, v, g, beta, chunk: int):
    """gdn_chunked's per-chunk terms, batched over the chunks: u_free, u_state, q_decayed, qk, k_to_end [Hv, n, C,
    *] and the chunks' decays [Hv, n]."""
    T, hv = v.shape[0], v.shape[1]
    q, k = _expand_heads(q.float(), k.float(), hv)
    q = (_l2norm(q) * q.shape[-1] ** -0.5).transpose(0, 1)  # [Hv, T, Dk]
    k = _l2norm(k).transpose(0, 1)
    vf = v.float().transpose(0, 1)  # [Hv, T, Dv]
    g, beta = g.float().t(), beta.float().t()  # [Hv, T]
    pad = (-T) % chunk
    if pad:
        q, k, vf = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, vf))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, vf = (x.reshape(hv, n, chunk, -1) for x in (q, k, vf))
    g, beta = g.reshape(hv, n, chunk), beta.reshape(hv, n, chunk)
    c = g.cumsum(-1)  # [Hv, n, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # e^(c_t - c_j), j <= t
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * decay
    unit = torch.eye(chunk, device=v.device) + A.tril(-1)
    u_free = torch.linalg.solve_triangular(unit, vf * beta[..., None], upper=False, unitriangular=True)
    u_state = torch.linalg.solve_triangular(unit, kb * c.exp()[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * c.exp()[..., None]
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]
    return u_free, u_state, q_decayed, qk, k_to_end, c[..., -1].exp()


def _chunk_loop_torch(u_free, u_state, q_decayed, qk, k_to_end, chunk_decay, state):
    """gdn_chunked's walk over the chunks, one chunk after the other (each needs the state the last one left)."""
    S = state
    out = torch.empty_like(u_free)
    for i in range(u_free.shape[1]):
        u = u_free[:, i] - u_state[:, i] @ S
        out[:, i] = q_decayed[:, i] @ S + qk[:, i] @ u
        S = S * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    state.copy_(S)
    return out


def _chunks_fit(dk: int, dv: int, chunk: int) -> bool:
    """The Triton kernels take power-of-two key and value dims and chunks >= 16 (tl.dot shapes), value dims in
    CHUNK_V."""
    return dot_size(dk) and dot_size(dv) and dot_size(chunk) and dv % CHUNK_V == 0


def _chunked_triton(q, k, v, g, beta, state, chunk: int) -> torch.Tensor:
    """gdn_chunked in three steps: the terms (one launch, parallel over heads and chunks), the triangular solve for
    both right-hand sides (_solve: one launch, parallel over heads and chunks), the walk (one launch, parallel over
    heads and value columns). Before (the terms as batched PyTorch: ~40 launches and two solves a layer), a
    1,700-token prefill at the 35B-A3B shape spent ~30 ms of its ~150 there (bench/results/step_budget_*)."""
    _check(q, k, v, g, beta, state, state, every_position=False)  # the state is read and written in place
    T, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need contiguous head dims")
    g, beta = g.contiguous(), beta.contiguous()  # [T, Hv], a head's gate at + h
    n = triton.cdiv(T, chunk)
    f32 = dict(dtype=torch.float32, device=v.device)
    A, rhs = torch.empty(hv, n, chunk, chunk, **f32), torch.empty(hv, n, chunk, dv + dk, **f32)
    q_decayed, k_to_end = torch.empty(hv, n, chunk, dk, **f32), torch.empty(hv, n, chunk, dk, **f32)
    qk, chunk_decay = torch.empty(hv, n, chunk, chunk, **f32), torch.empty(hv, n, **f32)
    _gdn_chunk_prep_kernel[(hv, n)](
        q, k, v, g, beta, A, rhs, q_decayed, qk, k_to_end, chunk_decay, T, n, dk ** -0.5, q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), EPS=L2_EPS,
        GROUP=hv // hk, C=chunk, DK=dk, DV=dv, DOT=PREP_DOT, num_warps=PREP_WARPS, num_stages=1)
    u = _solve(A, rhs)
    out = torch.empty(T, hv, dv, dtype=v.dtype, device=v.device)
    if WALK == "split":
        return _walk_split(u, q_decayed, qk, k_to_end, chunk_decay, state, out, chunk)
    _gdn_chunks_kernel[(hv, dv // CHUNK_V)](u, q_decayed, qk, k_to_end, chunk_decay, state, out, n, T, *u.stride(),
                                            out.stride(0), out.stride(1), C=chunk, DK=dk, DV=dv, BV=CHUNK_V,
                                            DOT=CHUNK_DOT, num_warps=CHUNK_WARPS, num_stages=CHUNK_STAGES)
    return out


def _walk_split(u, q_decayed, qk, k_to_end, chunk_decay, state, out, chunk: int) -> torch.Tensor:
    """WALK "split": the state's walk (a program per head and CHUNK_V columns, sequential over the chunks), then
    the outputs of all chunks in one parallel launch from the chunks' starting states (n x 64 KB a head at the
    35B-A3B shape, fp32: written once, read once)."""
    hv, n, _, dk = q_decayed.shape
    T, dv = out.shape[0], out.shape[2]
    starts = torch.empty(hv, n, dk, dv, dtype=torch.float32, device=out.device)
    _gdn_walk_kernel[(hv, dv // CHUNK_V)](u, k_to_end, chunk_decay, state, starts, n, *u.stride(), C=chunk, DK=dk,
                                          DV=dv, BV=CHUNK_V, KS=min(WALK_K, dk), DOT=CHUNK_DOT,
                                          num_warps=CHUNK_WARPS, num_stages=CHUNK_STAGES)
    block = min(OUT_V, dv)
    _gdn_chunk_out_kernel[(hv, n, dv // block)](u, q_decayed, qk, starts, out, n, T, *u.stride(), out.stride(0),
                                                out.stride(1), C=chunk, DK=dk, DV=dv, BV=block, DOT=OUT_DOT,
                                                num_warps=OUT_WARPS)
    return out


def _solve(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """u with (I + A) u = rhs for every (head, chunk) (A [Hv, n, C, C] strictly lower, rhs [Hv, n, C, W]): in place
    in rhs (SOLVE "triton"), or cuBLAS's result in its column-major layout, which the walk reads through its
    strides."""
    if SOLVE == "cublas":
        return torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    hv, n, chunk, width = rhs.shape
    _gdn_chunk_solve_kernel[(hv * n,)](A, rhs, C=chunk, W=width, B=min(SOLVE_BLOCK, chunk),
                                       WB=min(64, width & -width), DOT="ieee", num_warps=SOLVE_WARPS)
    return rhs
