"""The training-time estimates (tau_est, tau_walk) of saved drafters on the held-out responses, on any device: the
figures `reviewer train` prints after training, for drafters made elsewhere (an average of two, a shipped one).

The held-out prompts are the ones `reviewer train` holds out (the same order and --max-heldout); their greedy responses
come from a responses file of an earlier run (`--responses`), so nothing is generated: the target only computes the
features (fp32), and each drafter is scored on the same blocks (`backend.train.evaluate.estimate_acceptance`, full corruption)
and walked through the responses as greedy decoding would go (`backend.train.evaluate.walk_acceptance`: the blocks decoding
visits; `--walk-prompts 48 --walk-max-tokens 128` walks the prompts `bench/train_eval_heldout.py --prompts 48
--max-tokens 128` decodes). `--seen N` also walks N training prompts (a seeded sample of the main + extra sets), the
responses a drafter trained on: tau_walk there against tau_walk held out is the generalization gap, and tau_walk there
is what the drafter can do on sequences it has fitted.

    .venv/bin/python bench/train_estimate.py --drafter runs/L runs/X runs/S --responses responses.jsonl.gz \
        --json bench/results/train_estimate_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--drafter", nargs="+", required=True, type=Path)
    ap.add_argument("--responses", required=True, help="responses file(s) of an earlier run, comma-separated")
    ap.add_argument("--max-heldout", type=int, default=96)
    ap.add_argument("--walk-prompts", type=int, default=None, help="walk only the first N held-out prompts")
    ap.add_argument("--walk-max-tokens", type=int, default=None, help="cut each response at N tokens for the walk")
    ap.add_argument("--seen", type=int, default=0, metavar="N",
                    help="also walk N training prompts (seeded sample): tau_walk on responses the drafter trained on")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    from backend.train import run as T
    from backend.train import evaluate
    from backend.train import config
    from backend.train import objective
    from backend.train import data as td
    from backend.dflash.checkpoint import load_drafter
    from backend.loading import load_model

    loaded = load_model(a.model, device="cpu", dtype="float32")
    target = loaded.model
    held = [r for r in T.load_records(config.TrainConfig(max_heldout=a.max_heldout)) if r.split == "heldout"]
    given = td.load_responses([Path(p) for p in a.responses.split(",")], loaded.name)
    seen = []
    if a.seen:  # training prompts with a response (a prompt past the length limit has none)
        train = [r for r in T.load_records(config.TrainConfig(builtin_extra=True)) if r.split == "train" and r.id in given]
        seen = random.Random(0).sample(train, min(a.seen, len(train)))
    missing = [r.id for r in held if r.id not in given]
    if missing:
        raise SystemExit(f"{len(missing)} held-out prompts have no response in {a.responses} (e.g. {missing[0]})")
    drafters = [load_drafter(d) for d in a.drafter]
    layer_ids = drafters[0].cfg.target_layer_ids
    if any(d.cfg.target_layer_ids != layer_ids for d in drafters):
        raise SystemExit("the drafters read different target layers: score them in separate runs")
    with tempfile.TemporaryDirectory() as tmp:
        td.prepare_data(target, loaded.tokenizer, held + seen, Path(tmp), target_name=loaded.name,
                        layer_ids=layer_ids, max_new_tokens=192, max_prompt_tokens=4096, gen_batch=8, given=given,
                        log=lambda m: None)
        data = td.load_features(Path(tmp), "heldout", "cpu")
        seen_data = td.load_features(Path(tmp), "train", "cpu") if seen else None
    # the held-out prompts in the order `reviewer train` (and bench/train_eval_heldout.py) takes them
    walked = sorted(range(len(data)), key=lambda i: data.index[i])[:a.walk_prompts]
    results = {}
    for path, drafter in zip(a.drafter, drafters):
        drafter.float()
        frozen = objective.frozen_parts(target, drafter.draft_vocab, torch.float32)
        est = evaluate.estimate_acceptance(drafter, frozen, data, drafter.block_size, drafter.mask_token_id)
        est["walk"] = evaluate.walk_acceptance(drafter, frozen, data, drafter.block_size, drafter.mask_token_id,
                                        max_tokens=a.walk_max_tokens, which=walked)
        line = (f"{path}: tau_est {est['tau_est']:.3f} over {est['blocks']} blocks, acceptance "
                + " ".join(f"{x:.3f}" for x in est["acceptance_est"][:4])
                + f"; tau_walk {est['walk']['tau_walk']:.3f} over {est['walk']['cycles']} cycles")
        if seen_data is not None:
            est["walk_seen"] = evaluate.walk_acceptance(drafter, frozen, seen_data, drafter.block_size,
                                                 drafter.mask_token_id, max_tokens=a.walk_max_tokens)
            line += (f"; on {len(seen_data)} training prompts tau_walk {est['walk_seen']['tau_walk']:.3f} "
                     f"over {est['walk_seen']['cycles']} cycles")
        results[str(path)] = est
        print(line)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "benchmark": "train_estimate", "command": " ".join([Path(sys.executable).name] + sys.argv),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "torch": torch.__version__},
            "model": loaded.name, "heldout_sequences": len(data),
            "seen_prompts": [r.id for r in seen], "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
