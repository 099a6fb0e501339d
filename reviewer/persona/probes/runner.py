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

from reviewer.persona.probes import callsites, doctext, prelude
from reviewer.persona.probes.thresholds import RESULT_MARK
from reviewer.sandbox.command import CommandResult

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
        """The docs' code blocks (reviewer.persona.probes.doctext.Block), read once."""
        if "blocks" not in self._cache:
            self._cache["blocks"] = doctext.all_blocks(self.root)
        return self._cache["blocks"]

    def doc_text(self) -> str:
        if "doc_text" not in self._cache:
            self._cache["doc_text"] = doctext.text(self.root)
        return self._cache["doc_text"]

    def sentences(self):
        if "sentences" not in self._cache:
            self._cache["sentences"] = doctext.sentences(self.root)
        return self._cache["sentences"]

    def sites(self):
        """Where the tests and docs call the package's public functions (reviewer.persona.probes.callsites.Sites)."""
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


