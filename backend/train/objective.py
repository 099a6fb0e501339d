"""What one training step computes: a drafter for the target (new, or from a checkpoint), blocks drawn from the
target's features (anchors, corruption, labels), the batched block forward with the inference visibility, and the
loss against the target (KL or cross-entropy, position-weighted)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.dflash.checkpoint import load_drafter
from backend.dflash.model import DFlashDrafter, DrafterConfig, rope
from backend.train import data as td
from backend.train.config import TrainConfig, TrainError

def default_layer_ids(n_layers: int, count: int = 5) -> list[int]:
    """`count` target layers spread over the depth, first at layer 1 (like the released z-lab drafters)."""
    count = min(n_layers, count)
    return sorted({min(n_layers - 1, max(0, round(1 + i * (n_layers - 3) / max(count - 1, 1)))) for i in range(count)})


def parse_layer_ids(spec: str, n_layers: int) -> list[int]:
    if spec in ("", "auto"):
        return default_layer_ids(n_layers)
    try:
        ids = sorted({int(x) for x in spec.replace(" ", "").split(",") if x})
    except ValueError:
        raise TrainError(f"--target-layers must be 'auto' or comma-separated layer numbers, not {spec!r}") from None
    if not ids or ids[0] < 0 or ids[-1] >= n_layers:
        raise TrainError(f"--target-layers {spec}: the target has layers 0..{n_layers - 1}")
    return ids


def new_drafter(cfg: TrainConfig, target, layer_ids: list[int], target_name: str) -> DFlashDrafter:
    tcfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    heads = tcfg.num_attention_heads
    vocab = target.get_input_embeddings().weight.shape[0]
    mask_id = cfg.mask_token_id if cfg.mask_token_id >= 0 else vocab - 1
    if mask_id >= vocab:
        raise TrainError(f"--mask-token-id {mask_id} is outside the target's vocabulary ({vocab})")
    n = cfg.layers
    rope = getattr(tcfg, "rope_parameters", None) or {}
    dcfg = DrafterConfig(
        hidden_size=tcfg.hidden_size, num_hidden_layers=n, num_attention_heads=heads,
        num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads,
        intermediate_size=cfg.intermediate_size, block_size=cfg.block_size, mask_token_id=mask_id,
        target_layer_ids=layer_ids, num_target_layers=tcfg.num_hidden_layers, vocab_size=vocab,
        # z-lab's layout: sliding-window layers, the last one full attention ("mixed" makes the sliding ones causal)
        layer_types=["sliding_attention"] * (n - 1) + ["full_attention"],
        sliding_window=cfg.sliding_window if cfg.sliding_window > 0 else None, block_attention=cfg.attention,
        rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or getattr(tcfg, "rope_theta", None) or 10000.0),
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 32768)), target_model=target_name,
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    drafter = DFlashDrafter(dcfg)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return drafter


def init_from_checkpoint(drafter: DFlashDrafter, path: Path) -> None:
    """Copy a saved drafter's weights into `drafter` (same shape). Its restricted vocabulary, if any, is not kept:
    the run's own --vocab-top-k decides (a head is never part of the weights: the target's is used).
    A deeper `drafter` (more --layers) starts as the same function: the saved layers but the last fill the first
    places, the saved last layer (full attention in the z-lab layout) the last place, and each layer in between has
    its output projections (attention o_proj, MLP down_proj) at zero, so it adds nothing to the residual stream until
    training moves them: a way to ask whether depth still pays, from where the shipped drafter is."""

    try:
        source = load_drafter(path)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise TrainError(f"--init-from: {exc}") from None
    shape = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
             "block_size", "mask_token_id", "target_layer_ids", "num_target_layers")
    diffs = [f"{k} {getattr(source.cfg, k)} (this run: {getattr(drafter.cfg, k)})" for k in shape
             if getattr(source.cfg, k) != getattr(drafter.cfg, k)]
    n_src, n = source.cfg.num_hidden_layers, drafter.cfg.num_hidden_layers
    if n_src > n:
        diffs.append(f"num_hidden_layers {n_src} (this run: {n}; a run may add layers, not drop them)")
    places = list(range(n_src - 1)) + [n - 1]  # where each saved layer goes
    if not diffs:
        diffs = [f"layer {i} is {source.cfg.layer_types[i]} (this run's layer {j}: {drafter.cfg.layer_types[j]})"
                 for i, j in enumerate(places) if source.cfg.layer_types[i] != drafter.cfg.layer_types[j]]
    if diffs:
        raise TrainError(f"--init-from {path}: a different drafter: " + "; ".join(diffs)
                         + " (give the matching --layers, --intermediate-size, --target-layers, --block-size)")
    if source.own_head is not None:
        raise TrainError(f"--init-from {path}: the checkpoint has a head of its own; training uses the target's")
    state = drafter.state_dict()
    for key, value in source.state_dict().items():
        if key.startswith("layers."):
            i, rest = key.split(".", 2)[1:]
            key = f"layers.{places[int(i)]}.{rest}"
        state[key] = value.float()
    for j in set(range(n)) - set(places):
        for name in ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight"):
            if f"layers.{j}.{name}" in state:
                state[f"layers.{j}.{name}"].zero_()
    with torch.no_grad():
        drafter.load_state_dict(state)


# ---- the batched training forward ---------------------------------------------------------------------------------


def block_forward(drafter: DFlashDrafter, features: torch.Tensor, anchors: torch.Tensor,
                  block_embeds: torch.Tensor) -> torch.Tensor:
    """Many blocks per sequence in one pass, with DFlashDrafter's own weights.
    features (S, L, F): the target's features at positions 0..L-1; anchors (S, N): each block's first position
    (the known token); block_embeds (S, N*B, hidden). Returns the normed hidden states (S, N*B, hidden).
    Block j's queries see context positions < anchors[j] and the slots of block j (all of them, or those up to
    their own under causal attention), within the sliding window on sliding layers: the inference visibility."""
    S, L, _ = features.shape
    N, B = anchors.shape[1], drafter.block_size
    NB, dev, dtype = N * B, features.device, block_embeds.dtype
    context = drafter.hidden_norm(drafter.fc(features.to(dtype)))
    ctx_pos = torch.arange(L, device=dev)
    slot = torch.arange(B, device=dev)
    blk_pos = (anchors[:, :, None] + slot).reshape(S, NB)
    cos_c, sin_c = drafter.rotary(ctx_pos, dtype)
    cos_b, sin_b = drafter.rotary(blk_pos.reshape(-1), dtype)
    cos_b, sin_b = cos_b.view(S, 1, NB, -1), sin_b.view(S, 1, NB, -1)
    q_anchor = anchors.repeat_interleave(B, dim=1)[:, :, None]  # (S, NB, 1)
    ctx_vis = ctx_pos[None, None, :] < q_anchor  # (S, NB, L)
    q_block, q_slot = torch.arange(N, device=dev).repeat_interleave(B), slot.repeat(N)
    same = q_block[:, None] == q_block[None, :]
    vis_by_kind = {False: same, True: same & (q_slot[None, :] <= q_slot[:, None])}
    key_pos = torch.cat([ctx_pos.expand(S, L), blk_pos], dim=1)[:, None, :]  # (S, 1, L + NB)
    x = block_embeds
    for layer in drafter.layers:
        attn = layer.self_attn
        vis = torch.cat([ctx_vis, vis_by_kind[layer.causal].expand(S, NB, NB)], dim=-1)
        if layer.sliding_window is not None:
            q = blk_pos[:, :, None]
            vis = vis & (q - key_pos < layer.sliding_window) & (key_pos - q < layer.sliding_window)
        h = layer.input_layernorm(x)
        d, heads, kvh = attn.head_dim, attn.heads, attn.kv_heads
        q = rope(attn.q_norm(attn.q_proj(h).view(S, NB, heads, d)).transpose(1, 2), cos_b, sin_b)
        kb = rope(attn.k_norm(attn.k_proj(h).view(S, NB, kvh, d)).transpose(1, 2), cos_b, sin_b)
        vb = attn.v_proj(h).view(S, NB, kvh, d).transpose(1, 2)
        kc = rope(attn.k_norm(attn.k_proj(context).view(S, L, kvh, d)).transpose(1, 2), cos_c, sin_c)
        vc = attn.v_proj(context).view(S, L, kvh, d).transpose(1, 2)
        k, v = torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=vis[:, None], enable_gqa=heads != kvh)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(S, NB, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


def grouped_block_forward(drafter: DFlashDrafter, features: torch.Tensor, anchors: torch.Tensor,
                          block_embeds: torch.Tensor, groups: int) -> torch.Tensor:
    """block_forward over `groups` sub-batches of sequences sorted by reach, each cut to the context its blocks can
    see (positions before its latest anchor): the same result, in the same order. One padded batch costs its widest
    sequence times the batch in the drafter's context projections and attention; with the extra set's agent prompts
    (up to 4,096 tokens) in most batches of 32 sequences, that was 5.8x the mean length (3,163 against 549 tokens)."""
    S = features.shape[0]
    if groups <= 1 or S <= 1:
        return block_forward(drafter, features, anchors, block_embeds)
    reach = anchors.max(dim=1).values  # a block at anchor a sees context positions < a
    order = torch.argsort(reach)
    widths = reach[order].cpu()  # one sync for the step, not one per group
    parts = []
    for idx, w in zip(order.tensor_split(groups), widths.tensor_split(groups)):
        if idx.numel():
            width = max(1, int(w.max()))
            parts.append(block_forward(drafter, features[idx, :width], anchors[idx], block_embeds[idx]))
    return torch.cat(parts)[torch.argsort(order)]


# ---- batches and the loss -----------------------------------------------------------------------------------------


@dataclass
class Frozen:
    """The target's frozen embedding and head (rows of the draft vocabulary), and target id -> draft id."""
    embed: torch.Tensor  # (V, hidden)
    head: torch.Tensor  # (V_draft, hidden)
    t2d: torch.Tensor  # (V,) long: draft index, or -1 outside the draft vocabulary


def frozen_parts(target, draft_vocab: torch.Tensor | None, dtype: torch.dtype) -> Frozen:
    """The target's embedding and head (cut to the draft vocabulary, if any) in `dtype`, on the target's device."""
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    vocab, device = embed.shape[0], embed.device
    if draft_vocab is None:
        return Frozen(embed=embed.to(dtype), head=head.to(dtype), t2d=torch.arange(vocab, device=device))
    ids = draft_vocab.to(device).long()
    t2d = torch.full((vocab,), -1, dtype=torch.long, device=device)
    t2d[ids] = torch.arange(ids.shape[0], device=device)
    return Frozen(embed=embed.to(dtype), head=head[ids].to(dtype), t2d=t2d)


def make_blocks(data: td.FeatureSet, seqs: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int,
                corruption: str, need_final: bool, gen: torch.Generator | None, on_path_only: bool = False) -> dict:
    """Block inputs and targets for blocks starting at `anchors` (S, N) of sequences `seqs` (S,).
    on_path_only: a masked slot is a training target only while every masked slot before it in the block holds the
    target's greedy token (see --labels)."""
    batch = data.gather(seqs, need_final)
    S, N, B = anchors.shape[0], anchors.shape[1], block_size
    L = batch["tokens"].shape[1]
    pos = anchors[:, :, None] + torch.arange(B, device=anchors.device)  # (S, N, B) absolute positions of the slots
    inside = pos < batch["lengths"][:, None, None]  # a real token sits at that position
    flat = pos.clamp(max=L - 1).view(S, -1)
    real = batch["tokens"].gather(1, flat).view(S, N, B)
    masked = torch.ones_like(inside)
    if corruption == "uniform":
        rate = torch.rand((S, N, 1), generator=gen, device=anchors.device)
        masked = torch.rand((S, N, B), generator=gen, device=anchors.device) < rate
        force = torch.randint(1, B, (S, N, 1), generator=gen, device=anchors.device)  # at least one masked slot
        masked = masked | (torch.arange(B, device=anchors.device) == force)
    masked = (masked | ~inside)
    masked[..., 0] = False
    ids = torch.where(masked, torch.full_like(real, mask_id), real)
    label_pos = (pos - 1).clamp(0, L - 1).view(S, -1)  # the target's prediction for slot k is made at position pos-1
    labels = batch["argmax"].gather(1, label_pos).view(S, N, B)
    valid = masked & inside
    if on_path_only:
        # Slot k's label is the target's choice after the real tokens of slots 1..k-1. Where one of those is hidden
        # (masked) and is not the greedy token, the label belongs to a path the drafter cannot see and the engine
        # never takes: with responses sampled at 0.7, about half of slot 4's labels (measured on SmolLM2).
        off_path = masked & inside & (real != labels)
        off_path[..., 0] = False
        off_before = torch.cumsum(off_path.int(), dim=-1) - off_path.int()
        valid = valid & (off_before == 0)
    out = {"ids": ids, "anchors": anchors, "features": batch["features"], "labels": labels, "valid": valid}
    out["valid"][..., 0] = False
    if need_final:
        final = batch["final"]
        out["final"] = final.gather(1, label_pos[:, :, None].expand(-1, -1, final.shape[-1])).view(S, N, B, -1)
    return out


def position_weights(block_size: int, decay: float, device) -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for draft slot k = 1..B-1; slot 0 (the known token) weighs 0."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / decay)
    w[0] = 0.0
    return w


def block_loss(drafter, frozen: Frozen, blocks: dict, loss: str, weights: torch.Tensor, input_scale: float = 1.0,
               length_groups: int = 1):
    """(weighted mean loss, per-slot correct counts (B,), per-slot counts (B,))."""
    S, N, B = blocks["ids"].shape
    embeds = F.embedding(blocks["ids"].view(S, N * B), frozen.embed)
    if input_scale != 1.0:
        embeds = embeds * input_scale
    hidden = grouped_block_forward(drafter, blocks["features"], blocks["anchors"], embeds,
                                   length_groups).view(S, N, B, -1)
    sel = blocks["valid"]
    h = hidden[sel]
    slot = torch.arange(B, device=h.device).expand(S, N, B)[sel]
    logits = F.linear(h, frozen.head).float()
    labels = frozen.t2d[blocks["labels"][sel]]  # draft ids; -1: outside the draft vocabulary
    w = weights[slot]
    logq = torch.log_softmax(logits, dim=-1)
    if loss == "ce":
        per = -logq.gather(1, labels.clamp_min(0)[:, None])[:, 0]
        w = w * (labels >= 0)  # a label the draft vocabulary cannot express teaches nothing
    else:
        tlogits = F.linear(blocks["final"][sel].to(frozen.head.dtype), frozen.head).float()
        logp = torch.log_softmax(tlogits, dim=-1)
        per = (logp.exp() * (logp - logq)).sum(-1)
    value = (w * per).sum() / w.sum().clamp_min(1e-9)
    correct = (logits.argmax(-1) == labels).float()
    hits = torch.zeros(B, device=h.device).index_add_(0, slot, correct)
    counts = torch.zeros(B, device=h.device).index_add_(0, slot, torch.ones_like(correct))
    return value, hits, counts


@dataclass
class WalkAnchors:
    """Per sequence, the block starts greedy decoding visits (walk_anchor_table), flattened: sequence s's are
    flat[offsets[s]:offsets[s] + counts[s]]; counts[s] == 0 where none were walked."""
    flat: torch.Tensor  # (A,) long, absolute positions
    offsets: torch.Tensor  # (n,) long
    counts: torch.Tensor  # (n,) long


def sample_batch(data: td.FeatureSet, counts: torch.Tensor, n_seqs: int, anchors_per_seq: int,
                 gen: torch.Generator, walk: WalkAnchors | None = None,
                 walk_fraction: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences drawn in proportion to their number of block starts (every block start equally likely), and
    `anchors_per_seq` uniform block starts in each one's response; with `walk`, each start is instead one of its
    sequence's walked anchors with probability `walk_fraction` (where it has any)."""
    dev = counts.device
    seqs = torch.multinomial(counts.float().cpu(), n_seqs, replacement=True, generator=gen).to(dev)
    u = torch.rand((n_seqs, anchors_per_seq), generator=gen).to(dev)
    anchors = data.prompt_lens[seqs][:, None] + (u * counts[seqs][:, None]).long()
    if walk is not None and walk_fraction > 0:
        pick = torch.rand((n_seqs, anchors_per_seq), generator=gen).to(dev) < walk_fraction
        n_walk = walk.counts[seqs][:, None]
        idx = walk.offsets[seqs][:, None] + (u * n_walk).long().clamp_max((n_walk - 1).clamp_min(0))
        walked = walk.flat[idx.clamp_max(max(walk.flat.shape[0] - 1, 0))] if walk.flat.numel() else anchors
        anchors = torch.where(pick & (n_walk > 0), walked, anchors)
    return seqs, anchors
