"""A gated-attention layer's input glue for a decode step or verify block (Qwen3.5/3.6), in one launch:

    a = attention_prep(proj, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, heads=H, kv_heads=Hkv, eps=eps)
    a.q [H, T, D]      per-head RMSNorm (weight q_norm), then RoPE on the first rotary columns at each row's position
    a.k [Hkv, T, D]    the same with k_norm; also written to k_cache[:, positions]
    a.v [Hkv, T, D]    a view of proj; also written to v_cache[:, positions]
    a.gate [T, H, D]   a view of proj: the output gate, which block_attention(..., gate=a.gate) applies

proj [R, (2H + 2Hkv) D] is the fused projection (per query head [query | gate], then the keys, then the values), of
which the first T = positions.numel() rows are the block's (R >= T: the padded rows of backend/models/qwen3_5_moe.py
_padded_rows). cos / sin are the whole [max_positions, rotary] tables; the kernel reads row positions[t] itself.

Why: in the invariant steps the compiled glue spent seven launches a layer on this (the split into heads, two norms,
RoPE, the gate's copy; ~9.5 us an attention layer in a decode step at the 35B-A3B shape, bench/results/
step_budget_*_20261204.json), plus two gathers a step for the cos / sin rows and, in a verify, block_attention's
launch that writes the block's keys and values to the cache. Here one program per (token, head) does all of it.

Rounding (the twin, attention_prep_torch, is the reference): the norm as transformers' Qwen3_5MoeRMSNorm (fp32,
times the fp32 (1 + w) weight, cast once), RoPE in fp32 from the rounded normed row, cast once (what the compiled
glue computed: it fuses the rotation's products without rounding between them). A row's bits depend only on its own
inputs and position: a decode step and every verify size compute a position the same way.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from reviewer_kernels.fused_moe import dot_size, triton, triton_usable


class AttentionInputs(NamedTuple):
    q: torch.Tensor  # [H, T, D]
    k: torch.Tensor  # [Hkv, T, D]
    v: torch.Tensor  # [Hkv, T, D] (a view of proj)
    gate: torch.Tensor  # [T, H, D] (a view of proj)


if triton is not None:
    import triton.language as tl

    # T never specialised: a decode step and every verify size run one binary
    @triton.jit(do_not_specialize=["T"])
    def _attention_prep_kernel(proj_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, kc_ptr, vc_ptr,
                               T, eps, stride_p, stride_cs, skc_h, skc_n, svc_h, svc_n,
                               H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr):
        """Grid (T, H + 2 Hkv): program (t, j) takes query head j < H, key head j - H, or value head j - H - Hkv of
        token t."""
        t = tl.program_id(0)
        j = tl.program_id(1)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        d = tl.arange(0, D)
        # per query head [query | gate]; the key heads and then the value heads after all of them
        src = proj_ptr + t.to(tl.int64) * stride_p + tl.where(j < H, j * 2 * D, 2 * H * D + (j - H) * D)
        if j >= H + HKV:  # a value head: into the cache as it is
            tl.store(vc_ptr + (j - H - HKV) * svc_h + pos * svc_n + d, tl.load(src + d))
        else:
            # RoPE pairs column c < ROT with c +- ROT / 2 (rotate_half); the partner's raw value is loaded and normed
            # like the row, which is what normalising first and then gathering would give
            half = ROT // 2
            partner = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
            x = tl.load(src + d).to(tl.float32)
            xp = tl.load(src + partner).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            is_q = j < H
            if is_q:
                w = tl.load(qn_ptr + d)
                wp = tl.load(qn_ptr + partner)
            else:
                w = tl.load(kn_ptr + d)
                wp = tl.load(kn_ptr + partner)
            dt = q_ptr.dtype.element_ty
            n = (x * rstd * w.to(tl.float32)).to(dt).to(tl.float32)
            n_partner = (xp * rstd * wp.to(tl.float32)).to(dt).to(tl.float32)
            rot = d < ROT
            c = tl.load(cos_ptr + pos * stride_cs + d, mask=rot, other=1.0).to(tl.float32)
            s = tl.load(sin_ptr + pos * stride_cs + d, mask=rot, other=0.0).to(tl.float32)
            turned = tl.where(d < half, -n_partner, n_partner)
            out = tl.where(rot, n * c + turned * s, n).to(dt)
            if is_q:
                tl.store(q_ptr + (j * T + t) * D + d, out)
            else:
                tl.store(k_ptr + ((j - H) * T + t) * D + d, out)
                tl.store(kc_ptr + (j - H) * skc_h + pos * skc_n + d, out)


def _views(proj, T: int, heads: int, kv_heads: int, head_dim: int):
    """The gate [T, H, D] and the values [Hkv, T, D] as views of proj's first T rows."""
    D = head_dim
    rows = proj[:T]
    gate = rows[:, :2 * heads * D].unflatten(1, (heads, 2 * D))[:, :, D:]
    v = rows[:, (2 * heads + kv_heads) * D:].unflatten(1, (kv_heads, D)).transpose(0, 1)
    return gate, v


def attention_prep_torch(proj, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, *, heads: int, kv_heads: int,
                         eps: float) -> AttentionInputs:
    """The same in PyTorch (the kernel's rounding points; index_copy_ into the caches)."""
    T, D = positions.numel(), k_cache.shape[-1]
    rows = proj[:T]
    q = rows[:, :2 * heads * D].unflatten(1, (heads, 2 * D))[:, :, :D]
    k = rows[:, 2 * heads * D:(2 * heads + kv_heads) * D].unflatten(1, (kv_heads, D))
    pos = positions.reshape(-1).long()
    c, s = cos[pos].float()[:, None], sin[pos].float()[:, None]  # [T, 1, ROT]

    def norm_rope(x, w):
        xf = x.float()
        n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype).float()
        rot = c.shape[-1]
        nr = n[..., :rot]
        turned = torch.cat((-nr[..., rot // 2:], nr[..., :rot // 2]), dim=-1)
        return torch.cat((nr * c + turned * s, n[..., rot:]), dim=-1).to(x.dtype).transpose(0, 1).contiguous()

    gate, v = _views(proj, T, heads, kv_heads, D)
    q, k = norm_rope(q, q_norm), norm_rope(k, k_norm)
    k_cache.index_copy_(1, pos, k)
    v_cache.index_copy_(1, pos, v)
    return AttentionInputs(q, k, v, gate)


def _check(proj, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, heads: int, kv_heads: int):
    kv, _, D = k_cache.shape
    T = positions.numel()
    if proj.dim() != 2 or proj.shape[1] != (2 * heads + 2 * kv_heads) * D or not 1 <= T <= proj.shape[0]:
        raise ValueError(f"proj must be [rows >= {T}, {(2 * heads + 2 * kv_heads) * D}] for {heads} query heads and "
                         f"{kv_heads} key heads of {D}, got {tuple(proj.shape)}")
    if kv != kv_heads or v_cache.shape != k_cache.shape or heads % kv_heads:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not hold {kv_heads} key heads")
    if q_norm.shape != (D,) or k_norm.shape != (D,):
        raise ValueError(f"q_norm and k_norm must be [{D}], got {tuple(q_norm.shape)} and {tuple(k_norm.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] > D or cos.shape[1] % 2:
        raise ValueError(f"cos and sin must be [positions, even rotary dims <= {D}], got {tuple(cos.shape)}")


def attention_prep(proj, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, *, heads: int, kv_heads: int,
                   eps: float, use_triton: bool | None = None) -> AttentionInputs:
    """See the module docstring. positions: a device tensor of the block's T positions (consecutive or not)."""
    _check(proj, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, heads, kv_heads)
    if use_triton is None:
        use_triton = triton_usable(proj)
    D = k_cache.shape[-1]
    if not use_triton or not dot_size(D):
        return attention_prep_torch(proj, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, heads=heads,
                                    kv_heads=kv_heads, eps=eps)
    for name, x in (("proj", proj), ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    if cos.stride(0) != sin.stride(0):
        raise ValueError("cos and sin must share a layout")
    T = positions.numel()
    q = proj.new_empty(heads, T, D)
    k = proj.new_empty(kv_heads, T, D)
    _attention_prep_kernel[(T, heads + 2 * kv_heads)](
        proj, q_norm, k_norm, cos, sin, positions, q, k, k_cache, v_cache, T, eps, proj.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        H=heads, HKV=kv_heads, D=D, ROT=cos.shape[1], num_warps=1 if D <= 128 else 2)
    gate, v = _views(proj, T, heads, kv_heads, D)
    return AttentionInputs(q, k, v, gate)
