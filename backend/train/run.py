"""`reviewer train`: train a DFlash drafter for a target on the target's own outputs.

    backend.train.run.main(model="embedded", out=Path("runs/smol"), loss="kl", attention="mixed", steps=2000)
    python -m backend.train --model embedded --out runs/smol --loss kl --attention mixed --steps 2000

Pipeline: prompts (built-in set and/or --from-db transcripts) -> the target's greedy responses -> the target's features
in shards (backend/train/data.py) -> training -> a z-lab checkpoint in --out (config.json + model.safetensors, what
dflash.model.load_drafter and the engine load) -> evaluation: the training-time estimate of the accepted length on
held-out features, and tau measured by the real speculative engine on held-out prompts.

The drafter is backend.dflash.model.DFlashDrafter; the target's embedding and LM head are used frozen (the drafter has
none of its own). Training runs many blocks per sequence in one forward (`block_forward`): every block's queries see
the context features before its anchor and its own block, which is exactly what DFlashDrafter.block_hidden computes
at inference for one block (tests/backend/train/test_train.py checks the two agree).

Knobs (all on the command line): loss `ce` (labels = the target's argmax) or `kl` (to the target's distribution),
position weight w_k = exp(-(k-1)/decay); block attention `mixed` | `bidirectional` | `causal`; corruption `full`
(every slot but the first masked, as at inference) or `uniform` (each block masks a random fraction r ~ U(0,1) of
its slots; loss on masked slots only); labels `on-path` (a slot trains only while the hidden tokens before it are the
target's greedy choices) or `all`; block size, layers, MLP width, target layers, restricted vocabulary top-K, seed;
`--init-from` a saved drafter.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.decoding.engine import Engine, SamplingParams
from backend.dflash.model import (BLOCK_ATTENTION_MODES, DFlashDrafter, DrafterConfig, build_draft_vocab, load_drafter,
                                  rope, save_drafter)
from backend.loading import ModelLoadError, load_model
from backend.train import data as td

LOSSES = ("kl", "ce")
CORRUPTIONS = ("full", "uniform")
LABELS = ("on-path", "all")
STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.json"
# knobs that must not change when a run is resumed (the rest: steps, time limit, logging, evaluation)
ARCH_KNOBS = ("loss", "decay", "attention", "corruption", "block_size", "layers", "intermediate_size", "target_layers",
              "vocab_top_k", "sliding_window", "mask_token_id", "batch_blocks", "anchors_per_seq", "lr", "seed",
              "labels", "walk_anchors")
# what a run saved before a knob existed trained with (resuming such a run must not trip over the new knob)
KNOB_BEFORE_IT_EXISTED = {"labels": "all", "walk_anchors": 0.0}


class TrainError(ValueError):
    """A user mistake (bad option, unusable output folder): reported as one line, no traceback."""


@dataclass
class TrainConfig:
    model: str = "embedded"
    out: str = ""
    device: str = "auto"
    dtype: str = "float32"  # the target's dtype while generating data and features
    # data
    builtin_prompts: bool = True
    builtin_extra: bool = False
    from_db: str | None = None
    max_prompts: int = 0  # 0: all training prompts
    max_heldout: int = 96
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 256
    samples_per_prompt: int = 0  # sampled responses per training prompt, beside the greedy one
    sample_temperature: float = 0.8
    gen_batch: int = 64
    gen_tokens: int = 1 << 18
    data_dir: str | None = None
    data_only: bool = False
    responses: str | None = None
    responses_only: bool = False
    # drafter
    layers: int = 3
    intermediate_size: int = 1536
    block_size: int = 16
    target_layers: str = "auto"
    vocab_top_k: int = 0
    sliding_window: int = 0
    mask_token_id: int = -1
    # training
    loss: str = "kl"
    decay: float = 7.0
    attention: str = "mixed"
    corruption: str = "full"
    labels: str = "on-path"
    init_from: str | None = None
    steps: int = 2000
    batch_blocks: int = 512
    anchors_per_seq: int = 16
    walk_anchors: float = 0.0
    length_groups: int = 1
    lr: float = 1e-3
    seed: int = 0
    time_limit: float = 0.0
    save_every: int = 500
    log_every: int = 25
    resume: bool = False
    # evaluation
    eval_prompts: int = 16
    eval_max_tokens: int = 128
    eval_check_plain: bool = False


# One line of help per option: the argparse CLI below and `reviewer train` (typer) both use it.
OPTION_HELP = {
    "model": "Target: 'embedded' (SmolLM2-135M-Instruct), a Hugging Face folder or a .gguf file.",
    "out": "Output folder: the drafter (config.json + model.safetensors, z-lab format), train_state.pt, metrics.json "
           "[default: runs/dflash-<target name>].",
    "device": "auto, cpu or cuda.",
    "dtype": "The target's dtype while it writes responses and features: float32, bfloat16 or auto.",
    "builtin_prompts": "The built-in prompt set (backend/prompts/builtin.jsonl) is used unless --no-builtin-prompts.",
    "builtin_extra": "Also the extra built-in training prompts (backend/prompts/builtin_extra.jsonl.gz: 9,135 code "
                     "review, debugging, performance, agent, README and coding prompts on code and docs the main set "
                     "does not quote; training split only, so the held-out prompts and their figures stay the same).",
    "from_db": "Also learn the review loop's own workload: prompts from the transcripts in this reviews.db.",
    "max_prompts": "At most this many training prompts (0: all).",
    "max_heldout": "At most this many held-out prompts (features for the estimate; the first --eval-prompts of them "
                   "for the engine).",
    "max_prompt_tokens": "Skip prompts longer than this (tokens).",
    "max_new_tokens": "Length cap of the target's greedy responses (tokens).",
    "samples_per_prompt": "Also this many sampled responses per training prompt (beside the greedy one): more, and "
                          "more varied, contexts from the target's own distribution (held-out prompts stay greedy).",
    "sample_temperature": "Temperature of those sampled responses.",
    "gen_batch": "Prompts per batch while the target generates its responses.",
    "gen_tokens": "Cache positions per generation batch (its prompts' tokens plus their response caps): long prompts "
                  "batch fewer. Raise it with --gen-batch on a big GPU (fp32 SmolLM2: ~46 KB per position).",
    "data_dir": "Where the response/feature shards go; reused when target, layers and prompts match "
                "[default: <out>/data].",
    "data_only": "Generate the responses and features, then stop.",
    "responses": "Reuse responses generated earlier: comma-separated responses.jsonl files, gzipped ones too (or "
                 "data dirs holding one; every run writes <data-dir>/responses.jsonl). Prompts and sample rounds they "
                 "cover are not generated again; the target must be the same model.",
    "responses_only": "Generate the responses, write <data-dir>/responses.jsonl and stop (no features, no training): "
                      "e.g. on a CPU, for a GPU run to reuse with --responses.",
    "layers": "Drafter layers (the last one full attention, the others sliding-window layers).",
    "intermediate_size": "Drafter MLP width (its hidden size is the target's: it shares the target's embedding and "
                         "LM head).",
    "block_size": "Block size: the known token plus block_size-1 drafted tokens.",
    "target_layers": "Target layers whose outputs the drafter reads: 'auto' (5 spread over the depth) or e.g. "
                     "'1,8,14,21,28'.",
    "vocab_top_k": "Restrict the draft vocabulary to the K tokens the target emits most (0: the full vocabulary).",
    "sliding_window": "Sliding window of the sliding layers, in positions (0: none).",
    "mask_token_id": "Token id used for masked block slots (-1: the last id of the vocabulary).",
    "loss": "kl (to the target's distribution) or ce (labels = the target's argmax).",
    "decay": "Position weight w_k = exp(-(k-1)/decay) for draft position k.",
    "attention": "Attention inside the block: mixed (causal on sliding layers, bidirectional on full), "
                 "bidirectional or causal.",
    "corruption": "full (mask every slot but the first, as at inference) or uniform (mask a random fraction).",
    "labels": "Which drafted slots a block learns from: on-path (slot k counts only while the masked response tokens "
              "before it in the block are the target's own greedy choices: a sampled response leaves the greedy path, "
              "and a drafter that sees only masks cannot know where, while the engine only ever extends the greedy "
              "path) or all.",
    "init_from": "Start from this drafter's weights (a checkpoint folder, e.g. the shipped one) instead of random "
                 "ones: fine-tune it on more data, new prompts (--from-db) or other knobs. Its shape (MLP width, "
                 "target layers, block size) must match the run's; a restricted vocabulary in it is not kept. More "
                 "--layers than it has: the new layers go before its last one with their outputs at zero, so the "
                 "run starts from the same drafts.",
    "steps": "Optimizer steps.",
    "batch_blocks": "Blocks per step.",
    "anchors_per_seq": "Blocks per sequence in a step (sequences per step = batch_blocks / anchors_per_seq).",
    "walk_anchors": "Share of each step's blocks anchored where greedy decoding with the drafter as the run starts "
                    "(--init-from or --resume) anchors them: right after a draft miss, the blocks tau_walk and the "
                    "engine measure, harder than the evenly spread rest. Walked on the greedy responses (the engine's "
                    "path) when the run starts; sampled responses keep uniform anchors. 0: all uniform.",
    "length_groups": "Run a step's sequences in this many sub-batches of similar length, each padded only to its own "
                     "longest context (the same loss and gradients as one batch; 1: one batch). Faster on a CPU (2.2x "
                     "at 4), slower on the H200 (0.37x at 4): see docs/training.md.",
    "lr": "Peak learning rate (AdamW; linear warm-up over the first twentieth of the steps, then cosine down to a tenth).",
    "seed": "Seed of the initialization and of the batch sampling.",
    "time_limit": "Stop training once the run has trained this many seconds in all, earlier sessions of a resumed "
                  "run included (0: no limit); the checkpoint is saved.",
    "save_every": "Save a checkpoint every this many steps.",
    "log_every": "Log loss and per-position accuracy every this many steps (the progress bar on a terminal).",
    "resume": "Continue the run in --out from its last checkpoint, up to --steps.",
    "eval_prompts": "Held-out prompts decoded by the real speculative engine after training (0: skip).",
    "eval_max_tokens": "Tokens per held-out prompt in that evaluation.",
    "eval_check_plain": "Also decode the held-out prompts without the drafter and check the output is identical.",
}


def _log(msg: str) -> None:
    print(msg, flush=True)


# ---- the drafter --------------------------------------------------------------------------------------------------


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
        sliding_window=cfg.sliding_window or None, block_attention=cfg.attention,
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


# ---- evaluation ---------------------------------------------------------------------------------------------------


def _accepted_runs(drafter, frozen: Frozen, data: td.FeatureSet, seqs: torch.Tensor, starts: torch.Tensor,
                   block_size: int, mask_id: int, autocast: bool) -> torch.Tensor:
    """For blocks of sequences `seqs` (S,) anchored at `starts` (S, A) (fully masked, as at inference): how many
    leading drafted tokens equal the target's argmax (slots past the end of a response count as rejections)."""
    blocks = make_blocks(data, seqs, starts, block_size, mask_id, "full", False, None)
    S, A = starts.shape
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        embeds = F.embedding(blocks["ids"].view(S, -1), frozen.embed)
        hidden = block_forward(drafter, blocks["features"], blocks["anchors"], embeds)
        logits = F.linear(hidden, frozen.head).float().view(S, A, block_size, -1)
    labels = frozen.t2d[blocks["labels"]]
    inside = blocks["valid"] | (torch.arange(block_size, device=starts.device) == 0)
    correct = (logits.argmax(-1) == labels) & inside
    return correct[..., 1:].int().cumprod(-1).sum(-1)


def _runs_of(drafter, frozen: Frozen, data: td.FeatureSet, s: int, starts: torch.Tensor, block_size: int,
             mask_id: int, autocast: bool) -> torch.Tensor:
    """_accepted_runs for one sequence: (A,) runs."""
    seqs = torch.full((1,), s, device=starts.device, dtype=torch.long)
    return _accepted_runs(drafter, frozen, data, seqs, starts[None], block_size, mask_id, autocast)[0]


def _walk(runs: list[int], n: int) -> list[tuple[int, int]]:
    """Greedy decoding's cycles over a response of n tokens, given runs[j] = the accepted drafts of a block
    anchored at response token j: (anchor j, drafts accepted) per cycle. The first token comes from the prefill;
    the cycle's last token is the target's own (the bonus), so the drafts can fill at most the tokens left but one:
    that is how the engine counts a cycle that reaches the end."""
    cycles, j = [], 0
    while j < n - 1:
        k = min(runs[j], n - 2 - j)
        cycles.append((j, k))
        j += k + 1
    return cycles


@torch.no_grad()
def estimate_acceptance(drafter, frozen: Frozen, data: td.FeatureSet, block_size: int, mask_id: int,
                        max_anchors_per_seq: int = 64, autocast: bool = False) -> dict:
    """Training-time estimate on held-out features, full corruption (as at inference): for each block start, how
    many leading drafted tokens equal the target's argmax. tau_est = 1 + mean accepted; acceptance[k] = P(accepted
    > k). Slots past the end of a response count as rejections."""
    drafter.eval()
    dev = data.tokens.device
    accepted_all = []
    counts = data.anchor_counts()
    for s in range(len(data)):
        c = int(counts[s])
        if c <= 0:
            continue
        step = max(1, c // max_anchors_per_seq)
        starts = torch.arange(0, c, step, device=dev)[:max_anchors_per_seq] + data.prompt_lens[s]
        accepted_all.append(_runs_of(drafter, frozen, data, s, starts, block_size, mask_id, autocast))
    drafter.train()
    if not accepted_all:
        return {"tau_est": None, "acceptance_est": [], "blocks": 0}
    acc = torch.cat(accepted_all).float()
    return {"tau_est": 1.0 + float(acc.mean()), "blocks": int(acc.shape[0]),
            "acceptance_est": [float((acc > k).float().mean()) for k in range(block_size - 1)]}


@torch.no_grad()
def walk_acceptance(drafter, frozen: Frozen, data: td.FeatureSet, block_size: int, mask_id: int,
                    max_tokens: int | None = None, which: list[int] | None = None, autocast: bool = False,
                    chunk: int = 64) -> dict:
    """tau as greedy decoding with this drafter would measure it on the held-out responses (greedy, so they are what
    decoding produces), without running the engine: the first response token comes from the prefill; a block
    anchored at a known token accepts its leading run of correct drafts, then the target's own next token follows and
    anchors the next block. These are the anchors decoding visits: each right after a draft miss, harder on average
    than tau_est's evenly spread ones. max_tokens cuts each response as the engine's max_tokens would; `which`: the
    sequences to walk (default all). per_sequence: [tokens, cycles, accepted] each, as the engine's per_prompt."""
    drafter.eval()
    dev = data.tokens.device
    lengths = data.lengths
    cycles = accepted = 0
    per_position = [0] * (block_size - 1)
    per_sequence = []
    for s in range(len(data)) if which is None else which:
        n = int(lengths[s] - data.prompt_lens[s])  # response tokens
        if max_tokens is not None:
            n = min(n, max_tokens)
        if n <= 1:
            per_sequence.append([n, 0, 0])
            continue
        first = int(data.prompt_lens[s])
        starts = torch.arange(first, first + n - 1, device=dev)
        runs = torch.cat([_runs_of(drafter, frozen, data, s, part, block_size, mask_id, autocast)
                          for part in starts.split(chunk)]).tolist()
        walked = _walk(runs, n)
        c, a = len(walked), sum(k for _, k in walked)
        for _, k in walked:
            for p in range(k):
                per_position[p] += 1
        cycles, accepted = cycles + c, accepted + a
        per_sequence.append([n, c, a])
    drafter.train()
    if not cycles:
        return {"tau_walk": None, "cycles": 0, "acceptance_walk": [], "per_sequence": per_sequence}
    return {"tau_walk": (accepted + cycles) / cycles, "cycles": cycles,
            "acceptance_walk": [c / cycles for c in per_position], "per_sequence": per_sequence}


@torch.no_grad()
def walk_anchor_table(drafter, frozen: Frozen, data: td.FeatureSet, block_size: int, mask_id: int,
                      which: list[int], autocast: bool = False, blocks_per_call: int = 4096) -> WalkAnchors:
    """The block starts greedy decoding with this drafter visits in each sequence of `which` (the walk of
    walk_acceptance, over whole responses), for --walk-anchors. Sequences are batched by similar length, every
    response position scored in one pass per batch."""
    drafter.eval()
    dev = data.tokens.device
    n_resp = (data.lengths - data.prompt_lens).tolist()
    first = data.prompt_lens.tolist()
    found: dict[int, list[int]] = {}
    todo = sorted((s for s in which if n_resp[s] > 1), key=lambda s: n_resp[s])
    i = 0
    while i < len(todo):
        group = [todo[i]]
        while i + len(group) < len(todo) and (len(group) + 1) * (n_resp[todo[i + len(group)]] - 1) <= blocks_per_call:
            group.append(todo[i + len(group)])
        width = n_resp[group[-1]] - 1  # sorted: the last is the longest
        rel = torch.arange(width, device=dev)[None, :]
        lim = torch.tensor([n_resp[s] - 2 for s in group], device=dev)[:, None]
        starts = torch.tensor([first[s] for s in group], device=dev)[:, None] + torch.minimum(rel, lim)
        seqs = torch.tensor(group, device=dev)
        runs = _accepted_runs(drafter, frozen, data, seqs, starts, block_size, mask_id, autocast).tolist()
        for row, s in enumerate(group):
            found[s] = [first[s] + j for j, _ in _walk(runs[row][: n_resp[s] - 1], n_resp[s])]
        i += len(group)
    drafter.train()
    counts = torch.tensor([len(found.get(s, [])) for s in range(len(data))], dtype=torch.long)
    offsets = torch.cumsum(counts, 0) - counts
    flat = torch.tensor([a for s in range(len(data)) for a in found.get(s, [])], dtype=torch.long)
    return WalkAnchors(flat=flat.to(dev), offsets=offsets.to(dev), counts=counts.to(dev))


def evaluate_engine(target, drafter_dir: Path, prompts: list[list[int]], max_tokens: int, stops: tuple[int, ...],
                    check_plain: bool = False) -> dict:
    """tau and per-position acceptance from the real speculative engine (backend.decoding.engine) with the saved
    checkpoint, greedy, on held-out prompts; optionally the plain engine's output for the identity check."""

    drafter = load_drafter(drafter_dir)
    engine = Engine(target, drafter=drafter)
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stops)
    list(engine.generate(prompts[0][:8], SamplingParams(max_tokens=4, stop_token_ids=stops)))  # warm-up
    outs, stats = [], []
    t0 = time.perf_counter()
    for p in prompts:
        outs.append([t for block in engine.generate(p, params) for t in block])
        stats.append(engine.last_stats)
    wall = time.perf_counter() - t0
    cycles = sum(s.cycles for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    width = drafter.block_size - 1
    per_pos = [sum(s.accepted_per_position[k] for s in stats if k < len(s.accepted_per_position)) for k in range(width)]
    tokens = sum(s.generated_tokens for s in stats)
    res = {"prompts": len(prompts), "max_tokens": max_tokens, "tokens": tokens, "cycles": cycles,
           "tau": (accepted + cycles) / cycles if cycles else None,
           "acceptance": [c / cycles for c in per_pos] if cycles else [],
           "tok_s": tokens / wall, "draft_ms": 1e3 * sum(s.draft_seconds for s in stats) / max(cycles, 1),
           "verify_ms": 1e3 * sum(s.verify_seconds for s in stats) / max(cycles, 1),
           # per prompt, so that tau can be split by category: [generated tokens, cycles, accepted draft tokens]
           "per_prompt": [[s.generated_tokens, s.cycles, s.accepted_tokens] for s in stats]}
    if check_plain:
        plain = Engine(target, exact=engine.target.exact if engine.fast else None)  # the same numerics
        t0 = time.perf_counter()
        ref = [[t for block in plain.generate(p, params) for t in block] for p in prompts]
        res["plain_tok_s"] = sum(map(len, ref)) / (time.perf_counter() - t0)
        res["identical_to_plain"] = ref == outs
        res["identical_prompts"] = sum(a == b for a, b in zip(ref, outs))
    return res


# ---- checkpoints --------------------------------------------------------------------------------------------------


def save_checkpoint(drafter: DFlashDrafter, out: Path, state: dict) -> None:
    """The drafter in the z-lab format (bf16 weights: what the engine loads) and the training state beside it
    (fp32 master weights, optimizer, step, history), each written to a temporary name and renamed into place."""
    copy = DFlashDrafter(drafter.cfg)
    copy.load_state_dict(drafter.state_dict())
    copy.to(torch.bfloat16)
    if drafter.draft_vocab is not None:
        copy.restrict_vocab(drafter.draft_vocab.cpu(), drafter.cfg.vocab_size)
    tmp = out / ".saving"
    save_drafter(copy, tmp)
    for name in ("config.json", "model.safetensors"):
        (tmp / name).replace(out / name)
    tmp.rmdir()
    torch.save(state, out / (STATE_FILE + ".tmp"))
    (out / (STATE_FILE + ".tmp")).replace(out / STATE_FILE)


def _lr_at(step: int, cfg: TrainConfig) -> float:
    warmup = max(1, cfg.steps // 20)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))  # cosine to a tenth


class Progress:
    """A rich progress bar on a terminal; plain log lines every `every` steps otherwise (CI, logs, the GPU box)."""

    def __init__(self, total: int, start: int, every: int):
        self.every, self.bar = every, None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            self.bar = Bar(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                           TextColumn("{task.fields[info]}"), transient=False)
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, step: int, info: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif step % self.every == 0:
            _log(f"step {step:>6}  {info}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# ---- main ---------------------------------------------------------------------------------------------------------


def _check(cfg: TrainConfig) -> None:
    choices = {"loss": LOSSES, "attention": BLOCK_ATTENTION_MODES, "corruption": CORRUPTIONS, "labels": LABELS,
               "device": ("auto", "cpu", "cuda"), "dtype": ("auto", "float32", "bfloat16")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise TrainError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, not {getattr(cfg, name)!r}")
    positive = ("layers", "intermediate_size", "steps", "batch_blocks", "anchors_per_seq", "length_groups",
                "max_new_tokens", "gen_batch", "gen_tokens", "save_every", "log_every", "max_prompt_tokens")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise TrainError(f"--{name.replace('_', '-')} must be positive")
    if cfg.block_size < 2:
        raise TrainError("--block-size must be at least 2 (the known token plus one draft)")
    if cfg.decay <= 0 or cfg.lr <= 0:
        raise TrainError("--decay and --lr must be positive")
    if not 0.0 <= cfg.walk_anchors <= 1.0:
        raise TrainError("--walk-anchors must be between 0 and 1")
    if cfg.samples_per_prompt < 0 or cfg.sample_temperature <= 0:
        raise TrainError("--samples-per-prompt must be >= 0 and --sample-temperature positive")
    if not cfg.builtin_prompts and not cfg.builtin_extra and not cfg.from_db:
        raise TrainError("no prompts: keep the built-in set or give --from-db reviews.db")


def load_records(cfg: TrainConfig) -> list[td.PromptRecord]:
    import hashlib

    records = ((td.load_builtin() if cfg.builtin_prompts else [])
               + (td.load_builtin(td.BUILTIN_EXTRA) if cfg.builtin_extra else [])
               + (td.load_from_db(cfg.from_db) if cfg.from_db else []))
    order = sorted(records, key=lambda r: hashlib.sha256(r.id.encode()).hexdigest())  # stable, category-mixed
    train = [r for r in order if r.split == "train"]
    held = [r for r in order if r.split == "heldout"]
    if cfg.max_prompts:
        train = train[: cfg.max_prompts]
    if not train:
        raise TrainError("the prompt sources gave no training prompts")
    return train + held[: cfg.max_heldout]


def main(**knobs) -> dict:
    """Train (or resume) a drafter; returns the metrics also written to <out>/metrics.json."""
    unknown = set(knobs) - {f.name for f in fields(TrainConfig)}
    if unknown:
        raise TypeError(f"unknown options: {sorted(unknown)}")
    cfg = TrainConfig(**{k: (str(v) if isinstance(v, Path) else v) for k, v in knobs.items()})
    _check(cfg)

    t_start = time.perf_counter()
    loaded = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    target, tokenizer, device = loaded.model, loaded.tokenizer, torch.device(loaded.device)
    target.requires_grad_(False)
    out = Path(cfg.out or f"runs/dflash-{loaded.name}")
    if (out / STATE_FILE).is_file() and not cfg.resume:
        raise TrainError(f"{out} holds a training run already: pass --resume to continue it, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    n_layers = target.config.get_text_config().num_hidden_layers
    layer_ids = parse_layer_ids(cfg.target_layers, n_layers)
    records = load_records(cfg)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else out / "data"
    given = td.load_responses([Path(p) for p in cfg.responses.split(",") if p], loaded.name) if cfg.responses \
        else None
    if given:
        _log(f"data: {len(given)} responses from earlier runs ({cfg.responses})")
    t0 = time.perf_counter()
    manifest = td.prepare_data(target, tokenizer, records, data_dir, target_name=loaded.name, layer_ids=layer_ids,
                               max_new_tokens=cfg.max_new_tokens, max_prompt_tokens=cfg.max_prompt_tokens,
                               gen_batch=cfg.gen_batch, gen_tokens=cfg.gen_tokens, samples=cfg.samples_per_prompt,
                               temperature=cfg.sample_temperature, seed=cfg.seed, given=given,
                               responses_only=cfg.responses_only, log=_log)
    data_seconds = time.perf_counter() - t0
    if cfg.responses_only:
        return manifest  # the summary: where the responses went
    if cfg.data_only:
        summary = {"data_dir": str(data_dir), "seconds": round(data_seconds, 1),
                   "splits": {s: {k: v for k, v in m.items() if k not in ("shards", "records", "categories")}
                              | {"sequences": len(m["records"])} for s, m in manifest["splits"].items()}}
        _log(json.dumps(summary))
        return summary
    train_set = td.load_features(data_dir, "train", device)
    held_set = td.load_features(data_dir, "heldout", device) if manifest["splits"]["heldout"]["shards"] else None
    _log(f"data: {len(train_set)} train sequences ({train_set.tokens.shape[0]} positions, "
         f"{int(train_set.anchor_counts().sum())} block starts), {len(held_set) if held_set else 0} held out")

    drafter = new_drafter(cfg, target, layer_ids, loaded.name)
    resuming = cfg.resume and (out / STATE_FILE).is_file()
    if cfg.init_from and not resuming:  # a resumed run continues from its own weights
        init_from_checkpoint(drafter, Path(cfg.init_from))
        _log(f"drafter: starting from the weights in {cfg.init_from}")
    vocab = target.get_input_embeddings().weight.shape[0]
    if cfg.vocab_top_k:
        drafter.restrict_vocab(build_draft_vocab(td.token_counts(train_set, vocab), cfg.vocab_top_k), vocab)
    drafter.to(device).train()
    cuda = device.type == "cuda"
    frozen = frozen_parts(target, drafter.draft_vocab, torch.bfloat16 if cuda else torch.float32)

    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, history, train_seconds = 0, [], 0.0
    state_path = out / STATE_FILE
    if resuming:
        state = torch.load(state_path, map_location=device, weights_only=False)
        changed = [k for k in ARCH_KNOBS if state["config"].get(k, KNOB_BEFORE_IT_EXISTED.get(k)) != getattr(cfg, k)]
        if changed:
            raise TrainError(f"--resume: {', '.join('--' + k.replace('_', '-') for k in changed)} differ from the run in {out}")
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["rng"].cpu())  # map_location moved it to the device
        step, history, train_seconds = state["step"], state["history"], state["train_seconds"]
        _log(f"resumed {out} at step {step}")
    weights = position_weights(cfg.block_size, cfg.decay, device)
    counts = train_set.anchor_counts()
    walk = None
    if cfg.walk_anchors > 0:
        t0 = time.perf_counter()
        records = manifest["splits"]["train"]["records"]
        greedy = [i for i, r in enumerate(train_set.index) if "~" not in records[r]]  # "<id>~k": sampled
        walk = walk_anchor_table(drafter, frozen, train_set, cfg.block_size, drafter.cfg.mask_token_id, greedy,
                                 autocast=cuda)
        n_walked = int(walk.counts.sum())
        _log(f"walk anchors: {n_walked} block starts greedy decoding visits in {len(greedy)} greedy responses "
             f"(tau_walk {int(counts[greedy].sum()) / max(n_walked, 1):.2f} on them), "
             f"{time.perf_counter() - t0:.0f} s")
    n_seqs = max(1, cfg.batch_blocks // cfg.anchors_per_seq)
    need_final = cfg.loss == "kl"
    mask_id = drafter.cfg.mask_token_id

    def state_dict() -> dict:
        return {"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "rng": gen.get_state(), "step": step,
                "history": history, "train_seconds": train_seconds, "config": asdict(cfg)}

    progress = Progress(cfg.steps, step, cfg.log_every)
    window = {"loss": 0.0, "n": 0, "hits": torch.zeros(cfg.block_size, device=device),
              "counts": torch.zeros(cfg.block_size, device=device)}
    t_loop = time.perf_counter() - train_seconds
    stopped_early = False
    try:
        while step < cfg.steps:
            if cfg.time_limit and time.perf_counter() - t_loop > cfg.time_limit:
                stopped_early = True
                break
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, cfg)
            seqs, anchors = sample_batch(train_set, counts, n_seqs, cfg.anchors_per_seq, gen, walk, cfg.walk_anchors)
            blocks = make_blocks(train_set, seqs, anchors, cfg.block_size, mask_id, cfg.corruption, need_final,
                                 torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + step),
                                 on_path_only=cfg.labels == "on-path")
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss, hits, n = block_loss(drafter, frozen, blocks, cfg.loss, weights,
                                           length_groups=cfg.length_groups)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            step += 1
            window["loss"] += float(loss.detach())
            window["n"] += 1
            window["hits"] += hits
            window["counts"] += n
            if step % cfg.log_every == 0 or step == cfg.steps:
                acc = (window["hits"] / window["counts"].clamp_min(1)).tolist()[1:]
                history.append({"step": step, "loss": window["loss"] / window["n"], "acc": [round(a, 4) for a in acc],
                                "seconds": round(time.perf_counter() - t_loop, 1)})
                window = {"loss": 0.0, "n": 0, "hits": torch.zeros_like(window["hits"]),
                          "counts": torch.zeros_like(window["counts"])}
                progress.update(step, f"loss {history[-1]['loss']:.3f}  acc@1..4 "
                                      + " ".join(f"{a:.2f}" for a in acc[:4]))
            else:
                progress.update(step, "")
            if step % cfg.save_every == 0 and step < cfg.steps:
                train_seconds = time.perf_counter() - t_loop
                save_checkpoint(drafter, out, state_dict())
    finally:
        progress.close()
    train_seconds = time.perf_counter() - t_loop
    save_checkpoint(drafter, out, state_dict())
    _log(f"trained {step} steps in {train_seconds:.0f} s; drafter in {out}")

    metrics = {"command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "config": asdict(cfg), "target": loaded.name, "target_layer_ids": layer_ids,
               "device": torch.cuda.get_device_name() if cuda else "cpu",
               "data": {k: manifest["splits"][s].get(k) for s in ("train",) for k in ("prompt_tokens", "response_tokens")}
               | {"train_sequences": len(train_set), "heldout_sequences": len(held_set) if held_set else 0,
                  "seconds": round(data_seconds, 1)},
               "budget": {"steps": step, "blocks_per_step": n_seqs * cfg.anchors_per_seq,
                          "blocks_seen": step * n_seqs * cfg.anchors_per_seq, "stopped_by_time_limit": stopped_early},
               "train_seconds": round(train_seconds, 1), "history": history,
               "params_m": round(sum(p.numel() for p in drafter.parameters()) / 1e6, 2),
               "checkpoint_mb": round((out / "model.safetensors").stat().st_size / 2**20, 2)}
    if held_set is not None:
        metrics["estimate"] = estimate_acceptance(drafter, frozen, held_set, cfg.block_size, mask_id, autocast=cuda)
        metrics["walk"] = walk_acceptance(drafter, frozen, held_set, cfg.block_size, mask_id, autocast=cuda)
        walk = metrics["walk"]["tau_walk"]
        _log(f"held-out estimate: tau_est {metrics['estimate']['tau_est']:.2f} over {metrics['estimate']['blocks']} blocks"
             + (f"; tau_walk {walk:.2f} (the blocks decoding visits, {metrics['walk']['cycles']} cycles)" if walk else ""))
        if cfg.eval_prompts:
            n = min(cfg.eval_prompts, len(held_set))
            prompts = [held_set.tokens[held_set.offsets[i]: held_set.offsets[i] + held_set.prompt_lens[i]].tolist()
                       for i in range(n)]
            metrics["engine"] = evaluate_engine(target, out, prompts, cfg.eval_max_tokens,
                                                tuple(manifest.get("stop_ids", ())), cfg.eval_check_plain)
            e = metrics["engine"]
            _log(f"engine on {n} held-out prompts: tau {e['tau']:.2f}, acceptance "
                 + " ".join(f"{a:.2f}" for a in e["acceptance"][:8])
                 + (f", identical to plain: {e['identical_to_plain']}" if "identical_to_plain" in e else ""))
    metrics["total_seconds"] = round(time.perf_counter() - t_start, 1)
    (out / METRICS_FILE).write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


# ---- command line (python -m backend.train; `reviewer train` calls main with the same options) ----------------


def cli(argv: list[str] | None = None, prog: str = "python -m backend.train") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        text = OPTION_HELP[f.name]
        if f.type in ("bool", bool):
            if f.name == "builtin_prompts":
                ap.add_argument("--no-builtin-prompts", dest=f.name, action="store_false", help=text)
            else:
                ap.add_argument(flag, action="store_true", help=text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            ap.add_argument(flag, type=kind, default=f.default,
                            help=text + ("" if f.default in (None, "") else f" [default: {f.default}]"))
    a = ap.parse_args(argv)

    try:
        main(**vars(a))
    except (TrainError, td.DataError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
