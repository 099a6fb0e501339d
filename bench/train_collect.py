"""Assemble bench/results/train_ablation_h200*.json and docs/training_loss.png from the files the H200 runs sent back.

2026-11-30: two calls on one warm machine, each writing a whole ablation.json: the arms (`--skip-long`) and the long
run (`--long-arm best`, reading the arms' metrics from the same --work). This script joins them with the command lines,
the data summary from the first call's log and the device time the calls used:

    .venv/bin/python bench/train_collect.py join /work/drafter_long/h200_call2 /work/drafter_long/h200_call3 \
        --out bench/results/train_ablation_h200_20261130.json --device-seconds 816

The 2026-11-29 run did not end cleanly (the four CE arms ran out of GPU memory with 8 runs at once, and the long run's
final evaluation was cut by the command's time limit), so its results came back in three parts: the KL arms and the
data manifest (partial.json), the CE arms rerun 4 at a time on the same data (ce.json), and the long run's training
state (long_state.json). This script joins them; bench/train_ablation.py writes the same layout in one piece when a
run ends normally.

    .venv/bin/python bench/train_collect.py /work/.device/6 /work/.device/7
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.train_ablation import ARMS, arm_summary, plot_curves  # noqa: E402


def collect_20261129(first: Path, second: Path) -> None:
    partial = json.loads((first / "partial.json").read_text())
    runs = {k: v for k, v in partial.items() if k.split("-s")[0] in ARMS}
    runs.update(json.loads((second / "ce.json").read_text()))
    result = {"command": "python bench/train_ablation.py --model SmolLM2-135M-Instruct.gguf --device cuda "
                         "--arm-steps 150 --parallel 8 --deadline 480 --max-new-tokens 192 --gen-batch 512 "
                         "--eval-prompts 12 --ship-eval-prompts 32  (CE arms rerun with --parallel 4)",
              "machine": "NVIDIA H200 (device tool), torch 2.11, transformers 5.17, target in float32, drafter "
                         "training in bf16 autocast",
              "data": {"manifest": partial["data_manifest"],
                       "splits": {s: {k: v for k, v in m.items() if k not in ("shards", "categories")}
                                  for s, m in partial["data_splits"].items()}},
              "arms": {}, "notes": []}
    for name in ARMS:
        result["arms"][name] = [runs[f"{name}-s{s}"] for s in (0, 1) if f"{name}-s{s}" in runs]
    result["summary"] = {name: arm_summary(r) for name, r in result["arms"].items()}
    long = json.loads((first / "long_state.json").read_text())
    result["long"] = {"arm": "{loss}_{attention}_{corruption}".format(**long["config"]), "steps": long["step"],
                      "planned_steps": long["config"]["steps"], "train_seconds": round(long["train_seconds"], 1),
                      "config": long["config"], "history": long["history"],
                      "estimate_tau_est": 3.01}  # printed by the run ("held-out estimate: tau_est 3.01")
    result["notes"] = [
        "Equal budget per arm: 150 steps x 512 blocks of 16 = 76,800 blocks (~0.25 epoch of 302,547 block starts).",
        "At this budget no arm separates from the others: every engine tau lies in 1.19-1.28 and the seed-to-seed "
        "spread is as large as the gaps between arms.",
        "The long run picked kl_mixed_uniform (highest mean engine tau, 1.23 vs 1.21) and stopped at its 104 s time "
        "limit after 1819 of 3311 planned steps; its engine evaluation on the GPU was cut by the command's limit, "
        "so it was measured on the CPU instead (bench/results/train_shipped_heldout_cpu.json).",
    ]
    out = ROOT / "bench" / "results" / "train_ablation_h200.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    long_run = {"config": {**long["config"], "seed": "long"}, "history": long["history"]}
    plot_curves({"arms": {**result["arms"], "long " + result["long"]["arm"]: [long_run]}},
                ROOT / "docs" / "training_loss.png")
    for name, s in result["summary"].items():
        print(f"{name:<24} tau {s['tau']:.3f} ±{s['tau_sd']:.3f}  tau_est {s['tau_est']:.3f} ±{s['tau_est_sd']:.3f}  "
              f"by seed {[round(x, 3) for x in s['tau_by_seed']]}")
    print(f"wrote {out}")


def data_summary(log_text: str) -> dict:
    """The data step's summary line ({"data_dir": ...}) and the block-start count from a logs.txt."""
    summary = next((json.loads(line) for line in log_text.splitlines() if line.startswith('{"data_dir"')), {})
    m = re.search(r"\((\d+) positions, (\d+) block starts\)", log_text)
    if m:
        summary["train_positions"], summary["train_block_starts"] = int(m[1]), int(m[2])
    return summary


def join_calls(arms_dir: Path, long_dir: Path, out: Path, plot: Path, device_seconds: float | None) -> dict:
    arms = json.loads((arms_dir / "ablation.json").read_text())
    long = json.loads((long_dir / "ablation.json").read_text())
    if long.get("summary") != arms["summary"]:
        sys.exit("the long call did not read the same arms as the arms call (different --work?)")
    L = long["long"]
    result = {
        "date": L["date"][:10],
        "device": L["device"],
        "machine": "NVIDIA H200 (device tool, one GPU, 16 CPU cores), torch 2.11, transformers 5.17; target "
                   "SmolLM2-135M-Instruct from the embedded GGUF in float32, drafter training in bf16 autocast",
        "commands": {"arms": "python bench/train_ablation.py " + arms["command"].split(" ", 1)[1],
                     "long": "python bench/train_ablation.py " + long["command"].split(" ", 1)[1]},
        "data": data_summary((arms_dir / "logs.txt").read_text()),
        "arms": arms["arms"], "summary": arms["summary"], "ranking": arms["ranking"], "best": long["best"],
        "long_plan": long.get("long_plan"), "long": L,
        "timings_s": {"arms_call": arms["timings"], "long_call": long["timings"]},
    }
    if device_seconds is not None:
        result["device_seconds_used"] = device_seconds
    out.write_text(json.dumps(result, indent=1) + "\n")
    long_curve = {"config": {"seed": "long"}, "history": L["history"]}
    plot_curves({"arms": {**arms["arms"], f"long {long['best']} ({L['budget']['steps']} steps)": [long_curve]}}, plot)
    for name, s in result["summary"].items():
        print(f"{name:<24} tau {s['tau']:.3f} ±{s['tau_sd']:.3f}  tau_est {s['tau_est']:.3f} ±{s['tau_est_sd']:.3f}  "
              f"by seed {[round(x, 3) for x in s['tau_by_seed']]}")
    e = L.get("engine", {})
    print(f"long {long['best']}: {L['budget']['steps']} steps, {L['train_seconds']} s, tau_est "
          f"{L['estimate']['tau_est']:.3f}, engine tau {e.get('tau')}, identical {e.get('identical_to_plain')}")
    print(f"wrote {out} and {plot}")
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "join":
        ap = argparse.ArgumentParser(description="join an arms call and a long-run call of bench/train_ablation.py")
        ap.add_argument("cmd")
        ap.add_argument("arms_dir", type=Path)
        ap.add_argument("long_dir", type=Path)
        ap.add_argument("--out", type=Path, required=True)
        ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "training_loss.png")
        ap.add_argument("--device-seconds", type=float, default=None, help="device time the calls used (lease)")
        a = ap.parse_args()
        join_calls(a.arms_dir, a.long_dir, a.out, a.plot, a.device_seconds)
    else:
        collect_20261129(Path(sys.argv[1]), Path(sys.argv[2]))


if __name__ == "__main__":
    main()
