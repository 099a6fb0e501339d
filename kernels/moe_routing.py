"""Qwen-style MoE routing in one launch: softmax over the experts (fp32), top-k, optional renormalisation.

transformers' routers do this in ~6 small PyTorch kernels, which at decode cost as much as the experts
themselves (H200, 1 token: ~25 us router vs ~26 us experts per layer in CUDA graphs). Same math and order:
probabilities = softmax(logits in fp32); top-k by probability, largest first; weights / their sum if
renormalising; weights cast to the logits' dtype. Ties pick the lowest expert index.
"""

from __future__ import annotations

import torch

from kernels.fused_moe import triton, triton_usable

SMALL_BATCH = 64  # up to this many tokens, one token per program

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_tokens"])
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, E, stride_l,
                      RENORMALIZE: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                      BT: tl.constexpr):
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        tok_ok = tok < num_tokens
        cols = tl.arange(0, EP)
        col_ok = cols < E
        logits = tl.load(logits_ptr + tok.to(tl.int64)[:, None] * stride_l + cols[None, :],
                         mask=tok_ok[:, None] & col_ok[None, :], other=float("-inf")).to(tl.float32)
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
        KP=triton.next_power_of_2(top_k), EP=padded, BT=block_t, num_warps=num_warps)
    return weights, ids
