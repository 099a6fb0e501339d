"""Claims against measurements: `import PACKAGE` and each console script's `--help`, timed in fresh interpreters
(median of repeats, sandboxed/timing.py), against the thresholds in thresholds.py. A slow import is worse when the
docs call the package light, fast or instant: the finding quotes where."""

from __future__ import annotations

from reviewer import stats
from reviewer.persona.probes import doctext
from reviewer.persona.probes.runner import Probe, command, data, run, script
from reviewer.persona.probes.thresholds import (CLI_REPEATS, CLI_START_SLOW_S, IMPORT_REPEATS, IMPORT_SLOW_MS,
                                                SPEED_CLAIM)
from reviewer.persona.project import EVIDENCE_CHARS
from reviewer.text import tail


def import_script(package: str) -> str:
    return script("timing", "import_time", {"package": repr(package), "repeats": repr(IMPORT_REPEATS),
                                            "limit_ms": repr(IMPORT_SLOW_MS)})


def cli_script(names: list[str]) -> str:
    return script("timing", "cli_start", {"scripts": data(names), "repeats": repr(CLI_REPEATS),
                                          "limit_s": repr(CLI_START_SLOW_S)})


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
