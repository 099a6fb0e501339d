"""Llama (SmolLM2, the embedded model, and the Llama family) for the fast path: the architecture and nothing else.

Same math and rounding points as transformers' LlamaForCausalLM (RMSNorm in fp32 then cast, RoPE tables in fp32 cast
to the model dtype, SDPA attention with grouped KV heads); weights come from a loaded transformers model, so every
format transformers reads (safetensors, GGUF through backend/loading.py) works. q/k/v and gate/up projections are
fused into one matrix each (fewer, larger matmuls); the transformers modules keep working on row views of the fused
matrices, so the weights are held once (fuse_rows). Keys/values live in a KVCache.

    model = Llama.from_hf(hf_model, max_context=8192)
    logits, features = model(tokens, positions, kv_len, all_logits=False, hidden_ids=(3, 7))
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from backend.models.cublas_rows import linear_rows_invariant
from backend.models.numerics import Numerics
from backend.models.static_cache import KVCache
from reviewer_kernels.block_attention import block_attention
from reviewer_kernels.fused_moe import triton_usable
from reviewer_kernels.gemv import gemv
from reviewer_kernels.norm_gemv import MAX_ROWS as ROW_KERNEL_ROWS
from reviewer_kernels.norm_gemv import norm_gemv
from reviewer_kernels.rows_linear import rows_linear

# RoPE variants whose frequencies do not depend on the sequence length: transformers' inv_freq buffer is exact for
# them. "dynamic" and "longrope" rescale with the length at run time, which this file does not reproduce.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, c) -> LlamaConfig:
        return cls(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                   num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                   num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                   rms_norm_eps=c.rms_norm_eps, tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                   attention_bias=bool(getattr(c, "attention_bias", False)),
                   mlp_bias=bool(getattr(c, "mlp_bias", False)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(inv_freq: torch.Tensor, scaling: float, max_context: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_context, rotary_dim] (computed in fp32, then cast, as transformers does per forward)."""
    freqs = torch.arange(max_context, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq.float()[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, D]; cos, sin [T, rotary_dim] (rotary_dim <= D: the rest passes through, for partial RoPE)."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, xp), dim=-1) if xp.shape[-1] else out


def causal_mask(positions: torch.Tensor, kv_len: int, lower_right: bool = False):
    """[1, 1, T, kv_len] bool: query at positions[t] sees cache columns <= it, so columns past the current length
    (stale or unwritten) are never attended. Built once per forward and shared by every attention layer.

    lower_right: the caller guarantees that positions are the last T of the kv_len columns (a prefill piece, as
    FastModel runs it). On CUDA the mask is then torch's lower-right causal bias, which attention() hands to
    FlashAttention: no mask tensor, and none of the plan cuDNN's attention builds for every new (prompt, context)
    shape (on the H200 at the 35B-A3B shape 1.1-1.7 s for a process's first shapes and ~45 ms later, 1.2 s of a cold
    server's first agent turn; every later turn brings new shapes; bench/results/prefill_attention_h200_20261203.json)."""
    if lower_right and positions.is_cuda:
        return causal_lower_right(positions.numel(), kv_len)
    return (torch.arange(kv_len, device=positions.device)[None, :] <= positions[:, None])[None, None]


# (device, dtype, head_dim) where FlashAttention could not run: the bool mask there (checked once, not per call)
_NO_FLASH: set = set()


def attention(q, k, v, mask) -> torch.Tensor:
    """q [Hq, T, D]; k, v [Hkv, kv_len, D] (cache columns 0..kv_len-1); mask from causal_mask. Returns [T, Hq * D]."""
    T = q.shape[1]
    gqa = q.shape[0] != k.shape[0]
    if isinstance(mask, CausalBias):
        key = (q.device, q.dtype, q.shape[-1])
        if q.dtype in (torch.float16, torch.bfloat16) and key not in _NO_FLASH:
            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=gqa)
                return out[0].transpose(0, 1).reshape(T, -1)
            except RuntimeError as exc:  # no FlashAttention for this GPU, dtype or head size
                if isinstance(exc, torch.OutOfMemoryError):
                    raise
                _NO_FLASH.add(key)
        cols = torch.arange(mask.seq_len_kv, device=q.device)
        mask = (cols[None, :] <= cols[mask.seq_len_kv - T:, None])[None, None]
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=gqa)
    return out[0].transpose(0, 1).reshape(T, -1)


def cached_attention(kv: KVCache, layer: int, q, k, v, positions, kv_len: int, mask) -> torch.Tensor:
    """Store the block's k, v [Hkv, T, D] in layer `layer` of the cache and attend: through
    reviewer_kernels/block_attention when the forward chose it (mask None; positions are consecutive, as FastModel makes
    them), else index_copy_ + SDPA over the first kv_len columns with `mask`. Returns [T, Hq * D]."""
    if mask is None:
        return block_attention(q, k, v, kv.k[layer], kv.v[layer], positions[:1], kv_len, use_triton=True)
    k_all, v_all = kv.write(layer, positions, k, v, kv_len)
    return attention(q, k_all, v_all, mask)


# ---- per-layer glue: plain tensor functions (no modules, no cache writes), so one torch.compile serves every layer ---

def residual_add(x, y):
    """x + y as PyTorch rounds a bf16 add (in fp32, rounded once), spelled in fp32 so that torch.compile fuses it into
    the RMSNorm that follows instead of leaving it to a cuBLAS `addmm` epilogue (which first copies x: a launch)."""
    return x if y is None else (x.float() + y.float()).to(x.dtype)


def attention_in(x, y, norm, wqkv, bqkv, cos, sin, eps: float, heads: int, kv_heads: int, head_dim: int):
    """The residual stream x plus the previous layer's MLP output y (None before the first layer), pre-norm, fused
    q/k/v projection and RoPE. Returns the new residual stream, q [H, T, D], k and v [Hkv, T, D]."""
    T = x.shape[0]
    x = residual_add(x, y)
    qk, v = F.linear(rms_norm(x, norm, eps), wqkv, bqkv).split(
        [(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
    # queries and keys rotated as one tensor: the same arithmetic per element, one fused kernel instead of two
    qk = apply_rope(qk.view(T, heads + kv_heads, head_dim).transpose(0, 1), cos, sin)
    return x, qk[:heads], qk[heads:], v.view(T, kv_heads, head_dim).transpose(0, 1)


def attention_out_mlp(x, attn, wo, bo, mlp_norm, w_gate_up, b_gate_up, w_down, b_down, eps: float):
    """Output projection + residual, then the SwiGLU MLP. Returns the residual stream and the MLP output, which the
    next layer's attention_in (or final_norm) adds: the add fuses into that norm."""
    x = residual_add(x, F.linear(attn, wo, bo))
    gate, up = F.linear(rms_norm(x, mlp_norm, eps), w_gate_up, b_gate_up).chunk(2, dim=-1)
    return x, F.linear(F.silu(gate) * up, w_down, b_down)


def final_norm(x, y, norm, eps: float):
    """The last layer's residual add and the final RMSNorm."""
    return rms_norm(residual_add(x, y), norm, eps)


_COMPILED: dict = {}


def glue(fn, compiled: bool):
    """fn itself, or its torch.compile'd twin (fullgraph; compiled once per function and shared by all layers and
    models: tensors are arguments, not captured modules). Compiled code fuses the elementwise chains (norms, casts,
    RoPE, gates, residuals) that otherwise cost a kernel launch each: on CUDA, in a graph, ~2 us apiece."""
    if not compiled:
        return fn
    if fn not in _COMPILED:
        # one process legitimately compiles each function for several block lengths, dtypes, models and for the
        # first layer (no MLP output to add yet): dynamo's default of 8 versions per function is too few
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED[fn] = torch.compile(fn, fullgraph=True)
    return _COMPILED[fn]


class LlamaLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.attn_norm = nn.Parameter(torch.empty(c.hidden_size))
        self.wqkv = nn.Parameter(torch.empty(qkv, c.hidden_size))
        self.bqkv = nn.Parameter(torch.empty(qkv)) if c.attention_bias else None
        self.wo = nn.Parameter(torch.empty(c.hidden_size, c.num_heads * c.head_dim))
        self.bo = nn.Parameter(torch.empty(c.hidden_size)) if c.attention_bias else None
        self.mlp_norm = nn.Parameter(torch.empty(c.hidden_size))
        self.w_gate_up = nn.Parameter(torch.empty(2 * c.intermediate_size, c.hidden_size))
        self.b_gate_up = nn.Parameter(torch.empty(2 * c.intermediate_size)) if c.mlp_bias else None
        self.w_down = nn.Parameter(torch.empty(c.hidden_size, c.intermediate_size))
        self.b_down = nn.Parameter(torch.empty(c.hidden_size)) if c.mlp_bias else None


class Llama(nn.Module):
    """Decode steps and verify blocks (T <= 16) run as the Numerics record handed to setup_caches says (its
    LlamaNumerics: step path, the projections on tensor cores; backend/models/numerics.py)."""

    family = "llama"

    def __init__(self, config: LlamaConfig, inv_freq: torch.Tensor, rope_scaling: float = 1.0):
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(LlamaLayer(config) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size))
        self.lm_head = self.embed if config.tie_embeddings else nn.Parameter(torch.empty_like(self.embed))
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)
        self.rope_scaling = rope_scaling
        self.kv: KVCache | None = None
        self.linear = None  # no Gated DeltaNet state: any cache prefix is a valid rollback point
        self.numerics = Numerics()  # setup_caches takes the record to run
        self.step_path = "rows"  # the step path setup_caches took for the record ("rows" or "glue")
        self.glue_invariant = False  # step_path "glue" verified on this device (setup_caches)

    # ---- caches ---------------------------------------------------------------------------------------------------

    def setup_caches(self, max_context: int, max_block: int, numerics: Numerics | None = None) -> None:
        """Allocate the caches and take `numerics` (default: Numerics(), the one-token path) for decode steps and
        verifies, before any CUDA graph is captured: step path "glue" is checked on this device first (the check
        synchronises) and falls back to "rows" where cuBLAS is not row-invariant."""
        c, w = self.config, self.embed
        self.kv = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_context, w.device, w.dtype)
        self.cos, self.sin = rope_tables(self.inv_freq, self.rope_scaling, max_context, w.dtype)
        self.numerics = numerics or Numerics()
        path = self.numerics.llama.step_path
        if self.numerics.llama.mma_projections and not (self.one_token_kernels and triton_usable(self.embed)):
            # tensor-core rows asked for, which _rows cannot run here: the checked glue is the batch-invariant path
            path = "glue"
        self.step_path = path
        first = self.layers[0]  # every layer has layer 0's shapes
        self.glue_invariant = path == "glue" and triton_usable(self.embed) and self.kv.use_block_kernel and (
            linear_rows_invariant([first.wqkv, first.wo, first.w_gate_up, first.w_down, self.lm_head]))

    # ---- forward --------------------------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int, *, record: bool = False,
                all_logits: bool = False, hidden_ids: tuple[int, ...] = (), compiled: bool = False,
                lower_right: bool = False):
        """tokens, positions [T] (device tensors; positions consecutive). Writes K/V at `positions`, attends over cache
        columns < kv_len (lower_right: positions end at kv_len - 1; see causal_mask).
        Returns (logits [T or 1, V] in the model dtype, features [T, len(hidden_ids) * H] or None): features are the
        outputs of decoder layers `hidden_ids` (transformers' hidden_states[i + 1]; the last layer's is after the final
        norm, as there). `record` has no meaning without linear-attention state. compiled: run the per-layer glue
        through torch.compile (see glue())."""
        c = self.config
        x, y = F.embedding(tokens, self.embed), None  # residual stream, and the MLP output not yet added to it
        T = tokens.numel()
        if T <= ROW_KERNEL_ROWS and self.glue_steps:
            return self._padded_glue(tokens, positions, kv_len, all_logits, hidden_ids, compiled)
        if T <= ROW_KERNEL_ROWS and self.one_token_kernels and triton_usable(x) and (
                T == 1 or self.kv.block_kernel(T)):
            return self._rows(x, positions, kv_len, hidden_ids)
        attn_in, attn_out_mlp = glue(attention_in, compiled), glue(attention_out_mlp, compiled)
        cos, sin = self.cos[positions], self.sin[positions]
        mask = None if self.kv.block_kernel(tokens.numel()) else causal_mask(positions, kv_len, lower_right)
        feats = {}
        last = c.num_layers - 1
        for i, layer in enumerate(self.layers):
            x, q, k, v = attn_in(x, y, layer.attn_norm, layer.wqkv, layer.bqkv, cos, sin, c.rms_norm_eps,
                                 c.num_heads, c.num_kv_heads, c.head_dim)
            if i - 1 in hidden_ids:  # x is now layer i - 1's output
                feats[i - 1] = x
            x, y = attn_out_mlp(x, cached_attention(self.kv, i, q, k, v, positions, kv_len, mask), layer.wo,
                                layer.bo, layer.mlp_norm, layer.w_gate_up, layer.b_gate_up, layer.w_down,
                                layer.b_down, c.rms_norm_eps)
        x = glue(final_norm, compiled)(x, y, self.norm, c.rms_norm_eps)
        if last in hidden_ids:
            feats[last] = x
        features = torch.cat([feats[i] for i in hidden_ids], dim=-1) if hidden_ids else None
        logits = F.linear(x if all_logits else x[-1:], self.lm_head)
        return logits, features

    def _padded_glue(self, tokens, positions, kv_len: int, all_logits: bool, hidden_ids: tuple[int, ...], compiled):
        """A decode step or verify block (T <= 16) for step_path "glue": forward()'s glue functions on exactly
        ROW_KERNEL_ROWS (16) rows, the block's first, padding after them; only attention takes the real rows (and
        writes into the padded buffer). So a decode step and every verify size call the same compiled kernels and
        the same cuBLAS algorithm with the same shapes, and a row's bits cannot depend on T (separately compiled for
        1 and 16 rows, norms can round a row differently: reviewer_kernels/README.md "The Qwen3.5/3.6-MoE path", whose
        _padded_rows this mirrors). Padded rows hold token 0 at position 0 first, whatever the kernels leave after;
        nothing reads them."""
        c, eps = self.config, self.config.rms_norm_eps
        T, pad = tokens.numel(), ROW_KERNEL_ROWS - tokens.numel()
        x, y = F.embedding(F.pad(tokens, (0, pad)), self.embed), None
        padded_positions = F.pad(positions, (0, pad))
        cos, sin = self.cos[padded_positions], self.sin[padded_positions]
        attn_in, attn_out_mlp = glue(attention_in, compiled), glue(attention_out_mlp, compiled)
        feats = {}
        last = c.num_layers - 1
        for i, layer in enumerate(self.layers):
            x, q, k, v = attn_in(x, y, layer.attn_norm, layer.wqkv, layer.bqkv, cos, sin, eps, c.num_heads,
                                 c.num_kv_heads, c.head_dim)
            if i - 1 in hidden_ids:  # x is now layer i - 1's output
                feats[i - 1] = x[:T]
            attn = x.new_empty(ROW_KERNEL_ROWS, c.num_heads * c.head_dim)
            block_attention(q[:, :T], k[:, :T], v[:, :T], self.kv.k[i], self.kv.v[i], positions[:1], kv_len,
                            use_triton=True, out=attn[:T])
            x, y = attn_out_mlp(x, attn, layer.wo, layer.bo, layer.mlp_norm, layer.w_gate_up, layer.b_gate_up,
                                layer.w_down, layer.b_down, eps)
        x = glue(final_norm, compiled)(x, y, self.norm, eps)
        if last in hidden_ids:
            feats[last] = x[:T]
        features = torch.cat([feats[i] for i in hidden_ids], dim=-1) if hidden_ids else None
        logits = F.linear(x, self.lm_head)  # all 16 rows: cuBLAS at 16 rows costs what one row does
        return (logits[:T] if all_logits else logits[T - 1:T]), features

    @property
    def glue_steps(self) -> bool:
        """Decode steps and verify blocks through forward()'s glue and cuBLAS (step_path "glue", verified)."""
        return self.step_path == "glue" and self.glue_invariant and self.kv.use_block_kernel

    @property
    def batch_invariant(self) -> bool:
        """Whether decode steps and verify blocks take kernels that compute a row the same way for 1..16 rows (_rows,
        or the glue over a cuBLAS that does, with block attention): then a position's logits are bitwise the same
        however the engine reached it."""
        if not (triton_usable(self.embed) and self.kv.use_block_kernel):
            return False
        return self.glue_steps or self.one_token_kernels

    @property
    def one_token_kernels(self) -> bool:
        """Whether decode steps and verify blocks can take _rows' kernels: they know no biases and rotate whole
        heads."""
        c = self.config
        return not (c.attention_bias or c.mlp_bias) and self.cos.shape[-1] == c.head_dim and c.head_dim % 2 == 0

    def _rows(self, x, positions, kv_len: int, hidden_ids: tuple[int, ...]):
        """A decode step or a verify block (T <= 16 rows) in five launches per layer (reviewer_kernels/norm_gemv.py,
        reviewer_kernels/gemv.py, two of attention, plus the cache write for T > 1): norm + q/k/v + RoPE; cache write +
        attention; output projection + residual; norm + gate/up + SwiGLU; down projection + residual.
        forward()'s glue path takes ten (bench/target_step.py --profile). The residual adds sit in the projections'
        epilogues, so x is always the whole residual stream.

        Batch-invariant: every kernel computes a row the same way for 1..16 rows (each input row runs the one-row
        program of the projection kernels; attention sees a block row's earlier tokens as cached columns at the
        decode step's slice boundaries), so a position's logits are bitwise those of a plain decode step at that
        position.
        That is what makes greedy speculative decoding emit exactly plain decoding's tokens on the GPU."""
        c = self.config
        T = x.shape[0]
        heads, kv_heads, d = c.num_heads, c.num_kv_heads, c.head_dim
        q_rows, k_rows = heads * d, kv_heads * d
        mask = None if self.kv.block_kernel(T) else causal_mask(positions, kv_len)
        feats = {}
        eps = c.rms_norm_eps
        rope = (self.cos, self.sin, positions, q_rows + k_rows)
        mma = self.numerics.llama.mma_projections
        for i, layer in enumerate(self.layers):
            qkv = (rows_linear if "qkv" in mma else _norm_gemv)(x, layer.wqkv, layer.attn_norm, eps, rope=rope)
            q = qkv[:, :q_rows].view(T, heads, d).transpose(0, 1)
            k = qkv[:, q_rows:q_rows + k_rows].view(T, kv_heads, d).transpose(0, 1)
            v = qkv[:, q_rows + k_rows:].view(T, kv_heads, d).transpose(0, 1)
            attn = cached_attention(self.kv, i, q, k, v, positions, kv_len, mask)
            x = (rows_linear if "o" in mma else gemv)(attn, layer.wo, residual=x)
            h = (rows_linear if "gate_up" in mma else _norm_gemv)(x, layer.w_gate_up, layer.mlp_norm, eps, swiglu=True)
            x = (rows_linear if "down" in mma else gemv)(h, layer.w_down, residual=x)
            if i in hidden_ids:
                feats[i] = x
        last = c.num_layers - 1
        if last in hidden_ids:  # transformers' last hidden state is after the final norm
            feats[last] = rms_norm(x, self.norm, c.rms_norm_eps)
        # all rows' logits (a verify needs them; a decode step has one row): the LM head through a row kernel
        logits = (rows_linear if "lm_head" in mma else _norm_gemv)(x, self.lm_head, self.norm, eps)
        return logits, (torch.cat([feats[i] for i in hidden_ids], dim=-1) if hidden_ids else None)

    # ---- loading --------------------------------------------------------------------------------------------------

    @classmethod
    def supports(cls, hf_config) -> str | None:
        """None if this file reproduces `hf_config` exactly, else the reason it does not."""
        if getattr(hf_config, "model_type", None) != "llama":
            return f"model_type {getattr(hf_config, 'model_type', None)!r} is not llama"
        rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        if rope.get("rope_type", "default") not in STATIC_ROPE_TYPES:
            return f"rope_type {rope.get('rope_type')!r} rescales with the sequence length"
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            return f"hidden_act {hf_config.hidden_act!r}"
        if getattr(hf_config, "pretraining_tp", 1) not in (None, 1):
            return "pretraining_tp > 1"
        return None

    @classmethod
    def from_hf(cls, hf_model) -> Llama:
        """Build from a loaded transformers LlamaForCausalLM, on its device and dtype. Every tensor is shared with it:
        the embedding and LM head as they are, the fused projections by turning the modules' weights into views of
        them (fuse_rows)."""
        reason = cls.supports(hf_model.config)
        if reason:
            raise ValueError(f"not supported by the fast Llama: {reason}")
        config = LlamaConfig.from_hf(hf_model.config)
        rotary, base = hf_model.model.rotary_emb, hf_model.model
        with torch.device("meta"):  # structure only: every tensor is replaced below
            self = cls(config, rotary.inv_freq, float(rotary.attention_scaling))
        self.inv_freq = rotary.inv_freq.detach().float().clone()
        self.embed, self.norm = _param(base.embed_tokens.weight), _param(base.norm.weight)
        self.lm_head = self.embed if config.tie_embeddings else _param(hf_model.lm_head.weight)
        for layer, hf_layer in zip(self.layers, base.layers):
            a, m = hf_layer.self_attn, hf_layer.mlp
            layer.attn_norm = _param(hf_layer.input_layernorm.weight)
            layer.wqkv = _param(fuse_rows([a.q_proj, a.k_proj, a.v_proj], "weight"))
            layer.bqkv = _param(fuse_rows([a.q_proj, a.k_proj, a.v_proj], "bias")) if config.attention_bias else None
            layer.wo, layer.bo = _param(a.o_proj.weight), _param(a.o_proj.bias)
            layer.mlp_norm = _param(hf_layer.post_attention_layernorm.weight)
            layer.w_gate_up = _param(fuse_rows([m.gate_proj, m.up_proj], "weight"))
            layer.b_gate_up = _param(fuse_rows([m.gate_proj, m.up_proj], "bias")) if config.mlp_bias else None
            layer.w_down, layer.b_down = _param(m.down_proj.weight), _param(m.down_proj.bias)
        return self.eval()


def _norm_gemv(x, w, norm_weight, eps, **epilogue):
    """reviewer_kernels/norm_gemv.py with rows_linear's argument order, so _rows can pick either per projection."""
    return norm_gemv(x, norm_weight, w, eps, **epilogue)


def fuse_rows(modules: list[nn.Module], name: str) -> torch.Tensor:
    """The modules' `name` tensors stacked along dim 0 as one contiguous tensor, and each module's own tensor replaced
    by its rows of it (a view), so the weights are held once: the separate copies cost the embedded model 266 MB
    (issue 29). The fused tensor is the one the fast path always used (a fresh torch.cat), so its kernels, CUDA
    included, compute exactly as before; the transformers modules read the same values through views. Modules already
    made views by an earlier call (a second engine over the same model) give back the same storage: no new copy."""
    parts = [getattr(mod, name).detach() for mod in modules]
    first, storage = parts[0], parts[0].untyped_storage()
    rows = sum(p.shape[0] for p in parts)
    # reused only when the storage is exactly these rows, as a torch.cat makes it (not, say, a file mapping that
    # happens to hold them in order: its alignment could differ from a fresh allocation's)
    if first.storage_offset() == 0 and storage.nbytes() == sum(p.nbytes for p in parts) and all(
            p.is_contiguous() and p.untyped_storage().data_ptr() == storage.data_ptr() for p in parts) and all(
            b.storage_offset() == a.storage_offset() + a.numel() for a, b in zip(parts, parts[1:])):
        return first.new_empty(0).set_(storage, 0, (rows, *first.shape[1:]))
    fused = torch.cat(parts)
    for part in parts:
        _page_out(part)
    start = 0
    for mod, part in zip(modules, parts):
        setattr(mod, name, nn.Parameter(fused[start:start + part.shape[0]], requires_grad=False))
        start += part.shape[0]
    return fused


def _page_out(t: torch.Tensor) -> None:
    """Ask the kernel to reclaim the resident pages of a CPU tensor nobody reads any more. The transformers copies of
    the fused projections are pages of the mapped safetensors file, which stays mapped for the other weights: read
    once by torch.cat, they stayed resident (266 MB of RSS for the embedded model). MADV_PAGEOUT only reclaims (file
    pages are dropped and would be read again, anonymous ones swapped out or left), contents never change, so it is
    safe whatever memory the tensor is in; where the kernel lacks it (before Linux 5.4) the call fails, harmlessly."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return
    first = -(-t.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the tensor only
    end = (t.data_ptr() + t.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), MADV_PAGEOUT)


MADV_PAGEOUT = 21


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    """Wrap a tensor as a frozen parameter without copying it (a transformers Parameter is shared as is)."""
    if t is None:
        return None
    return nn.Parameter(t.detach(), requires_grad=False)
