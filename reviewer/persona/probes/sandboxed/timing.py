"""Claims against measurements, timed inside the sandbox: `import PACKAGE` and each console script's `--help`, in
fresh interpreters. Each figure is the wall time of one fresh interpreter doing it, after one warm-up run that writes
the .pyc files; the median of `repeats` is judged against the limit."""

from __future__ import annotations

import subprocess
import sys
import time
from statistics import median

from .prelude import emit


def import_time(package, repeats, limit_ms):
    code = "import time; t = time.perf_counter(); import " + package + "; print(time.perf_counter() - t)"
    samples = []
    for i in range(repeats + 1):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            emit({"error": (p.stdout + p.stderr)[-1500:]})
            return 2
        if i:
            samples.append(float(p.stdout.strip().splitlines()[-1]) * 1000)
    ms = median(samples)
    emit({"ms": ms, "samples": samples})
    return 1 if ms > limit_ms else 0


def cli_start(scripts, repeats, limit_s):
    results = {}
    for name in scripts:
        samples = []
        for i in range(repeats + 1):
            t = time.perf_counter()
            try:
                subprocess.run([name, "--help"], capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                break
            if i:
                samples.append(time.perf_counter() - t)
        if samples:
            results[name] = {"s": median(samples), "samples": samples}
    emit({"scripts": results})
    return 1 if any(r["s"] > limit_s for r in results.values()) else 0
