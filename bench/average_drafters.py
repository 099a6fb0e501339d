"""Average the weights of drafters of one lineage (a "model soup"): the shipped drafter is the mean of the one it
replaced and that one's fine-tune on more prompts (docs/training.md), which kept what each was better at.

Every float tensor is averaged element-wise in fp32 and stored in its own dtype; the rest (the draft vocabulary's
d2t / t2d maps) must be equal in all of them. config.json comes from the first drafter; the shapes and the
vocabulary must match, or nothing is written.

    .venv/bin/python bench/average_drafters.py runs/L runs/X --out runs/S
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch


def average(state_dicts: list[dict[str, torch.Tensor]], weights: list[float] | None = None) -> dict[str, torch.Tensor]:
    """The weighted mean of float tensors (equal weights by default); other tensors must be identical."""
    weights = weights or [1.0 / len(state_dicts)] * len(state_dicts)
    first = state_dicts[0]
    for i, sd in enumerate(state_dicts[1:], start=2):
        if sd.keys() != first.keys():
            raise ValueError(f"drafter {i} has other tensors than drafter 1: {sorted(sd.keys() ^ first.keys())[:4]}")
        for k, v in sd.items():
            if v.shape != first[k].shape:
                raise ValueError(f"{k}: shape {tuple(v.shape)} in drafter {i}, {tuple(first[k].shape)} in drafter 1")
            if not v.is_floating_point() and not torch.equal(v, first[k]):
                raise ValueError(f"{k} differs (a different draft vocabulary?): only drafters of one lineage average")
    out = {}
    for k, v in first.items():
        if v.is_floating_point():
            out[k] = sum(w * sd[k].float() for w, sd in zip(weights, state_dicts)).to(v.dtype)
        else:
            out[k] = v.clone()
    return out


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import load_file, save_file

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafters", nargs="+", type=Path, help="drafter folders (config.json + model.safetensors)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--weights", default=None, help="comma-separated mixing weights (default: equal)")
    a = ap.parse_args(argv)
    if len(a.drafters) < 2:
        ap.error("give at least two drafters")
    weights = [float(w) for w in a.weights.split(",")] if a.weights else None
    if weights is not None and (len(weights) != len(a.drafters) or abs(sum(weights) - 1) > 1e-6):
        ap.error("--weights: one per drafter, adding up to 1")
    for d in a.drafters:
        if not (d / "model.safetensors").is_file() or not (d / "config.json").is_file():
            ap.error(f"{d}: no config.json + model.safetensors")
    configs = [json.loads((d / "config.json").read_text()) for d in a.drafters]
    if any(c != configs[0] for c in configs[1:]):
        ap.error("the drafters' config.json differ: only drafters of one shape average")
    try:
        merged = average([load_file(str(d / "model.safetensors")) for d in a.drafters], weights)
    except ValueError as e:
        ap.error(str(e))
    a.out.mkdir(parents=True, exist_ok=True)
    save_file(merged, str(a.out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(a.drafters[0] / "config.json", a.out / "config.json")
    (a.out / "provenance.json").write_text(json.dumps({
        "source": "average of " + ", ".join(str(d) for d in a.drafters),
        "weights": weights or [1.0 / len(a.drafters)] * len(a.drafters),
        "parents": {str(d): json.loads((d / "provenance.json").read_text()) if (d / "provenance.json").is_file()
                    else None for d in a.drafters}}, indent=1) + "\n")
    print(f"wrote {a.out} ({(a.out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
