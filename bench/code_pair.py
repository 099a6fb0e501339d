"""`reviewer bench` on two checkouts of the code, interleaved in one run: a before/after check that a refactor left
decoding speed and output alone (a CPU check, not a product figure). Each round runs the same `reviewer bench`
command once per checkout (the order alternates: A B, B A, ...), each in its own process with PYTHONPATH at that
checkout, and the record keeps every run's headline numbers and output tokens, the medians per side, the after /
before ratios, and whether the two sides generated the same tokens.

    python bench/code_pair.py --before /work/main --after . --rounds 2 -- \
        --model embedded --drafter auto --device cpu --prompts 3 --max-tokens 32 --adaptive off

Record: bench/results/code_pair-<label>-<date>.json ("benchmark": "code_pair")."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from backend.bench.report import cpu_model

HEADLINE = ("decode_tok_s", "tok_s", "tau", "T_d_ms", "T_t_ms", "rollback_ms", "host_ms_per_cycle", "cycle_ms",
            "identical", "identical_of", "tokens")


def commit_of(root: Path) -> str:
    proc = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return proc.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def run_once(root: Path, bench_args: list[str], out: Path) -> dict:
    """One `reviewer bench` in a fresh process on `root`'s code; its record."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "reviewer.cli", "bench", *bench_args, "--json-out", str(out)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"reviewer bench failed on {root} (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def headline(record: dict) -> dict:
    return {name: {k: r[k] for k in HEADLINE if k in r} | {"outputs": r.get("outputs")}
            for name, r in record["runs"].items()}


def medians(runs: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for name in runs[0]:
        for key in ("decode_tok_s", "tok_s", "T_d_ms", "T_t_ms", "host_ms_per_cycle", "cycle_ms"):
            values = [r[name][key] for r in runs if isinstance(r[name].get(key), (int, float))]
            if values:
                out.setdefault(name, {})[key] = statistics.median(values)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="checkout of the code before the change")
    ap.add_argument("--after", type=Path, required=True, help="checkout of the code after the change")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each runs both checkouts once (default 2)")
    ap.add_argument("--label", default="refactor", help="names the record file")
    ap.add_argument("--what", default="CPU check of a refactor: same command on both checkouts; not a product figure")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the `reviewer bench` options")
    args = ap.parse_args(argv)
    bench_args = [a for a in args.bench_args if a != "--"]
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    records: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
            for side in order:
                record = run_once(sides[side], bench_args, Path(tmp) / f"{side}_{i}.json")
                records[side] = record
                runs[side].append(headline(record))
                print(f"round {i + 1} {side}: " + ", ".join(
                    f"{n} {r.get('decode_tok_s', r.get('tok_s', 0)):.1f} tok/s" for n, r in runs[side][-1].items()),
                    flush=True)
    med = {side: medians(runs[side]) for side in runs}
    ratio = {name: {k: med["after"][name][k] / med["before"][name][k] for k in med["after"][name]
                    if med["before"].get(name, {}).get(k)} for name in med["after"]}
    same = all(a[name]["outputs"] == b[name]["outputs"] for a, b in zip(runs["before"], runs["after"]) for name in a)
    now = datetime.now(UTC)
    result = {
        "benchmark": "code_pair", "what": args.what,
        "command": " ".join([sys.executable, *sys.argv]), "bench_command": "reviewer bench " + " ".join(bench_args),
        "date": now.isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model() or "unknown CPU", "cpus": os.cpu_count(),
                    "load_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "prompts_chosen": "reviewer bench's own: the first N of backend/bench/run.py PROMPTS (coding-assistant prompts "
                          "like the personas'), each in the model's chat template, greedy",
        "before": {"root": str(sides["before"]), "commit": commit_of(sides["before"])},
        "after": {"root": str(sides["after"]), "commit": commit_of(sides["after"])},
        "model": records["after"].get("model"), "engine": records["after"].get("engine"),
        "rounds": args.rounds, "runs": runs, "median": med, "ratio_after_over_before": ratio,
        "same_tokens_both_sides": same,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"code_pair-{args.label}-{now:%Y%m%d}.json" if args.out.suffix != ".json" else args.out
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"same tokens on both sides: {same}; ratios after/before: "
          + ", ".join(f"{n} {r.get('decode_tok_s', r.get('tok_s', float('nan'))):.3f}" for n, r in ratio.items()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
