"""Running the probes: the context they share, the check scripts they send into the sandbox, and the order.

Every probe works the same way. It writes a small Python script (the helpers it needs from prelude.py copied in),
runs it in the sandbox with the project's virtual environment, reads the result line the script prints, and records
a finding when the script found the problem. The script exits 1 exactly when it found the problem, so the finding's
repro command is the script itself, given only the failing case: reviewer/run/verify.py re-runs it in a fresh clone and
sees the same exit code.
"""

from __future__ import annotations

import inspect
import json
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from reviewer.probes import prelude
from reviewer.probes.thresholds import PROBES_BUDGET_S, RESULT_MARK
from reviewer.sandbox.command import CommandResult
from reviewer.persona.smoke import SmokeTimeout

DELIMITER = "REVIEWER_PROBE"


class OutOfTime(Exception):
    """The probes' share of the persona's time is spent: stop probing, keep what was found."""


@dataclass
class Probe:
    """What a probe needs: the workspace's sandbox, a recorder, a deadline. Built from the smoke persona (its steps
    go to the smoke transcript) or from an agent's toolbox (the probes as tools)."""

    root: object  # pathlib.Path of the clone
    sh: Callable[[str, str, float], CommandResult]  # (label, command, timeout) -> result, in the sandbox
    finding: Callable[..., object]  # record_finding(**kw)
    measure: Callable[..., object]  # record_measurement(**kw)
    deadline: float  # time.monotonic()
    package: str | None = None  # the top-level import name
    scripts: dict[str, str] = field(default_factory=dict)  # console script -> entry point, from the installed metadata
    notes: list[str] = field(default_factory=list)
    titles: list[str] = field(default_factory=list)  # findings recorded by the probes, "[severity] title"
    _cache: dict = field(default_factory=dict)

    def record(self, **kw) -> None:
        self.finding(**kw)
        self.titles.append(f"[{kw['severity']}] {kw['title']}")

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def blocks(self):
        """The docs' code blocks (reviewer.probes.doctext.Block), read once."""
        from reviewer.probes import doctext

        if "blocks" not in self._cache:
            self._cache["blocks"] = doctext.all_blocks(self.root)
        return self._cache["blocks"]

    def sentences(self):
        from reviewer.probes import doctext

        if "sentences" not in self._cache:
            self._cache["sentences"] = doctext.sentences(self.root)
        return self._cache["sentences"]

    def sites(self):
        """Where the tests and docs call the package's public functions (reviewer.probes.callsites.Sites)."""
        from reviewer.probes import callsites

        if "sites" not in self._cache:
            self._cache["sites"] = callsites.find(self.root, self.package, self.blocks())
        return self._cache["sites"]


def script(body: str, *helpers, imports: tuple[str, ...] = ()) -> str:
    """A standalone check script: the prelude's imports (and `imports`), the source of `helpers` (functions or
    classes that use only the standard library and each other: prelude.py's, reviewer.stats.median, the sandbox
    halves of the probes), then `body`."""
    parts = ["from __future__ import annotations  # the helpers' annotations name types the script never imports",
             "import " + ", ".join(dict.fromkeys(prelude.IMPORTS + tuple(imports)))]
    parts += [textwrap.dedent(inspect.getsource(h)).strip() for h in helpers]
    parts.append(textwrap.dedent(body).strip())
    return "\n\n".join(parts) + "\n"


def command(code: str, env: str = "") -> str:
    """The shell command that runs `code` with the workspace's python (a quoted heredoc: nothing is expanded);
    `env` is an optional `NAME=value` prefix."""
    if any(line.strip() == DELIMITER for line in code.splitlines()):
        raise ValueError(f"a probe script may not contain a line {DELIMITER}")
    return f"{env + ' ' if env else ''}python - <<'{DELIMITER}'\n{code.rstrip()}\n{DELIMITER}"


def data(value) -> str:
    """A JSON value as Python source for a script (json.loads of a string literal: any value, safely quoted)."""
    return f"json.loads({json.dumps(json.dumps(value))})"


def result_line(output: str) -> dict | None:
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_MARK + " "):
            try:
                return json.loads(line[len(RESULT_MARK) + 1:])
            except ValueError:
                return None
    return None


def run(probe: Probe, label: str, code: str, timeout: float, env: str = "") -> tuple[dict | None, CommandResult, str]:
    """Run one check script: (its result line or None, the command's result, the command)."""
    left = probe.remaining()
    if left < 5:
        raise OutOfTime(label)
    cmd = command(code, env)
    res = probe.sh(label, cmd, min(timeout, left))
    got = result_line(res.output)
    if got is None:  # the script died before its verdict: a probe bug or a hostile project, said once or twice
        last = (res.output.strip().splitlines() or ["(no output)"])[-1][:200]
        if sum("gave no result" in n for n in probe.notes) < 3:
            probe.notes.append(f"{label} gave no result ({'timed out' if res.timed_out else last})")
    return got, res, cmd


def from_smoke(smoke, package: str | None) -> Probe:
    """The probes inside the smoke persona: its sandbox steps, its transcript, its recorder, its notes."""
    return Probe(root=smoke.workspace.root, sh=smoke.sh, finding=smoke.finding, measure=smoke.measure,
                 deadline=smoke.deadline, package=package, notes=smoke.notes)


INFO = """
from importlib import metadata
here = os.path.realpath(os.getcwd())
for dist in metadata.distributions():
    try:
        url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    except ValueError:
        continue
    if url.startswith("file://") and os.path.realpath(url[7:]) == here:
        scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
        break
else:
    scripts = {}
try:
    importlib.import_module(PACKAGE) if PACKAGE else None
    error = None
except BaseException as e:
    error = repr(e)[:300]
emit({"scripts": scripts, "import_error": error})
"""


def installed(probe: Probe) -> None:
    """Console scripts of the distribution installed from this clone (pyproject, setup.cfg or setup.py alike), and
    whether the package imports at all (if not, smoke has said so, and the probes of its functions have nothing to
    call)."""
    code = script(f"PACKAGE = {probe.package!r}\n" + INFO, prelude.emit)
    got, res, _ = run(probe, "probe: console scripts and import of the installed project", code, 60)
    probe.scripts.update((got or {}).get("scripts") or {})
    if got is None or got.get("import_error"):
        probe.notes.append(f"probes skip the functions of {probe.package}: it does not import")
        probe.package = None


def run_probes(probe: Probe, *, import_ms: float | None = None) -> None:
    """All probes, cheapest first; each bounded by the probe budget. A probe's own bug is a note, never a crash."""
    from reviewer.probes import docs_claims, edge_inputs, scaling, timing_claims

    probe.deadline = min(probe.deadline - 10, time.monotonic() + PROBES_BUDGET_S)
    steps = [("console scripts", lambda: installed(probe)),
             ("docs", lambda: docs_claims.probe_docs(probe)),
             ("timing", lambda: timing_claims.probe_timing(probe, import_ms=import_ms)),
             ("edge inputs", lambda: edge_inputs.probe_edges(probe)),
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
    from reviewer.probes import docs_claims, edge_inputs, scaling, timing_claims
    from reviewer.persona.smoke import import_name, python_metadata

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
