"""What the probes cost and find: `reviewer run --persona smoke` on each repository with and without `--no-probes`,
wall time of each review (install, tests and the verification of every finding included) and the findings by
category. The example project by default; give local repositories or git URLs to add others.

    .venv/bin/python bench/probes.py [REPO ...] [--out bench/results/probes.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REVIEWER = Path(sys.executable).with_name("reviewer")


def review(repo: str, probes: bool, work: Path) -> dict:
    db = work / f"reviews-{'probes' if probes else 'plain'}-{abs(hash(repo))}.db"
    cmd = [str(REVIEWER), "run", repo, "--persona", "smoke", "--db", str(db), "--json"] + ([] if probes else ["--no-probes"])
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "REVIEWER_PROBES": "true"})
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        return {"error": done.stderr[-2000:], "seconds": round(seconds, 1)}
    run = json.loads(done.stdout)["runs"][0]
    return {"seconds": round(seconds, 1), "commit": run["commit"],
            "findings": [{"category": f["category"], "severity": f["severity"], "title": f["title"],
                          "verified": f["verified"]} for f in run["findings"]],
            "measurements": {m["name"]: m["value"] for m in run["measurements"]}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repos", nargs="*", help="local repositories or git URLs (default: the example project)")
    parser.add_argument("--out", default=str(HERE / "results" / "probes.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-probes-") as tmp:
        work = Path(tmp)
        repos = args.repos
        if not repos:
            example = work / "tinystats"
            subprocess.run([sys.executable, "-m", "reviewer.examples", str(example)], check=True, capture_output=True)
            repos = [str(example)]
        results = []
        for repo in repos:
            row = {"repo": repo if "://" in repo or not Path(repo).name == "tinystats" else "examples/tinystats",
                   "with_probes": review(repo, True, work), "without_probes": review(repo, False, work)}
            results.append(row)
            print(json.dumps({"repo": row["repo"], "with": row["with_probes"].get("seconds"),
                              "without": row["without_probes"].get("seconds"),
                              "findings": len(row["with_probes"].get("findings", []))}), flush=True)
    record = {"benchmark": "probes", "command": " ".join(sys.argv), "date": datetime.datetime.now().isoformat(),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "python": platform.python_version()}, "results": results}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
