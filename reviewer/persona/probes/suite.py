"""All the probes, in order: after the smoke install (`run_probes`), or one of them as an LLM persona's tool
(`run_tool`)."""

from __future__ import annotations

import time

from reviewer.persona.probes import docs_claims, edge_inputs, models, scaling, timing_claims
from reviewer.persona.probes.runner import OutOfTime, Probe, installed
from reviewer.persona.probes.thresholds import PROBES_BUDGET_S
from reviewer.persona.project import SmokeTimeout, import_name, python_metadata


def from_smoke(smoke, package: str | None) -> Probe:
    """The probes inside the smoke persona: its sandbox steps, its transcript, its recorder, its notes."""
    return Probe(root=smoke.workspace.root, sh=smoke.sh, finding=smoke.finding, measure=smoke.measure,
                 deadline=smoke.deadline, package=package, notes=smoke.notes)


def run_probes(probe: Probe, *, import_ms: float | None = None) -> None:
    """All probes, cheapest first; each bounded by the probe budget. A probe's own bug is a note, never a crash."""
    probe.deadline = min(probe.deadline - 10, time.monotonic() + PROBES_BUDGET_S)
    steps = [("console scripts", lambda: installed(probe)),
             ("docs", lambda: docs_claims.probe_docs(probe)),
             ("timing", lambda: timing_claims.probe_timing(probe, import_ms=import_ms)),
             ("edge inputs", lambda: edge_inputs.probe_edges(probe)),
             ("collection models", lambda: models.probe_models(probe)),
             ("scaling", lambda: scaling.probe_scaling(probe))]
    for name, step in steps:
        try:
            step()
        except SmokeTimeout:
            raise  # the persona's own time is up: smoke says so
        except OutOfTime as e:
            probe.notes.append(f"probes stopped at '{e}': their time ran out")
            return
        except Exception as e:  # noqa: BLE001 - a probe's bug must not cost the review; it is said in the summary
            probe.notes.append(f"probe {name} failed: {type(e).__name__}: {e}")


PROBES = ("docs", "timing", "scaling", "edges")


def run_tool(kind: str, workspace, recorder, *, deadline: float | None = None, function: str | None = None) -> str:
    """One probe as an LLM persona's tool, on its workspace (where it installed the project): the findings go to its
    recorder; the text that comes back says what was found."""
    root = workspace.root
    package = import_name(root, python_metadata(root)[0])
    end = time.monotonic() + PROBES_BUDGET_S
    probe = Probe(root=root, sh=lambda label, cmd, timeout: workspace.run(cmd, timeout),
                  finding=recorder.record_finding, measure=recorder.record_measurement,
                  deadline=min(deadline, end) if deadline else end, package=package)
    try:
        installed(probe)
        if probe.package is None and (kind != "docs" or not probe.scripts):
            return ("error: the project's package does not import in this workspace"
                    + (f" ({package})" if package else "") + "; install it first (e.g. `pip install -e .`)")
        if function:  # only the call sites of this function
            sites = probe.sites()
            sites.calls = {t: c for t, c in sites.calls.items() if t == function or t.rsplit(".", 1)[-1] == function}
            if not sites.calls:
                return f"error: the tests and docs never call {function!r} with literal arguments; nothing to probe"
        {"docs": docs_claims.probe_docs, "timing": timing_claims.probe_timing, "scaling": scaling.probe_scaling,
         "edges": lambda p: edge_inputs.probe_edges(p, cli=not function)}[kind](probe)
    except OutOfTime as e:
        probe.notes.append(f"stopped at '{e}': out of time")
    found = "\n".join(f"- {t}" for t in probe.titles) or "- nothing"
    notes = "".join(f"\nnote: {n}" for n in probe.notes)
    return f"{kind} probe recorded {len(probe.titles)} finding(s) (each with a repro command):\n{found}{notes}"
