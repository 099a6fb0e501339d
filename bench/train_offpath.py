"""How far sampled training responses stray from the target's greedy path (the measurement behind `--labels on-path`).

For responses in a responses file (`reviewer train` writes one per data run), run the target over prompt + response
and count (1) response tokens equal to the target's argmax at their position and (2) for a block anchored at every
response position, the share of draft slots k whose label is still on the greedy path, i.e. whose response tokens at
slots 1..k-1 are all argmax tokens. A slot off that path carries a label the drafter (which sees only masks there)
cannot tie to its input, and the engine never needs.

    .venv/bin/python bench/train_offpath.py --responses responses.jsonl.gz --sampled 30 --greedy 10 \
        --json bench/results/train_offpath_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def on_path_shares(match: list[bool], block_size: int) -> tuple[list[int], list[int]]:
    """(on-path counts, slot counts) per draft slot 1..block_size-1 over blocks anchored at every position."""
    on, seen = [0] * block_size, [0] * block_size
    for a in range(len(match)):
        still = True
        for k in range(1, block_size):
            if a + k >= len(match):
                break
            seen[k] += 1
            on[k] += still
            still = still and match[a + k]
    return on[1:], seen[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--responses", type=Path, required=True, help="a responses.jsonl(.gz) of that target")
    ap.add_argument("--sampled", type=int, default=30, help="sampled responses to check (ids with '~')")
    ap.add_argument("--greedy", type=int, default=10, help="greedy responses to check")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    import torch

    from backend.train import data as td

    from backend.train import prompts as tp
    from backend.loading import load_model

    loaded = load_model(a.model, device="cpu")
    records = {r.id: r for r in tp.load_builtin()}
    responses = td.load_responses([a.responses], loaded.name)
    rng = random.Random(a.seed)
    groups = {"sampled": sorted(i for i in responses if "~" in i), "greedy": sorted(i for i in responses if "~" not in i)}
    result = {}
    for name, ids in groups.items():
        ids = [i for i in ids if i.split("~")[0] in records]
        chosen = rng.sample(ids, min(len(ids), getattr(a, name)))
        equal = total = 0
        on, seen = [0] * (a.block_size - 1), [0] * (a.block_size - 1)
        for rid in chosen:
            prompt = td.render(loaded.tokenizer, records[rid.split("~")[0]])
            response = responses[rid]
            with torch.no_grad():
                argmax = loaded.model(torch.tensor([prompt + response])).logits[0].argmax(-1)
            predicted = argmax[len(prompt) - 1: len(prompt) - 1 + len(response)].tolist()
            match = [t == p for t, p in zip(response, predicted)]
            equal, total = equal + sum(match), total + len(match)
            o, s = on_path_shares(match, a.block_size)
            on, seen = [x + y for x, y in zip(on, o)], [x + y for x, y in zip(seen, s)]
        result[name] = {"responses": len(chosen), "tokens": total, "argmax_share": equal / max(total, 1),
                        "on_path_share_by_slot": [x / max(y, 1) for x, y in zip(on, seen)]}
        print(f"{name}: {len(chosen)} responses, {total} tokens, {equal / max(total, 1):.3f} equal the target's argmax; "
              "labels on the greedy path at slots 1-8: "
              + " ".join(f"{x / max(y, 1):.2f}" for x, y in zip(on[:8], seen[:8])))
    result.update({"command": " ".join([Path(sys.executable).name] + sys.argv),
                   "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "machine": {"platform": platform.platform(), "torch": torch.__version__},
                   "model": loaded.name, "responses_file": str(a.responses)})
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
