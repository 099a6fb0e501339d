"""Claims against measurements: `import PACKAGE` and each console script's `--help`, timed in fresh interpreters
(median of repeats), against the thresholds in thresholds.py. A slow import is worse when the docs call the package
light, fast or instant: the finding quotes where."""

from __future__ import annotations

from reviewer import stats
from reviewer.persona.probes import doctext, prelude
from reviewer.persona.probes.runner import Probe, command, data, run, script
from reviewer.persona.probes.thresholds import (CLI_REPEATS, CLI_START_SLOW_S, IMPORT_REPEATS, IMPORT_SLOW_MS,
                                                SPEED_CLAIM)
from reviewer.persona.project import EVIDENCE_CHARS
from reviewer.text import tail

# Each figure is the wall time of one fresh interpreter doing it, after one warm-up run that writes the .pyc files.
IMPORT_BODY = """
import subprocess
code = "import time; t = time.perf_counter(); import " + PACKAGE + "; print(time.perf_counter() - t)"
samples = []
for i in range(REPEATS + 1):
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        emit({"error": (p.stdout + p.stderr)[-1500:]})
        sys.exit(2)
    if i:
        samples.append(float(p.stdout.strip().splitlines()[-1]) * 1000)
ms = median(samples)
emit({"ms": ms, "samples": samples})
sys.exit(1 if ms > LIMIT_MS else 0)
"""

CLI_BODY = """
import subprocess
results = {}
for name in SCRIPTS:
    samples = []
    for i in range(REPEATS + 1):
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
sys.exit(1 if any(r["s"] > LIMIT_S for r in results.values()) else 0)
"""


def import_script(package: str) -> str:
    head = f"PACKAGE = {package!r}\nREPEATS = {IMPORT_REPEATS}\nLIMIT_MS = {IMPORT_SLOW_MS!r}\n"
    return script(head + IMPORT_BODY, prelude.emit, stats.median)


def cli_script(names: list[str]) -> str:
    head = f"SCRIPTS = {data(names)}\nREPEATS = {CLI_REPEATS}\nLIMIT_S = {CLI_START_SLOW_S!r}\n"
    return script(head + CLI_BODY, prelude.emit, stats.median)


def speed_claims(probe: Probe) -> list[str]:
    return doctext.claims(probe.sentences(), SPEED_CLAIM)


def probe_timing(probe: Probe, import_ms: float | None = None) -> None:
    claims = None
    if probe.package:
        if import_ms is None:  # not measured by smoke (the probe called as a tool): measure it here
            got, _, _ = run(probe, f"probe: time `import {probe.package}`", import_script(probe.package), 300)
            import_ms = (got or {}).get("ms")
        if import_ms is not None and import_ms > IMPORT_SLOW_MS:
            claims = speed_claims(probe)
            said = ("; the docs say:\n" + "\n".join(claims[:3])) if claims else ""
            probe.record(title=f"`import {probe.package}` takes {import_ms / 1000:.1f} s",
                         severity="high" if claims else "medium", category="performance",
                         details=f"Importing the package takes {import_ms:.0f} ms (median of {IMPORT_REPEATS} fresh "
                                 f"interpreters), over the {IMPORT_SLOW_MS:.0f} ms every user of it then pays at "
                                 f"each start{said}",
                         evidence=f"import time median {import_ms:.1f} ms; threshold {IMPORT_SLOW_MS:.0f} ms",
                         repro_command=command(import_script(probe.package)))
    names = sorted(probe.scripts)
    if not names:
        return
    got, res, _ = run(probe, "probe: time `--help` of the console scripts", cli_script(names), 120 + 60 * len(names))
    for name, r in ((got or {}).get("scripts") or {}).items():
        probe.measure(name=f"CLI start-up ({name} --help)", value=round(r["s"], 4), unit="s",
                      command=f"{name} --help", repeats=len(r["samples"]),
                      spread=round(stats.spread(r["samples"]), 3), samples=[round(x, 4) for x in r["samples"]])
        if r["s"] > CLI_START_SLOW_S:
            claims = speed_claims(probe) if claims is None else claims
            probe.record(title=f"`{name} --help` takes {r['s']:.1f} s to answer", severity="medium" if claims else "low",
                         category="performance",
                         details=f"The console script needs {r['s']:.2f} s (median of {len(r['samples'])}) just to "
                                 f"print its help, over the {CLI_START_SLOW_S:g} s a user at the prompt notices"
                                 + ("; the docs say:\n" + "\n".join(claims[:3]) if claims else "."),
                         evidence=tail(res.output, EVIDENCE_CHARS), repro_command=command(cli_script([name])))
