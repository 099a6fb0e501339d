"""tau of a drafter measured by the real speculative engine on held-out prompts of the built-in set (the reviewer's
workload), with the plain-vs-speculative identity check: the same evaluation `reviewer train` runs after training,
for a drafter trained elsewhere (here: the shipped one, trained on the H200, measured on this CPU).

    .venv/bin/python bench/train_eval_heldout.py --drafter backend/drafters/SmolLM2-135M-Instruct-DFlash \
        --prompts 16 --max-tokens 128 --json bench/results/train_shipped_heldout_cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--drafter", default="backend/drafters/SmolLM2-135M-Instruct-DFlash")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--category", default=None, help="only held-out prompts of this category (agent, readme, ...)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain run (no identity check, faster)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    import torch

    from backend.train import data as td

    from backend.train import prompts as tp
    from backend.loading import load_model
    from backend.chat import stop_token_ids
    from backend.train.evaluate import evaluate_engine

    loaded = load_model(a.model, device=a.device)
    # the held-out prompts in the order `reviewer train` takes them (sha256 of the id), first N
    held = sorted((r for r in tp.load_builtin() if r.split == "heldout" and a.category in (None, r.category)),
                  key=lambda r: hashlib.sha256(r.id.encode()).hexdigest())[: a.prompts]
    if not held:
        raise SystemExit(f"no held-out prompts of category {a.category!r}")
    prompts = [td.render(loaded.tokenizer, r) for r in held]
    res = evaluate_engine(loaded.model, Path(a.drafter), prompts, a.max_tokens,
                          stop_token_ids(loaded.tokenizer, loaded.model.generation_config), check_plain=not a.no_plain)
    res.update({"command": " ".join([Path(sys.executable).name] + sys.argv),
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                            "load_average": os.getloadavg()},
                "model": loaded.name, "drafter": a.drafter, "categories": [r.category for r in held]})
    by_category: dict[str, list[int]] = {}  # category -> [prompts, cycles, accepted draft tokens]
    for cat, (_, cycles, accepted) in zip(res["categories"], res["per_prompt"]):
        total = by_category.setdefault(cat, [0, 0, 0])
        total[0] += 1
        total[1] += cycles
        total[2] += accepted
    res["tau_by_category"] = {cat: {"prompts": n, "cycles": c, "tau": round((acc + c) / c, 3) if c else None}
                              for cat, (n, c, acc) in sorted(by_category.items())}
    print(json.dumps({k: v for k, v in res.items() if k not in ("categories", "per_prompt")}, indent=1))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
