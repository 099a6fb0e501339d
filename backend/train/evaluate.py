"""How good a drafter is: the training-time estimate of the accepted length on held-out features
(`estimate_acceptance`), the walk greedy decoding takes through the responses (`walk_acceptance`, and the table of
the block starts it visits for walk-anchor training), and tau measured by the real speculative engine
(`evaluate_engine`)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.decoding.engine import Engine, SamplingParams
from backend.dflash.checkpoint import load_drafter
from backend.train import data as td
from backend.train.objective import Frozen, WalkAnchors, block_forward, make_blocks

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
