"""The DFlash drafter: a small transformer that drafts a whole block in one forward, conditioned on the target's
hidden states (its checkpoints: checkpoint.py).

Architecture (z-lab/dflash, written here from scratch):
  features  = concat(target hidden_states[id + 1] for id in target_layer_ids)   # outputs of those decoder layers
  context   = hidden_norm(fc(features))                                         # one vector per committed position
  block     = target_embedding([known token, mask, mask, ...]) * input_embedding_scale
  each layer: queries from the block; keys/values from [context ; block] (the layer's own k_proj/v_proj applied to
              both, k_norm on both, RoPE over the absolute positions of context + block); Qwen3-style q/k norms,
              SwiGLU MLP, pre-norm residuals
  draft     = target_lm_head(norm(block hidden))[1:]                             # no embedding or head of its own
The context keys/values of every layer are cached (DraftContext), so a cycle only projects the newly accepted
positions.

Attention inside the block (`block_attention`), which public implementations disagree on:
  "mixed"          sliding_attention layers causal inside the block, full_attention layers bidirectional
                   (z-lab's current PyTorch and MLX code, vLLM, SGLang, TensorRT-LLM; z-lab config `is_causal` absent)
  "bidirectional"  every layer bidirectional inside the block (the DFlash paper; z-lab `is_causal: false`)
  "causal"         every layer causal inside the block (z-lab `is_causal: true`; Speculators' RFC default)
A checkpoint records its mode in `dflash_config.block_attention` (and the matching z-lab `is_causal`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backend.sampling import sampling_probs

BLOCK_ATTENTION_MODES = ("mixed", "bidirectional", "causal")
_IS_CAUSAL = {"mixed": None, "bidirectional": False, "causal": True}


# ---- config -------------------------------------------------------------------------------------------------------


@dataclass
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    vocab_size: int
    layer_types: list[str]
    sliding_window: int | None = None
    block_attention: str = "mixed"
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    rope_theta: float = 10000.0
    rope_parameters: dict | None = None
    max_position_embeddings: int = 32768
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    target_model: str | None = None  # the target this drafter was trained for (used by find_shipped_drafter)

    @classmethod
    def from_json(cls, raw: dict, block_attention: str | None = None) -> DrafterConfig:
        """Read a z-lab config.json: `block_size` at top level (older files) or in `dflash_config` (newer);
        `mask_token_id` and `target_layer_ids` in `dflash_config` (top-level accepted as a fallback)."""
        dflash = raw.get("dflash_config") or {}

        def pick(name, default=None):
            return dflash.get(name, raw.get(name, default))

        missing = [n for n in ("block_size", "mask_token_id", "target_layer_ids") if pick(n) is None]
        missing += [n for n in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                "vocab_size") if raw.get(n) is None]
        if missing:
            raise ValueError(f"drafter config.json lacks {', '.join(missing)}")
        if dflash.get("conv_kernel_size") or dflash.get("selector_rank"):
            raise ValueError("DFlash2 drafters (dynamic convolutions, candidate selector) are not supported")
        n_layers = int(raw["num_hidden_layers"])
        layer_types = list(raw.get("layer_types") or ["full_attention"] * n_layers)
        if len(layer_types) != n_layers or set(layer_types) - {"full_attention", "sliding_attention"}:
            raise ValueError(f"bad layer_types {layer_types} for {n_layers} layers")
        mode = block_attention or dflash.get("block_attention")
        if mode is None:
            is_causal = raw.get("is_causal")
            mode = "mixed" if is_causal is None else ("causal" if is_causal else "bidirectional")
        if mode not in BLOCK_ATTENTION_MODES:
            raise ValueError(f"block_attention must be one of {BLOCK_ATTENTION_MODES}, not {mode!r}")
        heads = int(raw["num_attention_heads"])
        rope = raw.get("rope_parameters") or raw.get("rope_scaling")
        theta = raw.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        softcap = pick("final_logit_softcapping")
        return cls(
            hidden_size=int(raw["hidden_size"]), num_hidden_layers=n_layers, num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            intermediate_size=int(raw["intermediate_size"]), block_size=int(pick("block_size")),
            mask_token_id=int(pick("mask_token_id")), target_layer_ids=[int(i) for i in pick("target_layer_ids")],
            num_target_layers=int(raw.get("num_target_layers") or max(pick("target_layer_ids")) + 1),
            vocab_size=int(raw["vocab_size"]), layer_types=layer_types,
            sliding_window=raw.get("sliding_window") if "sliding_attention" in layer_types else None,
            block_attention=mode, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            hidden_act=raw.get("hidden_act", "silu"), attention_bias=bool(raw.get("attention_bias", False)),
            rope_theta=float(theta), rope_parameters=rope,
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
            output_multiplier=float(pick("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            target_model=pick("target_model"),
        )

    def to_json(self, schema: str = "new") -> dict:
        """z-lab config.json. schema "new": block_size inside dflash_config; "old": block_size at top level."""
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids,
                  "block_attention": self.block_attention}
        for name, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0)):
            if getattr(self, name) != default:
                dflash[name] = getattr(self, name)
        if self.final_logit_softcapping:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.target_model:
            dflash["target_model"] = self.target_model
        raw = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "num_target_layers": self.num_target_layers, "layer_types": self.layer_types,
            "sliding_window": self.sliding_window, "use_sliding_window": self.sliding_window is not None,
            "rms_norm_eps": self.rms_norm_eps, "hidden_act": self.hidden_act, "attention_bias": self.attention_bias,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "dflash_config": dflash,
        }
        if self.rope_parameters:
            raw["rope_parameters"] = self.rope_parameters
        if _IS_CAUSAL[self.block_attention] is not None:
            raw["is_causal"] = _IS_CAUSAL[self.block_attention]
        if schema == "old":
            raw["block_size"] = self.block_size
        elif schema == "new":
            dflash["block_size"] = self.block_size
        else:
            raise ValueError("schema must be 'new' or 'old'")
        return raw


# ---- model --------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for absolute positions. Default RoPE here; other rope types go through transformers' init functions."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        rope = dict(cfg.rope_parameters or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "default":
            dim = cfg.head_dim
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.scale = 1.0
        else:
            from transformers import Qwen3Config
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            rope.setdefault("rope_theta", cfg.rope_theta)
            qcfg = Qwen3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                               head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                               rope_parameters=rope)
            inv_freq, self.scale = ROPE_INIT_FUNCTIONS[kind](qcfg)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def rope(x, cos, sin):
    """Rotary embedding over the whole head: x (..., n, d), cos/sin (n, d) (rotate_half's convention). The drafter,
    its fast path and its training all rotate through this one function."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def keys_values(self, x, cos, sin):
        """Keys (normed, rotated) and values for x (1, n, hidden): each (1, kv_heads, n, head_dim)."""
        n = x.shape[1]
        k = self.k_norm(self.k_proj(x).view(1, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        n = x.shape[1]
        q = self.q_norm(self.q_proj(x).view(1, n, self.heads, self.head_dim)).transpose(1, 2)
        q = rope(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        if ctx_k is not None and ctx_k.shape[2]:
            k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(1, n, -1))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        from transformers.activations import ACT2FN

        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_type: str):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sliding_window = cfg.sliding_window if layer_type == "sliding_attention" else None
        mode = cfg.block_attention
        self.causal = mode == "causal" or (mode == "mixed" and layer_type == "sliding_attention")

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def block_mask(ctx_positions: torch.Tensor, block_positions: torch.Tensor, causal: bool,
               sliding_window: int | None) -> torch.Tensor | None:
    """Boolean (block, context + block) visibility; None when everything is visible."""
    keys = torch.cat([ctx_positions, block_positions])
    q, k = block_positions[:, None], keys[None, :]
    visible = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=keys.device)
    if causal:
        visible &= k <= q
    if sliding_window is not None:
        visible &= (q - k < sliding_window) & (k - q < sliding_window)
    return None if bool(visible.all()) else visible


@dataclass
class Draft:
    tokens: list[int]  # B-1 target token ids
    confidence: list[float]  # drafter probability of each proposed token (for adaptive verify length)
    probs: torch.Tensor | None  # (B-1, target vocab) distributions the tokens were sampled from (sampling only)


def select_features(hidden_states, layer_ids) -> torch.Tensor:
    """The target's features for a drafter, from transformers' hidden_states (embeddings first): the outputs of
    decoder layers `layer_ids` (a drafter's target_layer_ids), concatenated on the last dimension."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        self.target_layer_ids = list(cfg.target_layer_ids)
        self.layers = nn.ModuleList(DraftLayer(cfg, t) for t in cfg.layer_types)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        self.draft_vocab: torch.Tensor | None = None  # restricted draft vocabulary: draft id -> target id
        self.target_vocab_mask: torch.Tensor | None = None  # (target vocab,) bool, host: in the draft vocabulary
        self.own_head: torch.Tensor | None = None  # a head shipped with the checkpoint (else the target's)
        self._embed = self._head = None

    # -- binding to the target --

    def check_target(self, target) -> None:
        """Validate against the target and bind its embedding and LM head (the drafter has none of its own)."""
        tcfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        embed = target.get_input_embeddings()
        vocab = embed.weight.shape[0]
        problems = []
        if tcfg.hidden_size != self.cfg.hidden_size:
            problems.append(f"hidden size {self.cfg.hidden_size} != target's {tcfg.hidden_size}")
        if max(self.target_layer_ids) >= tcfg.num_hidden_layers:
            problems.append(f"target_layer_ids {self.target_layer_ids} exceed the target's "
                            f"{tcfg.num_hidden_layers} layers")
        elif self.cfg.num_target_layers != tcfg.num_hidden_layers:
            problems.append(f"trained on a {self.cfg.num_target_layers}-layer target, this one has "
                            f"{tcfg.num_hidden_layers}")
        if not 0 <= self.mask_token_id < vocab:
            problems.append(f"mask_token_id {self.mask_token_id} outside the target vocabulary ({vocab})")
        if problems:
            raise ValueError("drafter does not fit the target: " + "; ".join(problems))
        weight = next(target.parameters())
        self.to(device=weight.device, dtype=embed.weight.dtype)
        self._embed = embed
        head = self.own_head if self.own_head is not None else target.get_output_embeddings().weight
        head = head.to(device=weight.device, dtype=embed.weight.dtype)
        if self.draft_vocab is not None:
            self.draft_vocab = self.draft_vocab.to(weight.device)
            # target_vocab_mask stays on the host: only the cycle's statistics read it, a token at a time, and on
            # the GPU each such read was a kernel and a sync (three or four a cycle, on its critical path)
            if head.shape[0] == vocab:  # the target's head: keep only the draft vocabulary's rows
                head = head[self.draft_vocab].contiguous()
        self._head = head
        self._vocab = vocab

    def restrict_vocab(self, target_ids: torch.Tensor, vocab_size: int) -> None:
        """Draft only among `target_ids` (e.g. build_draft_vocab's top-K); call before check_target."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values
        self.draft_vocab = ids
        self.target_vocab_mask = torch.zeros(vocab_size, dtype=torch.bool)
        self.target_vocab_mask[ids] = True

    # -- context --

    def new_context(self) -> DraftContext:
        return DraftContext(len(self.layers))

    def select_features(self, hidden_states) -> torch.Tensor:
        return select_features(hidden_states, self.target_layer_ids)

    def _absorb_pending(self, ctx: DraftContext) -> None:
        if ctx.pending is None or ctx.pending.shape[1] == 0:
            ctx.pending = None
            return
        feats = ctx.pending.to(self.fc.weight.dtype)
        context = self.hidden_norm(self.fc(feats))
        positions = torch.arange(ctx.length, ctx.length + feats.shape[1], device=feats.device)
        cos, sin = self.rotary(positions, context.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(context, cos, sin)
            ctx.append(i, k, v)
        ctx.length += feats.shape[1]
        ctx.pending = None

    # -- drafting --

    def block_hidden(self, block_embeds, block_positions, ctx_k, ctx_v, ctx_positions) -> torch.Tensor:
        """The drafter's forward over one block: block_embeds (1, B, hidden) at block_positions, attending to the
        per-layer context keys/values ctx_k[i]/ctx_v[i] at ctx_positions. Returns normed hidden (1, B, hidden).
        Differentiable (the training code can call it)."""
        cos, sin = self.rotary(block_positions, block_embeds.dtype)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            k, v, pos = ctx_k[i], ctx_v[i], ctx_positions
            if k is None:
                pos = ctx_positions[:0]
            elif layer.sliding_window is not None and pos.shape[0] > layer.sliding_window:
                w = layer.sliding_window
                k, v, pos = k[:, :, -w:], v[:, :, -w:], pos[-w:]
            mask = block_mask(pos, block_positions, layer.causal, layer.sliding_window)
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary (the whole target vocabulary unless restricted)."""
        logits = F.linear(hidden, self._head)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        if self.cfg.final_logit_softcapping:
            cap = self.cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def draft(self, ctx: DraftContext, token: int, temperature: float, top_p: float,
              rng: torch.Generator) -> Draft:
        """Propose block_size-1 tokens following `token`, which sits right after the context."""
        self._absorb_pending(ctx)
        device = self._head.device
        start = ctx.length
        ids = torch.full((self.block_size,), self.mask_token_id, dtype=torch.long, device=device)
        ids[0] = token
        embeds = self._embed(ids)[None]
        if self.cfg.input_embedding_scale != 1.0:
            embeds = embeds * self.cfg.input_embedding_scale
        block_positions = torch.arange(start, start + self.block_size, device=device)
        ctx_positions = torch.arange(0, start, device=device)
        hidden = self.block_hidden(embeds, block_positions, ctx.keys(), ctx.values(), ctx_positions)
        logits = self.logits(hidden[0, 1:]).float()
        probs = None
        if temperature == 0:
            choice = logits.argmax(-1)
            confidence = torch.softmax(logits, -1).gather(1, choice[:, None])[:, 0]
        else:
            q = sampling_probs(logits, temperature, top_p)
            choice = torch.multinomial(q, 1, generator=rng)[:, 0]
            confidence = q.gather(1, choice[:, None])[:, 0]
            probs = q
        if self.draft_vocab is not None:
            choice = self.draft_vocab[choice]
            if probs is not None:  # spread over the target vocabulary: zero outside the draft vocabulary
                full = probs.new_zeros(probs.shape[0], self._vocab)
                probs = full.index_copy_(1, self.draft_vocab, probs)
        return Draft(tokens=choice.tolist(), confidence=confidence.tolist(), probs=probs)


class DraftContext:
    """The drafter's cache over committed positions: per-layer context keys/values for positions [0, length), plus
    `pending` target features for positions [length, length + pending) not yet projected. Together they cover
    exactly the tokens in the target's cache."""

    def __init__(self, n_layers: int):
        self._k: list[torch.Tensor | None] = [None] * n_layers
        self._v: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0
        self.pending: torch.Tensor | None = None

    @property
    def covered(self) -> int:
        return self.length + (0 if self.pending is None else self.pending.shape[1])

    def add_pending(self, features: torch.Tensor) -> None:
        self.pending = features if self.pending is None else torch.cat([self.pending, features], dim=1)

    def crop(self, n: int) -> None:
        if n >= self.length:
            if self.pending is not None:
                self.pending = self.pending[:, : n - self.length]
        else:
            self.length, self.pending = n, None

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        need = self.length + k.shape[2]
        buf_k, buf_v = self._k[i], self._v[i]
        if buf_k is None or need > buf_k.shape[2]:
            cap = max(256, 2 * need)
            new_k, new_v = k.new_empty((*k.shape[:2], cap, k.shape[3])), v.new_empty((*v.shape[:2], cap, v.shape[3]))
            if buf_k is not None and self.length:
                new_k[:, :, : self.length] = buf_k[:, :, : self.length]
                new_v[:, :, : self.length] = buf_v[:, :, : self.length]
            self._k[i], self._v[i] = buf_k, buf_v = new_k, new_v
        buf_k[:, :, self.length : need] = k
        buf_v[:, :, self.length : need] = v

    def keys(self) -> list[torch.Tensor]:
        return [k[:, :, : self.length] if k is not None else None for k in self._k]

    def values(self) -> list[torch.Tensor]:
        return [v[:, :, : self.length] if v is not None else None for v in self._v]
