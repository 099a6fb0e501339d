"""Qwen-style MoE routing in one launch: softmax over the experts (fp32), top-k, optional renormalisation.

transformers' routers do this in ~6 small PyTorch kernels, which at decode cost as much as the experts
themselves (H200, 1 token: ~25 us router vs ~26 us experts per layer in CUDA graphs). Same math and order:
probabilities = softmax(logits in fp32); top-k by probability, largest first; weights / their sum if
renormalising; weights cast to the logits' dtype. Ties pick the lowest expert index.

    weights, ids = route_topk(logits, top_k)                   # logits [M, E] from the caller's router matmul
    weights, ids = route_topk_from_hidden(h, router, top_k)    # the router matmul too (M <= 16: two launches)
    weights, ids = route_topk_from_hidden(x, router, top_k, rms_norm=(w, eps), normed_out=h)  # and the norm first

route_topk_from_hidden: cuBLAS spends ~5 us on the 35B-A3B router (1 MB of weights, 4 CTAs) at 1 or 16 tokens
(bench/kernel_sweep.py). Here a grid of (expert tiles x K slices) programs writes fp32 partial logits and the routing
kernel adds the slices in a fixed order, rounds the sum to the hidden states' dtype (what F.linear returns) and
routes: the weights are read by 64 programs at once instead of 4.
"""

from __future__ import annotations

import torch

from reviewer_kernels.fused_moe import triton, triton_usable
from reviewer_kernels.moe_reference import rms_norm_scaled
from reviewer_kernels.rows_linear import split_workspace

SMALL_BATCH = 64  # up to this many tokens, one token per program
ROUTER_MAX_TOKENS = 16  # route_topk_from_hidden's own matmul up to this many tokens (a decode step or a verify block)
ROUTER_K_SPLIT = 4  # K slices of the router matmul
ROUTER_BLOCK_E = 16  # experts per program
ROUTER_BLOCK_K = 128  # the K step of a slice's loop: pipelined, nothing between a load and its MMA
# With the norm from partial sums inside (sumsq=..., the glue kernels' path), the rows are normed between their load
# and the MMA, which keeps the loop from overlapping one step's loads with the previous step's work: that router took
# 5.8 us a layer against 3.1 without (H200, 2026-12-05). So a slice is one step there, every load issued at once. A
# guess until `python bench/kernel_sweep.py --only glue` times both (each checked: a token alone routes to the block's
# bits). The one-token norm (rms_norm without sumsq, one token) keeps ROUTER_BLOCK_K, as it was timed.
ROUTER_NORM_BLOCK_K = 512
# Route inside the router matmul's launch (its last program to finish adds the K slices and routes all tokens as one
# [16, E] tile) instead of a second launch. Off: timed on the H200 on 2026-12-03 it took 13.3 us a layer against 5.7
# for the two launches (the last program's serial top-k outweighs the launch it saves; bench/step_budget.py
# --route-in-matmul, bench/results/step_budget_qwen3.6-35b-a3b-shape_route_in_matmul_20261203.json). A token's bits then
# differ from the two-launch path's (another reduction layout), but not between a decode step and a verify block.
ROUTE_IN_MATMUL = False

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_tokens"])
    def _router_partial_kernel(h_ptr, w_ptr, nw_ptr, normed_ptr, part_ptr, ss_ptr, num_tokens, E, H, k_per_split,
                               stride_h, stride_w, eps, count_ptr, weights_ptr, ids_ptr, BM: tl.constexpr,
                               BE: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, HAS_NORM: tl.constexpr,
                               HP: tl.constexpr, ROUTE: tl.constexpr, PARTS: tl.constexpr,
                               RENORMALIZE: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                               SS_PARTS: tl.constexpr, SS_P: tl.constexpr):
        """Grid (expert tiles, K slices): part[slice, token, expert] = h[token, slice] . w[expert, slice], fp32.
        HAS_NORM (one token): h is the raw residual stream, normed here (rms_norm_scaled with weight nw) from its
        sum of squares, which each program takes over the whole row (4 KB at the 35B-A3B width, from L2); the
        first program also stores the normed row to normed_ptr for the experts. SS_PARTS > 0 (up to BM tokens): the
        rows' sums of squares come as SS_PARTS partials [SS_PARTS, BM] (wide_linear's sumsq), added in order here;
        the programs of the first expert tile store their K slice of the normed rows."""
        e = tl.program_id(0) * BE + tl.arange(0, BE)
        split = tl.program_id(1)
        m = tl.arange(0, BM)
        kk = tl.arange(0, BK)
        acc = tl.zeros([BM, BE], tl.float32)
        k_lo = split * k_per_split
        if HAS_NORM:
            cols = tl.arange(0, HP)
            row = tl.load(h_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(row * row, axis=0) / H + eps)
            if (tl.program_id(0) == 0) & (split == 0):
                nw_row = tl.load(nw_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
                tl.store(normed_ptr + cols, (row * rstd * nw_row).to(normed_ptr.dtype.element_ty), mask=cols < H)
        if SS_PARTS > 0:
            pp = tl.arange(0, SS_P)
            ss = tl.load(ss_ptr + pp[:, None] * BM + m[None, :], mask=(pp < SS_PARTS)[:, None], other=0.0)
            rstd_rows = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / H + eps)
        for k0 in range(k_lo, k_lo + k_per_split, BK):
            k = k0 + kk
            k_ok = k < H
            ht = tl.load(h_ptr + m[:, None] * stride_h + k[None, :], mask=(m < num_tokens)[:, None] & k_ok[None, :],
                         other=0.0)
            if HAS_NORM:
                nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                ht = (ht.to(tl.float32) * rstd * nw[None, :]).to(h_ptr.dtype.element_ty)
            if SS_PARTS > 0:
                nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                ht = (ht.to(tl.float32) * rstd_rows[:, None] * nw[None, :]).to(h_ptr.dtype.element_ty)
                if tl.program_id(0) == 0:  # normed_out is contiguous: rows H apart
                    tl.store(normed_ptr + m[:, None] * H + k[None, :], ht,
                             mask=(m < num_tokens)[:, None] & k_ok[None, :])
            wt = tl.load(w_ptr + e[None, :] * stride_w + k[:, None], mask=k_ok[:, None] & (e < E)[None, :],
                         other=0.0)
            acc = tl.dot(ht, wt, acc, input_precision=PRECISION)
        out = part_ptr + (split * BM + m[:, None]) * E + e[None, :]
        tl.store(out, acc, mask=(m < num_tokens)[:, None] & (e < E)[None, :])
        if ROUTE:  # the last program to finish adds the slices in order and routes every token (no second launch)
            # acq_rel: this program's partials are visible before the count; the last one sees all of them
            arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
            if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
                cols = tl.arange(0, EP)
                col_ok = cols < E
                tok_ok = m < num_tokens
                logits = tl.zeros([BM, EP], tl.float32)
                for part in tl.static_range(PARTS):
                    logits += tl.load(part_ptr + (part * BM + m)[:, None] * E + cols[None, :],
                                      mask=tok_ok[:, None] & col_ok[None, :], other=0.0, cache_modifier=".cg")
                logits = logits.to(weights_ptr.dtype.element_ty).to(tl.float32)  # as F.linear rounds
                logits = tl.where(tok_ok[:, None] & col_ok[None, :], logits, float("-inf"))
                _route_tile(logits, m, tok_ok, cols, col_ok, weights_ptr, ids_ptr, RENORMALIZE, K, KP, EP, BM)
                tl.atomic_xchg(count_ptr, 0)  # ready for the next call (launches on a stream run in order)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, E, stride_l,
                      RENORMALIZE: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                      BT: tl.constexpr, PARTS: tl.constexpr, PART_ROWS: tl.constexpr):
        """PARTS == 0: logits_ptr holds the logits. PARTS > 0: it holds _router_partial_kernel's fp32 slices
        [PARTS, PART_ROWS, E], added here in slice order and rounded to weights' dtype, as F.linear rounds."""
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        tok_ok = tok < num_tokens
        cols = tl.arange(0, EP)
        col_ok = cols < E
        if PARTS == 0:
            logits = tl.load(logits_ptr + tok.to(tl.int64)[:, None] * stride_l + cols[None, :],
                             mask=tok_ok[:, None] & col_ok[None, :], other=float("-inf")).to(tl.float32)
        else:
            logits = tl.zeros([BT, EP], tl.float32)
            for part in tl.static_range(PARTS):
                logits += tl.load(logits_ptr + (part * PART_ROWS + tok)[:, None] * E + cols[None, :],
                                  mask=tok_ok[:, None] & col_ok[None, :], other=0.0)
            logits = logits.to(weights_ptr.dtype.element_ty).to(tl.float32)
            logits = tl.where(tok_ok[:, None] & col_ok[None, :], logits, float("-inf"))
        _route_tile(logits, tok, tok_ok, cols, col_ok, weights_ptr, ids_ptr, RENORMALIZE, K, KP, EP, BT)

    @triton.jit
    def _route_tile(logits, tok, tok_ok, cols, col_ok, weights_ptr, ids_ptr, RENORMALIZE: tl.constexpr,
                    K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, BT: tl.constexpr):
        """Route the BT tokens `tok` from their fp32 logits [BT, EP] (-inf past E): softmax, top-K, renormalise,
        store."""
        p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        p = tl.where(col_ok[None, :], p, 0.0)
        p = p / tl.sum(p, axis=1)[:, None]
        avail = tl.where(col_ok[None, :], p, -1.0)  # probabilities are >= 0; -1 marks padding and taken experts
        kcols = tl.arange(0, KP)
        vals = tl.zeros([BT, KP], tl.float32)
        idx = tl.zeros([BT, KP], tl.int32)
        for k in tl.static_range(K):
            best = tl.max(avail, axis=1)
            arg = tl.min(tl.where(avail == best[:, None], cols[None, :], EP), axis=1)  # lowest index among ties
            vals = tl.where(kcols[None, :] == k, best[:, None], vals)
            idx = tl.where(kcols[None, :] == k, arg[:, None], idx)
            avail = tl.where(cols[None, :] == arg[:, None], -1.0, avail)
        if RENORMALIZE:
            vals = vals / tl.sum(vals, axis=1)[:, None]
        out = tok.to(tl.int64)[:, None] * K + kcols[None, :]
        mask = tok_ok[:, None] & (kcols < K)[None, :]
        tl.store(weights_ptr + out, vals.to(weights_ptr.dtype.element_ty), mask=mask)
        tl.store(ids_ptr + out, idx.to(tl.int64), mask=mask)


def route_topk_torch(logits: torch.Tensor, top_k: int, renormalize: bool = True):
    """transformers' Qwen3 / Qwen3.5 TopKRouter after its linear layer."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool = True, use_triton: bool | None = None, *,
               block_t: int | None = None, num_warps: int | None = None):
    """Routing weights [M, K] (logits' dtype) and expert ids [M, K] (int64) from router logits [M, E].
    block_t / num_warps override the launch shape (bench/kernel_sweep.py)."""
    if logits.dim() != 2 or not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"expected logits [tokens, experts] and 0 < top_k <= experts, got {tuple(logits.shape)}, "
                         f"top_k={top_k}")
    if use_triton is None:
        use_triton = triton_usable(logits)
    if not use_triton:
        return route_topk_torch(logits, top_k, renormalize)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    padded = triton.next_power_of_2(num_experts)
    if block_t is None:
        # a decode step or a verify block (<= SMALL_BATCH tokens): a program per token, one warp, so the 2K + 2
        # reductions stay within a warp (shuffles, no shared memory); the same tile at T = 1 and T = 16, so a token
        # is routed to the same bits in both. Prefill: several tokens per program.
        block_t = 1 if num_tokens <= SMALL_BATCH else max(1, min(16, 4096 // padded))
    if num_warps is None:
        num_warps = 1 if block_t == 1 and padded <= 512 else 4
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, weights, ids, num_tokens, num_experts, logits.stride(0), RENORMALIZE=renormalize, K=top_k,
        KP=triton.next_power_of_2(top_k), EP=padded, BT=block_t, PARTS=0, PART_ROWS=1, num_warps=num_warps)
    return weights, ids


def route_topk_from_hidden(h: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool = True,
                           use_triton: bool | None = None, rms_norm: tuple[torch.Tensor, float] | None = None,
                           normed_out: torch.Tensor | None = None, one_launch: bool | None = None,
                           sumsq: torch.Tensor | None = None, block_k: int | None = None):
    """route_topk(F.linear(h, router), ...) for h [M, H] and router [E, H]: with Triton and M <= ROUTER_MAX_TOKENS,
    the matmul runs in a kernel of ours (fp32 partial sums over ROUTER_K_SPLIT slices, added in a fixed order) whose
    rounded logits the routing kernel takes directly; otherwise F.linear + route_topk.
    rms_norm=(weight, eps): h is not normed yet; route rms_norm_scaled(h, weight, eps) (for one token, inside the
    matmul kernel: no launch of its own), and write that normed h to normed_out [M, H] (required) for the experts.
    sumsq [P, 16] (with rms_norm; M <= 16): h's rows' sums of squares as wide_linear(..., sumsq=True) left them, added
    in order: the norm runs inside the matmul kernel for every M, rows normed as x * rsqrt(sum / H + eps) * weight.
    one_launch: route in the matmul's launch (default ROUTE_IN_MATMUL). block_k: the K step within a slice (default
    ROUTER_BLOCK_K; with sumsq, up to ROUTER_NORM_BLOCK_K, a slice's width; a power of two >= 16): a token's bits
    depend on it, never on the other tokens."""
    if h.dim() != 2 or router.dim() != 2 or h.shape[1] != router.shape[1]:
        raise ValueError(f"expected h [tokens, hidden] and router [experts, hidden], got {tuple(h.shape)} and "
                         f"{tuple(router.shape)}")
    if use_triton is None:
        use_triton = triton_usable(h)
    num_tokens, hidden = h.shape
    experts = router.shape[0]
    if rms_norm is not None and (normed_out is None or normed_out.shape != h.shape or not normed_out.is_contiguous()):
        raise ValueError("rms_norm needs normed_out, a contiguous tensor shaped like h, to receive the normed h")
    if sumsq is not None and (rms_norm is None or num_tokens > ROUTER_MAX_TOKENS or sumsq.dim() != 2
                              or sumsq.shape[1] != ROUTER_MAX_TOKENS or sumsq.dtype != torch.float32):
        raise ValueError(f"sumsq needs rms_norm and is fp32 [parts, {ROUTER_MAX_TOKENS}] for up to "
                         f"{ROUTER_MAX_TOKENS} tokens")
    from_parts = sumsq is not None and use_triton and 0 < top_k <= experts
    norm_inside = rms_norm is not None and use_triton and num_tokens == 1 and 0 < top_k <= experts and not from_parts
    if sumsq is not None and not from_parts:
        rstd = torch.rsqrt(sumsq[:, :num_tokens].sum(0) / hidden + rms_norm[1])[:, None]
        h = normed_out.copy_((h.float() * rstd * rms_norm[0].float()).to(h.dtype))
    elif rms_norm is not None and not norm_inside and not from_parts:
        h = normed_out.copy_(rms_norm_scaled(h, *rms_norm))
    if not use_triton or num_tokens > ROUTER_MAX_TOKENS or not 0 < top_k <= experts:
        return route_topk(torch.nn.functional.linear(h, router), top_k, renormalize, use_triton)
    h = h if h.stride(-1) == 1 else h.contiguous()
    router = router if router.stride(-1) == 1 else router.contiguous()
    normed = norm_inside or from_parts
    # with the norm from partial sums (the glue kernels' path), a slice in one step where the slice is wider than
    # ROUTER_BLOCK_K; the one-token norm (norm_inside: the one-token numerics, L_target's) keeps the step it was timed
    # with
    if block_k is None:
        slice_k = triton.next_power_of_2(triton.cdiv(hidden, ROUTER_K_SPLIT))
        block_k = max(ROUTER_BLOCK_K, min(ROUTER_NORM_BLOCK_K, slice_k)) if from_parts else ROUTER_BLOCK_K
    k_per_split = triton.cdiv(hidden, ROUTER_K_SPLIT * block_k) * block_k
    splits = triton.cdiv(hidden, k_per_split)
    parts = torch.empty(splits, ROUTER_MAX_TOKENS, experts, dtype=torch.float32, device=h.device)
    weights = torch.empty(num_tokens, top_k, dtype=h.dtype, device=h.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=h.device)
    padded = triton.next_power_of_2(experts)
    route = ROUTE_IN_MATMUL if one_launch is None else one_launch
    # one counter of the split-K kernels' workspace (each call leaves it at zero); without ROUTE the kernel never reads
    # its pointer argument
    count = split_workspace(h.device, 0, 0, 1)[2] if route else parts
    _router_partial_kernel[(triton.cdiv(experts, ROUTER_BLOCK_E), splits)](
        h, router, rms_norm[0] if normed else h, normed_out if normed else h, parts,
        sumsq if from_parts else parts, num_tokens, experts, hidden, k_per_split, h.stride(0), router.stride(0),
        rms_norm[1] if normed else 0.0, count, weights, ids, BM=ROUTER_MAX_TOKENS, BE=ROUTER_BLOCK_E, BK=block_k,
        PRECISION="ieee" if h.dtype == torch.float32 else "tf32", HAS_NORM=norm_inside,
        HP=triton.next_power_of_2(hidden), ROUTE=route, PARTS=splits, RENORMALIZE=renormalize, K=top_k,
        KP=triton.next_power_of_2(top_k), EP=padded, SS_PARTS=sumsq.shape[0] if from_parts else 0,
        SS_P=triton.next_power_of_2(sumsq.shape[0]) if from_parts else 1, num_warps=4, num_stages=3)
    if route:
        return weights, ids
    _route_kernel[(num_tokens,)](
        parts, weights, ids, num_tokens, experts, experts, RENORMALIZE=renormalize, K=top_k,
        KP=triton.next_power_of_2(top_k), EP=padded, BT=1, PARTS=splits, PART_ROWS=ROUTER_MAX_TOKENS,
        num_warps=1 if padded <= 512 else 4)
    return weights, ids
