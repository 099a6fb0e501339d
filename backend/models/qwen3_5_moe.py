"""Qwen3.5 / Qwen3.6 MoE text model (e.g. Qwen3.6-35B-A3B) for the fast path: the architecture and nothing else.

Layout (config.layer_types): mostly Gated DeltaNet layers with a gated-attention layer every 4th, each followed by a
sparse MoE block. Same math and rounding points as transformers' Qwen3_5MoeForCausalLM (modeling_qwen3_5_moe.py):
  RMSNorm        x * rsqrt(mean x^2 + eps) in fp32, times (1 + weight), cast back  (zero-centred weights)
  attention      q_proj gives a query and an output gate per head; per-head RMSNorm on q and k; RoPE on the first
                 partial_rotary_factor of each head; out = o_proj(attn * sigmoid(gate))
  Gated DeltaNet in_proj -> causal depthwise conv (kernel 4) + SiLU over [q; k; v]; beta = sigmoid(b);
                 g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule (reviewer_kernels/gdn_state.py); output
                 RMSNorm(x) * weight * SiLU(z); out_proj
  MoE            router matmul, softmax, top-k renormalised (reviewer_kernels.route_topk_from_hidden); experts and the
                 sigmoid-gated shared expert in one fused call (reviewer_kernels.fused_moe)
A decode step (one token) on Triton: each mixer's output gate or gated norm and the residual add run inside its
output projection (reviewer_kernels/gemv.py); the MoE's RMSNorm runs inside the router matmul kernel (which also stores
the normed row for the experts), and the experts take fused_moe's two-launch one-token path
(reviewer_kernels/moe_decode.py). A prefill piece of >= CHUNKED_FROM tokens on Triton takes each layer's `piece()`:
the same math with its norms, convolution and chunked recurrence as a few kernels (docs/kernels.md "Prefill pieces").
Caches: a static KVCache for the attention layers and a LinearStateCache (conv window,
fp32 recurrent state, and the block's recurrence inputs recorded during a verify, replayed on accept) for the Gated
DeltaNet layers.

    model = Qwen35Moe.from_hf(hf_model)          # Qwen3_5MoeForCausalLM or ...ForConditionalGeneration (text only)
    model.setup_caches(max_context=8192, max_block=16)
    logits, features = model(tokens, positions, kv_len, record=True, all_logits=True, hidden_ids=(1, 10))
    model.linear.accept(n)                       # after a recorded forward: keep the first n block tokens
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backend.models.llama import _param, apply_rope, cached_attention, causal_mask, glue, residual_add, rope_tables
from backend.models.numerics import QWEN_EXPERTS, Numerics
from backend.models.static_cache import KVCache, LinearStateCache
from reviewer_kernels import SharedExpert, fused_moe, norms, route_topk_from_hidden, triton_usable
from reviewer_kernels.attention_prep import attention_prep
from reviewer_kernels.block_attention import block_attention
from reviewer_kernels.fused_moe import invariant_config, shape_key
from reviewer_kernels.gdn_conv import causal_conv, gdn_conv, gdn_conv_prefill
from reviewer_kernels.gdn_state import gdn_chunked, gdn_gates, gdn_recurrent, gdn_verify
from reviewer_kernels.gemv import gemv
from reviewer_kernels.norms import gated_rms_norm_torch as gated_rms_norm
from reviewer_kernels.norms import rms_norm_torch as qwen_rms_norm
from reviewer_kernels.wide_linear import wide_linear

MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
CHUNKED_FROM = 64  # prefill pieces this long or longer run the chunked recurrence; shorter ones the token loop
PADDED_ROWS = 16  # QwenNumerics.padded_rows: the rows every glue call of a decode step or verify block sees


@dataclass
class Qwen35MoeConfig:
    vocab_size: int
    hidden_size: int
    layer_types: list[str]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    rms_norm_eps: float
    tie_embeddings: bool

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_hf(cls, c) -> Qwen35MoeConfig:
        c = c.get_text_config() if hasattr(c, "get_text_config") else c
        return cls(vocab_size=c.vocab_size, hidden_size=c.hidden_size, layer_types=list(c.layer_types),
                   num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                   linear_num_key_heads=c.linear_num_key_heads, linear_num_value_heads=c.linear_num_value_heads,
                   linear_key_head_dim=c.linear_key_head_dim, linear_value_head_dim=c.linear_value_head_dim,
                   conv_kernel=c.linear_conv_kernel_dim, num_experts=c.num_experts, top_k=c.num_experts_per_tok,
                   moe_intermediate_size=c.moe_intermediate_size,
                   shared_intermediate_size=c.shared_expert_intermediate_size, rms_norm_eps=c.rms_norm_eps,
                   tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)))


# ---- per-layer glue: plain tensor functions (no modules, no cache writes), compiled once for all layers (glue()) ----

def attention_in(x, norm, wqkv, q_norm, k_norm, cos, sin, eps: float, heads: int, kv_heads: int, head_dim: int):
    """Pre-norm, fused projection (per head: [query | output gate], then k, v), q/k norms, partial RoPE.
    Returns q [H, T, D], k and v [Hkv, T, D], gate [T, H * D]."""
    return attention_heads(F.linear(qwen_rms_norm(x, norm, eps), wqkv), q_norm, k_norm, cos, sin, eps, heads,
                           kv_heads, head_dim)


def attention_heads(proj, q_norm, k_norm, cos, sin, eps: float, heads: int, kv_heads: int, head_dim: int):
    """attention_in after its projection: the split into heads, q/k norms, partial RoPE."""
    T, D = proj.shape[0], head_dim
    qg, k, v = proj.split([2 * heads * D, kv_heads * D, kv_heads * D], -1)
    q, gate = qg.view(T, heads, 2 * D).chunk(2, dim=-1)
    q = apply_rope(qwen_rms_norm(q, q_norm, eps).transpose(0, 1), cos, sin)
    k = apply_rope(qwen_rms_norm(k.view(T, kv_heads, D), k_norm, eps).transpose(0, 1), cos, sin)
    return q, k, v.view(T, kv_heads, D).transpose(0, 1), gate.reshape(T, -1)


def attention_out(attn, gate, wo):
    """The gated output projection. The residual add happens in moe_in, inside its norm: a cuBLAS beta-add here
    costs a copy of x before the matmul (one launch per layer)."""
    return F.linear(attention_gate(attn, gate), wo)


def attention_gate(attn, gate):
    """attention_out before its projection."""
    return attn * torch.sigmoid(gate)


def deltanet_in(x, norm, w_in, conv_state, conv_w, eps: float, key_heads: int, value_heads: int, key_dim: int,
                value_dim: int):
    """Pre-norm, fused input projection [qkv | z | b | a], causal depthwise conv over [last K-1 inputs ; block]
    (transformers' causal_conv1d_update) + SiLU. Returns the conv window [K-1+T, C] (the caller stores what the
    cache keeps), q, k [T, Hk, Dk], v, z [T, Hv, Dv], and the gate projections a, b [T, Hv] (reviewer_kernels/gdn_state
    turns them into g and beta: gdn_gates)."""
    return deltanet_conv(F.linear(qwen_rms_norm(x, norm, eps), w_in), conv_state, conv_w, key_heads, value_heads,
                         key_dim, value_dim)


def deltanet_conv(proj, conv_state, conv_w, key_heads: int, value_heads: int, key_dim: int, value_dim: int):
    """deltanet_in after its projection: the split, the causal depthwise conv and SiLU."""
    T = proj.shape[0]
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    mixed, z, b, a = proj.split([conv_dim, value_heads * value_dim, value_heads, value_heads], dim=-1)
    window = torch.cat([conv_state, mixed], dim=0)
    # K shifted multiply-adds, which torch.compile fuses with the cat and SiLU (F.conv1d stays a separate cuDNN launch)
    conv = causal_conv(window, conv_w, T)
    q, k, v = F.silu(conv).split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], -1)
    return (window, q.reshape(T, key_heads, key_dim), k.reshape(T, key_heads, key_dim),
            v.reshape(T, value_heads, value_dim), z.reshape(T, value_heads, value_dim), a, b)


def deltanet_out(core, z, norm, w_out, eps: float):
    """Gated RMSNorm of the recurrence output (per value head) and the output projection (the residual add happens
    in moe_in, as for attention_out)."""
    return F.linear(deltanet_gate(core, z, norm, eps), w_out)


def deltanet_gate(core, z, norm, eps: float):
    """deltanet_out before its projection: the gated RMSNorm per value head, [T, Hv * Dv]."""
    dv = core.shape[-1]
    return gated_rms_norm(core.reshape(-1, dv), z.reshape(-1, dv), norm, eps).reshape(core.shape[0], -1)


def moe_in(x, y, norm, eps: float):
    """The mixer's residual add (x + its output y) and the post-attention norm. Returns the new residual stream and
    the normed input of the MoE (the router matmul runs in reviewer_kernels.route_topk_from_hidden)."""
    x = residual_add(x, y)
    return x, qwen_rms_norm(x, norm, eps)


class GatedAttention(nn.Module):
    def __init__(self, c: Qwen35MoeConfig, slot: int):
        super().__init__()
        self.slot = slot  # index among the attention layers (its KVCache row)
        e = lambda *s: nn.Parameter(torch.empty(*s), requires_grad=False)  # noqa: E731
        self.wqkv = e((2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size)
        self.q_norm, self.k_norm = e(c.head_dim), e(c.head_dim)  # 1 + weight, fp32
        self.wo = e(c.hidden_size, c.num_heads * c.head_dim)

    def forward(self, model, x, norm, positions, kv_len, cos, sin, mask, record, compiled):
        c = model.config
        q, k, v, gate = glue(attention_in, compiled)(x, norm, self.wqkv, self.q_norm, self.k_norm, cos, sin,
                                                      c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim)
        attn = cached_attention(model.kv, self.slot, q, k, v, positions, kv_len, mask)
        if attn.shape[0] == 1 and triton_usable(attn):
            # a decode step: gate, projection and residual in one launch
            return gemv(attn, self.wo, gate, residual=x), None
        return x, glue(attention_out, compiled)(attn, gate, self.wo)

    def piece(self, model, x, norm, positions, kv_len, cos, sin, mask):
        """A prefill piece on Triton (Qwen35Moe.forward): forward's math, the pre-norm in one launch."""
        c = model.config
        proj = F.linear(norms.rms_norm(x, norm, c.rms_norm_eps), self.wqkv)
        q, k, v, gate = attention_heads(proj, self.q_norm, self.k_norm, cos, sin, c.rms_norm_eps, c.num_heads,
                                        c.num_kv_heads, c.head_dim)
        return x, attention_out(cached_attention(model.kv, self.slot, q, k, v, positions, kv_len, mask), gate, self.wo)

    def padded(self, model, x, normed, positions, kv_len, T: int, compiled, rope):
        """padded_rows: x (the residual stream) and normed (its pre-norm) have PADDED_ROWS rows, of which the first T
        are the block's (positions [T]); returns model.padded_out's (y, sums of squares) for all of them (rows past T
        are never read). QwenNumerics.glue_kernels: after the projection one launch splits the heads, norms q and k,
        rotates them at their positions and writes the block's keys and values to the cache
        (reviewer_kernels/attention_prep.py), and the attention's combine kernel applies the output gate; else the
        compiled glue does, with rope = (cos, sin) of the padded rows' positions."""
        c, eps = model.config, model.config.rms_norm_eps
        kc, vc = model.kv.k[self.slot], model.kv.v[self.slot]
        proj = model.padded_linear(normed, self.wqkv, "in")
        attn = normed.new_empty(normed.shape[0], c.num_heads * c.head_dim)
        if model.numerics.qwen.glue_kernels:
            a = attention_prep(proj, self.q_norm, self.k_norm, model.cos, model.sin, positions, kc, vc,
                               heads=c.num_heads, kv_heads=c.num_kv_heads, eps=eps, use_triton=True)
            block_attention(a.q, a.k, a.v, kc, vc, positions[:1], kv_len, use_triton=True, out=attn[:T],
                            gate=a.gate, cached=True)
            return model.padded_out(attn, self.wo, x)
        q, k, v, gate = glue(attention_heads, compiled)(proj, self.q_norm, self.k_norm, *rope, eps, c.num_heads,
                                                         c.num_kv_heads, c.head_dim)
        block_attention(q[:, :T], k[:, :T], v[:, :T], kc, vc, positions[:1], kv_len, use_triton=True, out=attn[:T])
        return model.padded_out(glue(attention_gate, compiled)(attn, gate), self.wo, x)


class GatedDeltaNet(nn.Module):
    def __init__(self, c: Qwen35MoeConfig, slot: int):
        super().__init__()
        self.slot = slot  # index among the linear-attention layers (its LinearStateCache row)
        e = lambda *s: nn.Parameter(torch.empty(*s), requires_grad=False)  # noqa: E731
        hv = c.linear_num_value_heads
        self.w_in = e(c.conv_dim + c.value_dim + 2 * hv, c.hidden_size)  # [qkv | z | b | a]
        self.conv_w = e(c.conv_dim, c.conv_kernel)
        self.dt_bias = e(hv)
        self.neg_A = e(hv)  # -exp(A_log), fp32
        self.norm = e(c.linear_value_head_dim)
        self.w_out = e(c.hidden_size, c.value_dim)

    def forward(self, model, x, norm, positions, kv_len, cos, sin, mask, record, compiled):
        c, cache, i = model.config, model.linear, self.slot
        T = x.shape[0]
        window, q, k, v, z, a, b = glue(deltanet_in, compiled)(
            x, norm, self.w_in, cache.conv[i], self.conv_w, c.rms_norm_eps, c.linear_num_key_heads,
            c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        gates = (self.neg_A, self.dt_bias)
        if record:  # a verify: keep the whole window and the block's inputs; accept() replays the kept ones
            cache.conv_window[i, :window.shape[0]].copy_(window)
            core = gdn_verify(q, k, v, a, b, cache.state[i], cache.record.layer(i), gates=gates)
        else:
            cache.conv[i].copy_(window[-cache.width:])
            if T < CHUNKED_FROM:
                core = gdn_recurrent(q, k, v, a, b, cache.state[i], cache.state[i], every_position=False, gates=gates)
            else:
                core = gdn_chunked(q, k, v, *gdn_gates(a, b, *gates), cache.state[i])
        if T == 1 and triton_usable(core):
            # a decode step: gated norm, projection and residual in one launch
            return gemv(core.reshape(1, -1), self.w_out, z.reshape(1, -1), self.norm, c.rms_norm_eps, residual=x), None
        return x, glue(deltanet_out, compiled)(core, z, self.norm, self.w_out, c.rms_norm_eps)

    def piece(self, model, x, norm, positions, kv_len, cos, sin, mask):
        """A prefill piece on Triton (Qwen35Moe.forward; T >= CHUNKED_FROM): forward's math in about a dozen launches
        where the eager glue took ~100 (the norms, the convolution with its cache update, the recurrence's chunk
        terms, solve and walk, the gated norm: reviewer_kernels/norms.py, gdn_conv.gdn_conv_prefill,
        gdn_state.gdn_chunked)."""
        c, cache, i = model.config, model.linear, self.slot
        T, hv, hk = x.shape[0], c.linear_num_value_heads, c.linear_num_key_heads
        proj = F.linear(norms.rms_norm(x, norm, c.rms_norm_eps), self.w_in)
        mixed, z, b, a = proj.split([c.conv_dim, c.value_dim, hv, hv], dim=-1)
        q, k, v = gdn_conv_prefill(mixed, cache.conv[i], self.conv_w).split([c.key_dim, c.key_dim, c.value_dim], -1)
        core = gdn_chunked(q.view(T, hk, c.linear_key_head_dim), k.view(T, hk, c.linear_key_head_dim),
                           v.view(T, hv, c.linear_value_head_dim), *gdn_gates(a, b, self.neg_A, self.dt_bias),
                           cache.state[i])
        gated = norms.gated_rms_norm(core, z.view(T, hv, c.linear_value_head_dim), self.norm, c.rms_norm_eps)
        return x, F.linear(gated, self.w_out)

    def padded(self, model, x, normed, positions, kv_len, T: int, compiled, record: bool):
        """padded_rows: as GatedAttention.padded. The convolution runs over all padded rows (it is causal: the
        first T see only real inputs); the caches keep what the first T rows leave."""
        c, cache, i = model.config, model.linear, self.slot
        hv, hk = c.linear_num_value_heads, c.linear_num_key_heads
        proj = model.padded_linear(normed, self.w_in, "in")
        mixed, z, b, a = proj.split([c.conv_dim, c.value_dim, hv, hv], dim=-1)
        # the convolution and its cache update in one launch: a verify keeps the whole window for accept(), a decode
        # step moves the conv state on
        qkv = gdn_conv(mixed, cache.conv[i], self.conv_w, T, window_out=cache.conv_window[i] if record else None)
        R = qkv.shape[0]
        q, k, v = qkv.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q, k = q.view(R, hk, c.linear_key_head_dim), k.view(R, hk, c.linear_key_head_dim)
        v, z = v.view(R, hv, c.linear_value_head_dim), z.reshape(R, hv, c.linear_value_head_dim)
        core = v.new_empty(v.shape)
        gates = (self.neg_A, self.dt_bias)
        if record:
            gdn_verify(q[:T], k[:T], v[:T], a[:T], b[:T], cache.state[i], cache.record.layer(i), gates=gates,
                       out=core[:T])
        else:
            gdn_recurrent(q[:T], k[:T], v[:T], a[:T], b[:T], cache.state[i], cache.state[i], every_position=False,
                          gates=gates, out=core[:T])
        if model.numerics.qwen.glue_kernels:  # the gated norm in norms.py's kernel (the compiled glue: ~5 us)
            gated = norms.gated_rms_norm(core, z, self.norm, c.rms_norm_eps, use_triton=True,
                                         **norms.PADDED_GATED_NORM)
        else:
            gated = glue(deltanet_gate, compiled)(core, z, self.norm, c.rms_norm_eps)
        return model.padded_out(gated, self.w_out, x)


class SparseMoE(nn.Module):
    def __init__(self, c: Qwen35MoeConfig):
        super().__init__()
        e = lambda *s: nn.Parameter(torch.empty(*s), requires_grad=False)  # noqa: E731
        self.top_k = c.top_k
        self.router = e(c.num_experts, c.hidden_size)
        self.gate_up = e(c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size)
        self.down = e(c.num_experts, c.hidden_size, c.moe_intermediate_size)
        si = c.shared_intermediate_size
        self.shared_gate_proj, self.shared_up_proj = e(si, c.hidden_size), e(si, c.hidden_size)
        self.shared_down_proj, self.shared_gate = e(c.hidden_size, si), e(1, c.hidden_size)

    def shared(self) -> SharedExpert:
        return SharedExpert(self.shared_gate_proj, self.shared_up_proj, self.shared_down_proj, self.shared_gate)

    def route(self, h: torch.Tensor, rms_norm=None, normed_out=None, sumsq=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and expert ids [T, top_k] for the normed hidden states h [T, H] (or for h not normed yet,
        rms_norm=(weight, eps), the normed h written to normed_out; sumsq: its rows' sums of squares as partials):
        router matmul, softmax, top-k. (A benchmark may replace this on an instance to replay a routing trace, and
        count experts; nothing else does.)"""
        return route_topk_from_hidden(h, self.router, self.top_k, True, rms_norm=rms_norm, normed_out=normed_out,
                                      sumsq=sumsq)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None, norm: torch.Tensor, eps: float,
                compiled: bool) -> torch.Tensor:
        """x + y + MoE(norm(x + y)), y the mixer's output: router, then all experts and the shared expert in one fused
        call. y None (a decode step on Triton): the mixer already added its output to x, and the norm runs inside
        the router matmul kernel, which reads x anyway and stores the normed row for the experts (no launch of its
        own; normed again in each of the ~4,600 gate_up programs it cost more than the launch it saved)."""
        shared = self.shared()
        if y is None:
            h = torch.empty_like(x)
            weights, ids = self.route(x, rms_norm=(norm, eps), normed_out=h)
            return fused_moe(h, self.gate_up, self.down, weights, ids, shared, residual=x)
        x, h = glue(moe_in, compiled)(x, y, norm, eps)
        weights, ids = self.route(h)
        return fused_moe(h, self.gate_up, self.down, weights, ids, shared, residual=x)

    def piece(self, x, y, norm, eps: float) -> torch.Tensor:
        """A prefill piece on Triton: forward's math, the residual add and norm in one launch."""
        shared = self.shared()
        x, h = norms.add_rms_norm(x, y, norm, eps)
        weights, ids = self.route(h)
        return fused_moe(h, self.gate_up, self.down, weights, ids, shared, residual=x)

    def padded(self, x, y, norm, eps: float, T: int, compiled, fixed_config: dict,
               next_norm: torch.Tensor | None = None, sumsq: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """padded_rows: x + y + MoE(norm(x + y)) over PADDED_ROWS rows, the experts for the first T only (the
        rest of the result is left unwritten: never read); and with next_norm (the next layer's pre-norm weight, or
        the final norm's) that result normed, computed by the kernel that sums the experts' slots (a launch fewer a
        layer), else None. sumsq (Qwen35Moe.padded_out's): y is x + y already, and the router kernel norms it from
        these sums of squares (no launch for the add and the norm)."""
        shared = self.shared()
        if sumsq is not None:
            x, h = y, torch.empty_like(y)
            weights, ids = self.route(x[:T], rms_norm=(norm, eps), normed_out=h[:T], sumsq=sumsq)
        else:
            x, h = glue(moe_in, compiled)(x, y, norm, eps)
            weights, ids = self.route(h[:T])
        out = torch.empty_like(x)
        normed = torch.empty_like(x) if next_norm is not None else None
        # the one-token programs (QwenNumerics.experts gemv*) have no slot sum to hold the next norm: one launch here
        norm_after = normed is not None and fixed_config is not None and "gemv_tokens" in fixed_config
        fused_moe(h[:T], self.gate_up, self.down, weights, ids, shared, residual=x[:T], config=fixed_config,
                  out=out[:T], norm=(next_norm, eps, normed[:T]) if normed is not None and not norm_after else None)
        if norm_after:
            norms.rms_norm(out[:T], next_norm, eps, out=normed[:T])
        return out, normed


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen35MoeConfig, mixer: nn.Module):
        super().__init__()
        self.norm1 = nn.Parameter(torch.empty(c.hidden_size), requires_grad=False)  # 1 + weight, fp32
        self.norm2 = nn.Parameter(torch.empty(c.hidden_size), requires_grad=False)
        self.mixer = mixer
        self.moe = SparseMoE(c)


class Qwen35Moe(nn.Module):
    """Decode steps and verify blocks run as the Numerics record handed to setup_caches says (its QwenNumerics:
    through _padded_rows or the one-token kernels, which padded projections take reviewer_kernels/wide_linear.py;
    backend/models/numerics.py)."""

    family = "qwen3_5_moe"

    def __init__(self, config: Qwen35MoeConfig, inv_freq: torch.Tensor):
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList()
        n_attn = n_lin = 0
        for kind in config.layer_types:
            if kind == "full_attention":
                mixer, n_attn = GatedAttention(config, n_attn), n_attn + 1
            else:
                mixer, n_lin = GatedDeltaNet(config, n_lin), n_lin + 1
            self.layers.append(DecoderLayer(config, mixer))
        self.num_attention_layers, self.num_linear_layers = n_attn, n_lin
        self.norm = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.lm_head = self.embed if config.tie_embeddings else nn.Parameter(torch.empty_like(self.embed),
                                                                             requires_grad=False)
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)
        self.kv: KVCache | None = None
        self.linear: LinearStateCache | None = None
        self.numerics = Numerics()  # setup_caches takes the record to run

    def setup_caches(self, max_context: int, max_block: int, numerics: Numerics | None = None) -> None:
        """Allocate the caches and take `numerics` (default: Numerics(), the one-token kernels)."""
        c, w = self.config, self.embed
        self.numerics = numerics or Numerics()
        self.kv = KVCache(self.num_attention_layers, c.num_kv_heads, c.head_dim, max_context, w.device, w.dtype)
        self.linear = LinearStateCache(self.num_linear_layers, c.conv_dim, c.conv_kernel, c.linear_num_value_heads,
                                       c.linear_key_head_dim, c.linear_value_head_dim, max_block, w.device, w.dtype,
                                       key_heads=c.linear_num_key_heads)
        self.cos, self.sin = rope_tables(self.inv_freq, 1.0, max_context, w.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int, *, record: bool = False,
                all_logits: bool = False, hidden_ids: tuple[int, ...] = (), compiled: bool = False,
                lower_right: bool = False):
        """tokens, positions [T] (device tensors). Attention layers write K/V at `positions` and attend over cache
        columns < kv_len. Gated DeltaNet layers advance their live state (record=False), or leave it and write the
        block's conv window and per-position states (record=True: a verify; LinearStateCache.accept picks one).
        Returns (logits [T or 1, V], features [T, len(hidden_ids) * H] or None) as in backend/models/llama.py.
        compiled: run the per-layer glue through torch.compile (llama.glue). lower_right: positions end at kv_len - 1
        (llama.causal_mask)."""
        c = self.config
        T = tokens.numel()
        if self.numerics.qwen.padded_rows and T <= PADDED_ROWS and triton_usable(self.embed) and (
                not self.num_attention_layers or self.kv.block_kernel(T)):
            return self._padded_rows(tokens, positions, kv_len, record, all_logits, hidden_ids, compiled)
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[positions], self.sin[positions]
        mask = None  # none needed without attention layers, or with reviewer_kernels/block_attention (see KVCache)
        if self.num_attention_layers and not self.kv.block_kernel(tokens.numel()):
            mask = causal_mask(positions, kv_len, lower_right)
        feats = {}
        last = c.num_layers - 1
        # a prefill piece on Triton: each layer's glue as a few kernels (eagerly, the glue was ~130 launches a layer)
        piece = not record and T >= CHUNKED_FROM and triton_usable(x)
        for i, layer in enumerate(self.layers):
            # (x, y): the mixer's output y is added inside the MoE's norm; (x + y, None) when the mixer added it
            if piece:
                x, y = layer.mixer.piece(self, x, layer.norm1, positions, kv_len, cos, sin, mask)
                x = layer.moe.piece(x, y, layer.norm2, c.rms_norm_eps)
            else:
                x, y = layer.mixer(self, x, layer.norm1, positions, kv_len, cos, sin, mask, record, compiled)
                x = layer.moe(x, y, layer.norm2, c.rms_norm_eps, compiled)
            if i in hidden_ids and i != last:
                feats[i] = x
        x = (norms.rms_norm if piece else qwen_rms_norm)(x, self.norm, c.rms_norm_eps)
        if last in hidden_ids:
            feats[last] = x
        features = torch.cat([feats[i] for i in hidden_ids], dim=-1) if hidden_ids else None
        logits = F.linear(x if all_logits else x[-1:], self.lm_head)
        return logits, features

    def padded_out(self, a, w, x) -> tuple[torch.Tensor, torch.Tensor | None]:
        """_padded_rows: a mixer's output projection of a. With glue_kernels and the output projections in
        wide_linear, its epilogue adds the residual stream x and leaves each row's sums of squares for the MoE's norm:
        (x + y, partials); else (y, None), and the MoE adds and norms in the glue."""
        if self.numerics.qwen.glue_kernels and "out" in self.numerics.qwen.wide_projections:
            return wide_linear(a, w, residual=x, sumsq=True)
        return self.padded_linear(a, w, "out"), None

    def padded_linear(self, x, w, which: str):
        """_padded_rows' dense projections: reviewer_kernels/wide_linear.py for those the record's wide_projections
        name, else cuBLAS."""
        return wide_linear(x, w) if which in self.numerics.qwen.wide_projections else F.linear(x, w)

    @property
    def batch_invariant(self) -> bool:
        """Whether decode steps and verify blocks take _padded_rows, whose every kernel computes a row the same way
        for 1..16 rows (checked end to end by bench/layer_diff.py and the CUDA tests)."""
        return self.numerics.qwen.padded_rows and triton_usable(self.embed) and (
            not self.num_attention_layers or self.kv.use_block_kernel)

    def _padded_rows(self, tokens, positions, kv_len: int, record: bool, all_logits: bool, hidden_ids, compiled):
        """padded_rows: a decode step or verify block (T <= 16) whose every glue function (norms, projections
        through cuBLAS, RoPE, gates, the convolution) runs on PADDED_ROWS rows, the first T of them the block's.
        Only the parts that must see T rows (attention, the recurrence, routing and experts) take the first T. So
        a decode step and every verify size call the same compiled kernels with the same shapes (one torch.compile
        specialisation, one autotuned reduction order, one cuBLAS algorithm): a row's bits cannot depend on T.
        Compiled separately for 1 and 16 rows, the glue's RMSNorms rounded a few elements differently in some rows
        (bench/layer_diff.py). Padded rows hold token 0 at position 0 first and whatever the kernels leave after;
        nothing reads them. QwenNumerics.glue_kernels: the glue in our kernels instead (attention_prep, the gated
        norm of norms.py, each pre-norm inside the previous layer's slot sum, the MoE's residual add and norm inside
        the output projection and the router kernel; docs/kernels.md "The padded steps' glue in kernels")."""
        c, eps = self.config, self.config.rms_norm_eps
        T, pad = tokens.numel(), PADDED_ROWS - tokens.numel()
        x = F.embedding(F.pad(tokens, (0, pad)), self.embed)
        kernels = self.numerics.qwen.glue_kernels
        rope = None  # the padded rows' cos / sin, for the compiled glue (attention_prep reads the tables itself)
        if not kernels:
            padded_positions = F.pad(positions, (0, pad))
            rope = self.cos[padded_positions], self.sin[padded_positions]
        fixed = self.expert_tiles(x)
        feats = {}
        last = c.num_layers - 1
        normed = None
        for i, layer in enumerate(self.layers):
            m = layer.mixer
            if normed is None:  # the first layer's pre-norm; with glue_kernels the MoE's kernel norms for the next
                normed = glue(qwen_rms_norm, compiled)(x, layer.norm1, eps)
            if isinstance(m, GatedAttention):
                y, sumsq = m.padded(self, x, normed, positions, kv_len, T, compiled, rope)
            else:
                y, sumsq = m.padded(self, x, normed, positions, kv_len, T, compiled, record)
            next_norm = (self.layers[i + 1].norm1 if i < last else self.norm) if kernels else None
            x, normed = layer.moe.padded(x, y, layer.norm2, eps, T, compiled, fixed, next_norm, sumsq)
            if i in hidden_ids and i != last:
                feats[i] = x[:T]
        x = normed if kernels else glue(qwen_rms_norm, compiled)(x, self.norm, eps)  # the final norm
        if last in hidden_ids:
            feats[last] = x[:T]
        features = torch.cat([feats[i] for i in hidden_ids], dim=-1) if hidden_ids else None
        logits = F.linear(x, self.lm_head)  # all padded rows: cuBLAS at 16 rows costs what one row does
        return (logits[:T] if all_logits else logits[T - 1:T]), features

    def expert_tiles(self, x: torch.Tensor) -> dict | None:
        """The experts' one configuration for every call of 1..16 rows (_padded_rows), or None off Triton: the grouped
        tile set, or with QwenNumerics.experts "gemv" / "gemv_blocks" every token through the one-token kernels'
        arithmetic (numerics.QWEN_EXPERTS)."""
        if not triton_usable(x):
            return None
        c = self.config
        gemv = QWEN_EXPERTS[self.numerics.qwen.experts]
        if gemv is not None:
            return dict(gemv, decode=None, gemv_tokens=PADDED_ROWS)
        key = shape_key(c.num_experts, c.hidden_size, c.moe_intermediate_size, c.top_k, True)
        name = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
        return invariant_config(name, key, c.top_k)

    # ---- loading --------------------------------------------------------------------------------------------------

    @classmethod
    def supports(cls, hf_config) -> str | None:
        c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        if getattr(c, "model_type", None) not in MODEL_TYPES:
            return f"model_type {getattr(c, 'model_type', None)!r} is not Qwen3.5-MoE"
        rope = getattr(c, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            return f"rope_type {rope.get('rope_type')!r}"
        if getattr(c, "hidden_act", "silu") != "silu" or getattr(c, "attention_bias", False):
            return "hidden_act other than silu, or attention bias"
        if set(c.layer_types) - {"full_attention", "linear_attention"}:
            return f"layer types {sorted(set(c.layer_types))}"
        return None

    @classmethod
    def from_hf(cls, hf_model) -> Qwen35Moe:
        """Build from a loaded Qwen3_5MoeForCausalLM (or the multimodal ...ForConditionalGeneration, text only), on
        its device and dtype. Experts, embedding and LM head are shared, not copied; the fused projections and the
        (1 + weight) norms are new tensors."""
        reason = cls.supports(hf_model.config)
        if reason:
            raise ValueError(f"not supported by the fast Qwen3.5-MoE: {reason}")
        config = Qwen35MoeConfig.from_hf(hf_model.config)
        base = getattr(hf_model.model, "language_model", hf_model.model)
        with torch.device("meta"):  # structure only: every tensor is replaced below
            self = cls(config, base.rotary_emb.inv_freq)
        self.inv_freq = base.rotary_emb.inv_freq.detach().float().clone()
        plus_one = lambda w: _param(1.0 + w.detach().float())  # noqa: E731
        self.embed, self.norm = _param(base.embed_tokens.weight), plus_one(base.norm.weight)
        self.lm_head = self.embed if config.tie_embeddings else _param(hf_model.lm_head.weight)
        for layer, hf in zip(self.layers, base.layers):
            layer.norm1, layer.norm2 = plus_one(hf.input_layernorm.weight), plus_one(hf.post_attention_layernorm.weight)
            m = layer.mixer
            if isinstance(m, GatedAttention):
                a = hf.self_attn
                m.wqkv = _param(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
                m.q_norm, m.k_norm, m.wo = plus_one(a.q_norm.weight), plus_one(a.k_norm.weight), _param(a.o_proj.weight)
            else:
                d = hf.linear_attn
                m.w_in = _param(torch.cat([d.in_proj_qkv.weight, d.in_proj_z.weight, d.in_proj_b.weight,
                                           d.in_proj_a.weight]))
                m.conv_w = _param(d.conv1d.weight.squeeze(1))
                m.dt_bias, m.neg_A = _param(d.dt_bias), _param(-d.A_log.detach().float().exp())
                m.norm, m.w_out = _param(d.norm.weight), _param(d.out_proj.weight)
            moe, hm = layer.moe, hf.mlp
            moe.router = _param(hm.gate.weight)
            moe.gate_up, moe.down = _param(hm.experts.gate_up_proj), _param(hm.experts.down_proj)
            se = hm.shared_expert
            moe.shared_gate_proj, moe.shared_up_proj = _param(se.gate_proj.weight), _param(se.up_proj.weight)
            moe.shared_down_proj, moe.shared_gate = _param(se.down_proj.weight), _param(hm.shared_expert_gate.weight)
        return self.eval()
