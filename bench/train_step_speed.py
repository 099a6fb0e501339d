"""Drafter training step time with `--length-groups` 1 (one padded batch) against sub-batches of similar length, on
the real length mix of the training set: the shipped drafter's shape, a step's 32 sequences drawn as `reviewer train`
draws them (in proportion to their block starts), 16 blocks in each, forward + backward of the drafter's block pass.

The lengths are the real ones (the built-in prompts, rendered, plus their responses from a responses file of an
earlier run); the features are random (timing does not depend on their values). Every configuration runs on the same
batches, interleaved round by round, so the ratios are side by side.

    .venv/bin/python bench/train_step_speed.py --responses responses.jsonl.gz --device cpu --steps 3 \
        --json bench/results/train_step_speed_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHIPPED = Path(__file__).resolve().parents[1] / "backend/drafters/SmolLM2-135M-Instruct-DFlash"


def training_lengths(responses: str, max_prompt_tokens: int, extra: bool, model: str) -> list[tuple[int, int]]:
    """(sequence length, prompt length) of every training sequence `reviewer train` would make from these responses."""
    from backend.train import run as T
    from backend.train import config
    from backend.train import data as td
    from backend.loading import load_model

    loaded = load_model(model, device="cpu", dtype="float32")
    given = td.load_responses([Path(p) for p in responses.split(",")], loaded.name)
    out = []
    for r in T.load_records(config.TrainConfig(builtin_extra=extra)):
        if r.split != "train":
            continue
        p = len(td.render(loaded.tokenizer, r))
        if p > max_prompt_tokens:
            continue
        out += [(p + len(given[rid]), p) for rid in (r.id, *(f"{r.id}~{k}" for k in range(1, 9))) if rid in given]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--responses", required=True, help="responses file(s) of an earlier run, comma-separated")
    ap.add_argument("--no-extra", action="store_true", help="the main prompt set only (not --builtin-extra)")
    ap.add_argument("--model", default="embedded", help="the target (only its tokenizer is used): 'embedded' or a .gguf")
    ap.add_argument("--drafter", type=Path, default=SHIPPED)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--groups", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one warm-up round)")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--max-prompt-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile", action="store_true",
                    help="after timing, profile one more step per configuration and print where its time went")
    a = ap.parse_args()
    from backend.train import objective
    from backend.dflash.checkpoint import load_drafter

    groups = [int(g) for g in a.groups.split(",")]
    lengths = training_lengths(a.responses, a.max_prompt_tokens, not a.no_extra, a.model)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    drafter = load_drafter(a.drafter).float().to(dev).train()
    width = len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size
    rng = random.Random(a.seed)
    starts = [n - p - 1 for n, p in lengths]

    def batch():
        picked = rng.choices(lengths, weights=starts, k=a.seqs)
        L = max(n for n, _ in picked)
        anchors = torch.tensor([[p + rng.randrange(n - p - 1) for _ in range(a.anchors)] for n, p in picked])
        feats = torch.randn(a.seqs, L, width, device=dev, dtype=torch.bfloat16 if cuda else torch.float32)
        embeds = torch.randn(a.seqs, a.anchors * drafter.block_size, drafter.cfg.hidden_size, device=dev)
        return feats, anchors.to(dev), embeds, sum(n for n, _ in picked) / a.seqs

    def step(feats, anchors, embeds, g) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            out = objective.grouped_block_forward(drafter, feats, anchors, embeds, g)
        out.float().square().mean().backward()
        drafter.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def context_rows(anchors, g) -> int:  # what grouped_block_forward feeds the drafter's context path
        reach = anchors.max(dim=1).values.sort().values.cpu()
        return sum(part.numel() * int(part.max()) for part in reach.tensor_split(g) if part.numel())

    times = {g: [] for g in groups}
    rows = {g: [] for g in groups}
    padded, mean_len = [], []
    for r in range(a.steps + 1):  # round 0 warms up
        feats, anchors, embeds, mean = batch()
        for g in groups:
            dt = step(feats, anchors, embeds, g)
            if r:
                times[g].append(dt)
                rows[g].append(context_rows(anchors, g))
        if r:
            padded.append(feats.shape[1])
            mean_len.append(mean)
        print(f"round {r}: width {feats.shape[1]}, " + ", ".join(f"groups {g} {times[g][-1] * 1e3:.0f} ms"
                                                            for g in groups if r), flush=True)
    if a.profile:  # the H200 ran sub-batches slower than one batch (train_step_speed_h200.json): find where it goes
        from torch.profiler import ProfilerActivity, profile

        feats, anchors, embeds, _ = batch()
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        for g in groups:
            step(feats, anchors, embeds, g)  # this width once unprofiled: the table shows the steady state
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                dt = step(feats, anchors, embeds, g)
            print(f"profile, groups {g} (width {feats.shape[1]}, {dt * 1e3:.0f} ms):")
            print(prof.key_averages().table(sort_by=sort, row_limit=12), flush=True)
    ms = {g: 1e3 * sum(t) / len(t) for g, t in times.items()}
    result = {"benchmark": "train_step_speed", "command": " ".join([Path(sys.executable).name] + sys.argv),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "torch": torch.__version__, "device": str(dev),
                          "gpu": torch.cuda.get_device_name(dev) if cuda else None},
              "drafter": str(a.drafter), "training_sequences": len(lengths), "seqs_per_step": a.seqs,
              "blocks_per_seq": a.anchors, "mean_padded_width": sum(padded) / len(padded),
              "mean_sequence_length": sum(mean_len) / len(mean_len),
              "context_rows_per_step": {str(g): round(sum(v) / len(v)) for g, v in rows.items()},
              "ms_per_step": {str(g): round(v, 1) for g, v in ms.items()},
              "speedup_vs_one_batch": {str(g): round(ms[groups[0]] / v, 2) for g, v in ms.items()},
              "per_step_ms": {str(g): [round(1e3 * t, 1) for t in ts] for g, ts in times.items()}}
    print(json.dumps({k: result[k] for k in ("mean_padded_width", "mean_sequence_length", "context_rows_per_step",
                                             "ms_per_step",
                                             "speedup_vs_one_batch")}))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
