"""Running the probes: the context they share, the check scripts they send into the sandbox, and the order.

Every probe works the same way. It writes a small Python script (carrying the modules of sandboxed/ it calls),
runs it in the sandbox with the project's virtual environment, reads the result line the script prints, and records
a finding when the script found the problem. The script exits 1 exactly when it found the problem, so the finding's
repro command is the script itself, given only the failing case: reviewer/run/verify.py re-runs it in a fresh clone and
sees the same exit code.
"""

from __future__ import annotations

import ast
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from reviewer.persona.probes import callsites, doctext
from reviewer.persona.probes.sandboxed.prelude import RESULT_MARK
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


SANDBOXED = Path(__file__).with_name("sandboxed")  # the modules the checks run inside the sandbox
SANDBOXED_NAME = "reviewer_probes_sandboxed"  # their package's name there: one no project has, so it shadows nothing

# A check script's first lines: the sandboxed modules it carries (SANDBOXED_FILES, written above this) go to a fresh
# temporary folder outside the clone, which is appended to sys.path and removed when the script exits.
BOOTSTRAP = """
_home = tempfile.mkdtemp(prefix="reviewer-probe-")
atexit.register(shutil.rmtree, _home, True)
for _name, _text in SANDBOXED_FILES.items():
    _path = os.path.join(_home, *_name.split("/"))
    os.makedirs(os.path.dirname(_path), exist_ok=True)
    with open(_path, "w", encoding="utf-8") as _file:
        _file.write(_text)
sys.path.append(_home)
"""


def sandboxed_modules(module: str) -> list[str]:
    """`module` of the sandboxed package and every module of it that it imports (relative imports, read by ast),
    in a stable order."""
    found, todo = [], [module]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.append(name)
        tree = ast.parse((SANDBOXED / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                todo += [node.module] if node.module else [a.name for a in node.names]
    return sorted(found)


def script(module: str, function: str, args: dict[str, str], names: tuple[str, ...] = ()) -> str:
    """A standalone check script: it carries the sandboxed `module` (and what that imports), then calls
    `function(**args)` there and exits with what it returns. `args` maps each keyword to the Python source of its
    value (`data(...)` for plain data, or lambdas over `names`, helpers imported from the sandboxed prelude: the
    generated calls of scaling.py and edge_inputs.py)."""
    files = {f"{SANDBOXED_NAME}/__init__.py": (SANDBOXED / "__init__.py").read_text()}
    files.update((f"{SANDBOXED_NAME}/{m}.py", (SANDBOXED / f"{m}.py").read_text()) for m in sandboxed_modules(module))
    parts = ["import atexit, json, os, shutil, sys, tempfile",
             "SANDBOXED_FILES = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in files.items()) + "}",
             BOOTSTRAP.strip()]
    if names:
        parts.append(f"from {SANDBOXED_NAME}.prelude import {', '.join(names)}")
    call = "".join(f"    {key}={value},\n" for key, value in args.items())
    parts.append(f"from {SANDBOXED_NAME}.{module} import {function}\n\nsys.exit({function}(\n{call}))")
    head = f"# a reviewer probe's check (reviewer/persona/probes/sandboxed/{module}.py)\n"
    return head + "\n\n".join(parts) + "\n"


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


def installed(probe: Probe) -> None:
    """Console scripts of the distribution installed from this clone (pyproject, setup.cfg or setup.py alike), and
    whether the package imports at all (if not, smoke has said so, and the probes of its functions have nothing to
    call)."""
    code = script("installed", "check", {"package": repr(probe.package)})
    got, res, _ = run(probe, "probe: console scripts and import of the installed project", code, 60)
    probe.scripts.update((got or {}).get("scripts") or {})
    if got is None or got.get("import_error"):
        probe.notes.append(f"probes skip the functions of {probe.package}: it does not import")
        probe.package = None


