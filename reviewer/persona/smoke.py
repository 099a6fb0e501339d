"""The smoke persona: a deterministic first user that needs no LLM.

It looks at the files at the top of the repository to tell what kind of project it is (Python, Node, Rust, Go, make),
installs it into the fresh workspace the way its ecosystem expects, runs its test command and, for Python, times the
import of the top-level package. What it finds (install fails, tests fail — with the failing test ids and a command
that reproduces them —, no tests) and what it measures (install, test and import times) give every review a baseline
that does not depend on how good the model is. After a Python install it runs the probes (reviewer/persona/probes: the
docs as executable claims, timing claims, scaling, edge inputs) in the same workspace.

Every command goes through `Workspace.run` (the sandbox), and the transcript is saved after each one in the same
OpenAI message shape the agent personas use, so one viewer reads both.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from reviewer import stats
from reviewer.persona.checkout import PRETEND, ensure_checkout, version_before_install
from reviewer.persona.probes.suite import from_smoke, run_probes
from reviewer.persona.project import EVIDENCE_CHARS, SmokeTimeout, import_name, python_metadata
from reviewer.persona.pytest_output import (MACHINE_LACKS, failure_location, failure_sections, failures_excerpt,
                                            machine_lacks, pytest_counts, pytest_problems)
from reviewer.persona.testdeps import (declared_setup, distribution, missing_test_modules, named_in_repository,
                                       plugins_for_options, project_test_commands)
from reviewer.sandbox.command import CommandResult
from reviewer.sandbox.workspace import Workspace
from reviewer.text import tail

IMPORT_REPEATS = 5
TRANSCRIPT_OUTPUT_CHARS = 20_000  # per command, in the stored transcript
TEST_EXTRAS = ("test", "tests", "testing", "dev")
REQUIREMENT_FILES = ("requirements.txt", "requirements-dev.txt", "requirements-test.txt", "requirements_test.txt",
                     "test-requirements.txt", "requirements/test.txt", "requirements/dev.txt")
MARKERS = (  # project kind, the file that tells, in the order they are tried
    ("python", "pyproject.toml"), ("python", "setup.py"), ("python", "setup.cfg"),
    ("node", "package.json"), ("rust", "Cargo.toml"), ("go", "go.mod"), ("make", "Makefile"),
)


@dataclass
class SmokeResult:
    status: str  # completed | timeout | failed | interrupted (same vocabulary as the agent's result)
    steps: int
    summary: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    llm_seconds: float = 0.0


@dataclass
class Smoke:
    """One smoke pass over one workspace: runs commands, keeps the transcript, records through the recorder."""

    workspace: Workspace
    recorder: object  # reviewer.run.recorder.DbRecorder, or anything with record_finding/_measurement, save_transcript
    timeout: float
    on_step: Callable[[int, str, str], None] = lambda step, tool, detail: None
    steps: int = 0
    messages: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # becomes the summary
    deadline: float = 0.0
    probes: bool = True  # run reviewer/persona/probes after a Python install (settings.probes)
    package: str | None = None  # the project's top-level import name, once installed
    reinstall: str = ""  # the command that installed the checkout (again, when a dependency replaced it)
    not_checkout: str | None = None  # set when the code under test is not the checkout's: every finding says so

    def sh(self, label: str, command: str, timeout: float | None = None) -> CommandResult:
        """Run one command in the workspace as a step: progress, transcript, saved at once."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 1:
            raise SmokeTimeout(label)
        self.steps += 1
        first = command.splitlines()[0] if command.strip() else command  # a probe's script: its first line on screen
        self.on_step(self.steps, "bash", f"{label}: {first}" + (" ..." if first != command else ""))
        call_id = f"smoke-{self.steps}"
        self.messages.append({"role": "assistant", "content": label, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": command})}}]})
        result = self.workspace.run(command, timeout=min(timeout or remaining, remaining))
        status = "timed out" if result.timed_out else f"exit code {result.exit_code}"
        self.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": f"[{status}, {result.seconds:.1f} s]\n{tail(result.output, TRANSCRIPT_OUTPUT_CHARS)}"})
        self.save()
        return result

    def save(self) -> None:
        self.recorder.save_transcript(self.messages, steps=self.steps, prompt_tokens=0, completion_tokens=0, llm_seconds=0.0)

    def finding(self, **kw) -> None:
        if self.not_checkout:  # a finding about someone else's release must say so (reviewer/persona/checkout.py)
            kw["details"] = f"{kw.get('details') or ''}\n\nWarning: {self.not_checkout}.".strip()
        self.recorder.record_finding(**kw)

    def checkout_under_test(self, moment: str) -> None:
        ensure_checkout(self, moment)

    def measure(self, **kw) -> None:
        self.recorder.record_measurement(**kw)


def detect(root: Path) -> list[tuple[str, str]]:
    """(kind, marker file) for every kind of project found at the top of the repository, most specific first."""
    found, kinds = [], set()
    for kind, marker in MARKERS:
        if (root / marker).is_file() and kind not in kinds:
            found.append((kind, marker))
            kinds.add(kind)
    return found


def run_smoke(workspace: Workspace, recorder, *, timeout: float,
              on_step: Callable[[int, str, str], None] = lambda step, tool, detail: None,
              probes: bool = True) -> SmokeResult:
    smoke = Smoke(workspace=workspace, recorder=recorder, timeout=timeout, on_step=on_step,
                  deadline=time.monotonic() + timeout, probes=probes)
    kinds = detect(workspace.root)
    try:
        if not kinds:
            smoke.finding(title="No recognised build or install file", severity="medium", category="install",
                          details="None of pyproject.toml, setup.py, setup.cfg, package.json, Cargo.toml, go.mod or "
                                  "Makefile is at the top of the repository, so a new user has no standard way to "
                                  "install or test it.")
            smoke.notes.append("no pyproject.toml, setup.py, package.json, Cargo.toml, go.mod or Makefile found")
        else:
            kind, marker = kinds[0]
            smoke.notes.append(f"{kind} project ({marker})")
            {"python": smoke_python, "node": smoke_node, "rust": smoke_rust, "go": smoke_go, "make": smoke_make}[kind](
                smoke, marker)
        status = "completed"
    except SmokeTimeout as e:
        smoke.notes.append(f"stopped at '{e}': the persona's {timeout:g} s ran out")
        status = "timeout"
    smoke.save()
    return SmokeResult(status=status, steps=smoke.steps, summary="; ".join(smoke.notes))


# --- Python -----------------------------------------------------------------------------------------------------------


def has_tests(root: Path) -> bool:
    """A tests/ (test/, testing/) folder, at the top or inside the package (pytimeparse/tests/), or test_*.py /
    *_test.py / tests.py files anywhere (jsonpatch's tests.py, which its pytest.ini's python_files names)."""
    if any((root / d).is_dir() for d in ("tests", "test", "testing")):
        return True
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if any(p.startswith(".") or p in ("node_modules", "build", "dist", "site-packages") for p in parts):
            continue
        if path.name.startswith("test_") or path.name.endswith("_test.py") or path.name in ("tests.py", "test.py") or \
                any(p in ("tests", "test", "testing") for p in parts[:-1]):
            return True
    return False


def first_line_matching(text: str, pattern: str) -> str | None:
    for line in text.splitlines():
        if re.search(pattern, line):
            return line.strip()
    return None


def pip_error(output: str) -> str:
    """The most telling line of a failed pip run."""
    error = first_line_matching(output, r"^ERROR:")
    if error and not error.endswith(":"):  # "ERROR: Exception:" only introduces pip's own traceback
        return error
    return (output.strip().splitlines() or ["(no output)"])[-1].strip()


def smoke_python(smoke: Smoke, marker: str) -> None:
    root = smoke.workspace.root
    dist_name, extras = python_metadata(root)
    extra = next((e for e in TEST_EXTRAS if e in extras), None)
    if extra is None and marker != "pyproject.toml":
        extra = "test"  # setup.py projects rarely say in a file we can read; pip only warns if it is missing
    spec = f".[{extra}]" if extra else "."
    # A tagless clone of a project whose version comes from git would be 0.1.dev1: a dependent that requires the
    # project replaces it with a release (reviewer/persona/checkout.py); PKG-INFO or the upstream's tags say better
    pretend = version_before_install(root, smoke.workspace.url)
    env = f"{PRETEND}={shlex.quote(pretend[0])} " if pretend else ""
    if pretend:
        smoke.workspace.env[PRETEND] = pretend[0]
        smoke.notes.append(f"the clone has no tags; installed as version {pretend[0]} ({pretend[1]})")
    editable = f"{env}python -m pip install -e {shlex.quote(spec)}"
    install = smoke.sh("install (editable, with test extras)", editable)
    installed_with = editable
    if install.exit_code != 0:
        plain = f"{env}python -m pip install ."
        fallback = smoke.sh("install (plain)", plain)
        if fallback.exit_code == 0:
            installed_with = plain
            smoke.finding(title=f"Editable install fails: `pip install -e {spec}`", severity="medium", category="install",
                          details=f"`{editable}` fails in a fresh virtual environment ({pip_error(install.output)}); "
                                  f"`{plain}` works.",
                          evidence=tail(install.output, EVIDENCE_CHARS), repro_command=editable)
        else:
            smoke.finding(title="Install fails in a fresh virtual environment", severity="critical", category="install",
                          details=f"Neither `{editable}` nor `{plain}` works: {pip_error(fallback.output)}",
                          evidence=tail(fallback.output, EVIDENCE_CHARS), repro_command=editable)
            smoke.measure(name="install time (failed)", value=round(install.seconds, 3), unit="s", command=editable)
            smoke.notes.append(f"install failed: {pip_error(fallback.output)}")
            return
        install = fallback
    smoke.measure(name="install time", value=round(install.seconds, 3), unit="s", command=installed_with)
    smoke.notes.append(f"installed in {install.seconds:.1f} s")
    for req in REQUIREMENT_FILES[1:]:
        if (root / req).is_file():
            cmd = f"python -m pip install -r {shlex.quote(req)}"
            res = smoke.sh(f"install {req}", cmd)
            if res.exit_code != 0:
                smoke.finding(title=f"`pip install -r {req}` fails", severity="medium", category="install",
                              details=pip_error(res.output), evidence=tail(res.output, EVIDENCE_CHARS), repro_command=cmd)
    package = import_name(root, dist_name)
    smoke.package, smoke.reinstall = package, installed_with
    smoke.checkout_under_test("after the install")
    import_ms = measure_import(smoke, package) if package else None
    python_tests(smoke)
    if smoke.probes:  # docs as executable claims, timing claims, edge inputs, scaling: persona/probes/README.md
        run_probes(from_smoke(smoke, package), import_ms=import_ms)


def measure_import(smoke: Smoke, package: str) -> float | None:
    """Import time of the top-level package from `python -X importtime` (cumulative, interpreter start excluded):
    one warm-up run (it writes the .pyc files), then IMPORT_REPEATS runs; median and spread. Returns the median in
    ms (None when it could not be measured)."""
    command = f"python -X importtime -c {shlex.quote(f'import {package}')}"
    warm = smoke.sh(f"import {package} (warm-up)", command, timeout=120)
    if warm.exit_code != 0:
        error = (warm.output.strip().splitlines() or ["(no output)"])[-1]
        smoke.finding(title=f"`import {package}` fails after a successful install", severity="high", category="install",
                      details=f"In a fresh virtual environment with the project installed: {error}",
                      evidence=tail(warm.output, EVIDENCE_CHARS), repro_command=f"python -c 'import {package}'")
        smoke.notes.append(f"import {package} failed")
        return None
    samples = []
    for i in range(IMPORT_REPEATS):
        res = smoke.sh(f"import {package} ({i + 1}/{IMPORT_REPEATS})", command, timeout=120)
        us = importtime_us(res.output, package)
        if res.exit_code != 0 or us is None:
            return None
        samples.append(us / 1000.0)
    median, spread = stats.median(samples), stats.spread(samples)  # the report computes both the same way
    smoke.measure(name=f"import time ({package})", value=round(median, 3), unit="ms", command=command,
                  repeats=len(samples), spread=round(spread, 3) if math.isfinite(spread) else None, samples=[round(s, 3) for s in samples])
    smoke.notes.append(f"import {package}: {median:.1f} ms (median of {len(samples)}, spread {spread:.0%})")
    return median


def importtime_us(output: str, package: str) -> int | None:
    """The cumulative microseconds of the top-level `package` line (exactly one space of nesting)."""
    for line in output.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if m and m.group(2).strip() == package:
            return int(m.group(1))
    return None


def unittest_run(smoke: Smoke) -> bool:
    """pytest collected nothing: the project's tests may be unittest's (pytimeparse's testtimeparse.py, which
    pytest's test_*.py pattern misses and `python -m unittest discover` runs). True when unittest ran tests."""
    command = "python -m unittest discover"
    res = smoke.sh("run the tests with unittest (pytest collected none)", command)
    ran = re.search(r"^Ran (\d+) tests? in ([\d.]+)s", res.output, flags=re.MULTILINE)
    if res.timed_out or not ran or int(ran.group(1)) == 0:
        return False
    total = int(ran.group(1))
    smoke.measure(name="test suite time", value=round(res.seconds, 3), unit="s", command=command)
    if res.exit_code == 0:
        smoke.notes.append(f"pytest collects no tests; `{command}` runs {total}, all pass ({res.seconds:.1f} s)")
        return True
    failing = re.findall(r"^(?:FAIL|ERROR): (\S+) \(([\w.]+)\)", res.output, flags=re.MULTILINE)
    ids = [f"{where}.{name}" if not where.endswith("." + name) else where for name, where in failing]
    bad = len(ids) or "some"
    shown = f" ({ids[0]}" + (f" and {len(ids) - 1} more)" if len(ids) > 1 else ")") if ids else ""
    smoke.finding(title=f"{bad} of {total} tests fail{shown}", severity="high", category="tests",
                  details=f"pytest collects no tests; `{command}` in a fresh install runs {total}"
                          + (": failing " + ", ".join(ids[:20]) if ids else " and fails."),
                  evidence=tail(res.output, EVIDENCE_CHARS), repro_command=command)
    smoke.notes.append(f"unittest: {bad} of {total} tests fail")
    return True


def own_test_command_run(smoke: Smoke, why: str) -> bool:
    """pytest could not run the tests (`why`): the project's own test command (tox.ini's, a Makefile's `test`) may.
    True when one of them passes: then pytest's trouble is no finding (roman's tests run with zope-testrunner,
    toposort's with `make test`). When each fails, what pytest said stands."""
    for command in project_test_commands(smoke.workspace.root):
        res = smoke.sh(f"run the tests the project's own way (pytest {why})", command)
        if res.exit_code == 0 and not res.timed_out:
            smoke.measure(name="test suite time", value=round(res.seconds, 3), unit="s", command=command)
            smoke.notes.append(f"pytest {why}; the project's own `{command}` runs its tests and passes "
                               f"({res.seconds:.1f} s)")
            return True
    return False


def run_pytest(smoke: Smoke, root: Path, command: str) -> CommandResult | None:
    """The tests run with pytest: installed when the project does not install it, the tests' environment installed,
    run again with the plugins its config names and the modules they import that nothing installs; None when pytest
    cannot be installed."""
    if smoke.sh("is pytest installed?", "python -c 'import pytest'").exit_code != 0:
        got = smoke.sh("install pytest (the project does not install it)", "python -m pip install pytest")
        if got.exit_code != 0:
            smoke.notes.append(f"pytest could not be installed: {pip_error(got.output)}")
            return None
        smoke.notes.append("pytest was not installed by the project's test extras; installed it")
    install_test_environment(smoke, root)
    smoke.checkout_under_test("after installing what the tests need")
    result = smoke.sh("run the tests", command)
    plugins = plugins_for_options(result.output) if result.exit_code == 4 else []
    if plugins:  # the project's pytest config names plugins its install does not bring: install them, run again
        got = smoke.sh(f"install the pytest plugins the config needs ({', '.join(plugins)})",
                       "python -m pip install " + " ".join(shlex.quote(x) for x in plugins))
        if got.exit_code == 0:
            smoke.notes.append(f"pytest's config needs {', '.join(plugins)}, which the install does not bring; "
                               "installed")
            smoke.checkout_under_test(f"after installing {', '.join(plugins)}")
            result = smoke.sh("run the tests", command)
    return install_missing_imports(smoke, root, result, command)


def set_aside_machine_lacks(smoke: Smoke, sections: dict[str, str], problems: list) -> tuple[list, int]:
    """Tests that fail for want of something the review machine lacks (a GPU, a display...): one info finding per
    want, and (the other problems, how many tests were set aside)."""
    set_aside = 0
    for what, lacking in machine_lacks(sections, problems).items():
        smoke.finding(title=f"Not tested: {len(lacking)} tests need a {what} this machine does not have",
                      severity="info", category="environment",
                      details=f"These tests fail on the review machine for want of a {what} it does not have, which "
                              f"says nothing about the project: " + ", ".join(lacking[:20])
                              + (f" and {len(lacking) - 20} more" if len(lacking) > 20 else ""),
                      evidence=tail(next((b for b in sections.values() if MACHINE_LACKS[what].search(b)), ""),
                                    EVIDENCE_CHARS))
        smoke.notes.append(f"{len(lacking)} tests need a {what} the machine lacks")
        problems = [p for p in problems if p[1] not in lacking]
        set_aside += len(lacking)
    return problems, set_aside


def python_tests(smoke: Smoke) -> None:
    root = smoke.workspace.root
    if not has_tests(root):
        smoke.finding(title="No tests found", severity="medium", category="tests",
                      details="The repository has no tests/ or test/ folder and no test_*.py or *_test.py files, so a "
                              "user cannot check that an install works.")
        smoke.notes.append("no tests found")
        return
    command = "python -m pytest -q -rfE --color=no"
    result = run_pytest(smoke, root, command)
    if result is None:
        return
    if result.exit_code in (0, 1) or result.timed_out:  # a suite that ran (not a usage or collection error)
        smoke.measure(name="test suite time", value=round(result.seconds, 3), unit="s", command=command)
    if result.timed_out:
        smoke.finding(title="Test suite does not finish", severity="high", category="tests",
                      details=f"`{command}` was still running after {result.seconds:.0f} s and was killed.",
                      evidence=tail(result.output, EVIDENCE_CHARS), repro_command=command)
        smoke.notes.append(f"tests did not finish in {result.seconds:.0f} s")
        return
    counts = pytest_counts(result.output)
    problems = pytest_problems(result.output)
    counted = ", ".join(f"{n} {what}" for what, n in counts.items()) or "no summary line"
    if result.exit_code == 5 or (result.exit_code == 0 and not counts.get("passed") and not problems):
        if own_test_command_run(smoke, "collects no tests") or unittest_run(smoke):
            return
        smoke.finding(title="pytest collects no tests", severity="medium", category="tests",
                      details=f"The repository looks like it has tests, but `{command}` ran none ({counted}).",
                      evidence=tail(result.output, EVIDENCE_CHARS), repro_command=command)
        smoke.notes.append("pytest collected no tests")
        return
    if result.exit_code == 0:
        smoke.notes.append(f"tests pass ({counted}, {result.seconds:.1f} s)")
        return
    bad = counts.get("failed", 0) + counts.get("errors", 0)
    total = bad + counts.get("passed", 0)
    sections = failure_sections(result.output)
    problems, lacking = set_aside_machine_lacks(smoke, sections, problems)
    bad, total = bad - lacking, total - lacking  # what could run here
    if counts and bad <= 0 and not problems:
        smoke.notes.append(f"the other tests pass ({counted}, {result.seconds:.1f} s)")
        return
    ids = [tid for _, tid, _ in problems]
    if ids:
        first_file = ids[0].split("::")[0]
        file, line = failure_location(result.output, first_file)
        shown = ids[0] + (f" and {len(ids) - 1} more" if len(ids) > 1 else "")
        title = f"{bad} of {total} tests fail ({shown})" if total else f"Tests fail ({shown})"
        repro = "python -m pytest -x " + " ".join(shlex.quote(t) for t in ids[:5])
    elif own_test_command_run(smoke, f"fails before running the tests (exit code {result.exit_code})"):
        return
    else:  # pytest itself failed (bad config, internal error): no test ids to point at
        file, line = None, None
        title = f"pytest fails before running the tests (exit code {result.exit_code})"
        repro = command
    lines = [f"{kind} {tid}" + (f" - {msg}" if msg else "") for kind, tid, msg in problems[:50]]
    details = (f"`{command}` in a fresh install: {counted} ({result.seconds:.1f} s)."
               + ("\nFailing:\n" + "\n".join(lines) if lines else ""))
    evidence = "\n".join(lines) + "\n\n" + (failures_excerpt(result.output) or result.output)
    smoke.finding(title=title, severity="high", category="tests", details=details,
                  evidence=tail(evidence.strip(), EVIDENCE_CHARS) if len(evidence) > EVIDENCE_CHARS
                  else evidence.strip(), repro_command=repro, file=file, line=line)
    smoke.notes.append(f"tests: {counted} ({result.seconds:.1f} s)")


def install_missing_imports(smoke: Smoke, root: Path, result: CommandResult, command: str) -> CommandResult:
    """Tests that stop at collection for a third-party module nothing installs (dpath's tests import nose2): install
    it and run them again, so that the tests are judged, not the missing module ("6 of 6 tests fail" said before).
    A module that nothing in the repository names is a finding of its own, since a contributor's fresh install cannot
    run those tests; one named somewhere the review does not install from (a CI workflow, say) is a note."""
    modules = missing_test_modules(result.output, root) if result.exit_code in (1, 2) else []
    if not modules:
        return result
    dists = [distribution(m) for m in modules]
    got = smoke.sh(f"install what the tests import ({', '.join(dists)})",
                   "python -m pip install " + " ".join(shlex.quote(d) for d in dists))
    if got.exit_code != 0:
        smoke.notes.append(f"the tests import {', '.join(modules)}, which nothing installs, and it did not install: "
                           f"{pip_error(got.output)}")
        return result
    where = {d: named_in_repository(root, d) for d in dists}
    named = [f"{d} (named in {w})" for d, w in where.items() if w]
    if named:
        smoke.notes.append(f"the tests import {', '.join(named)}, which the install does not bring; installed")
    smoke.checkout_under_test(f"after installing {', '.join(dists)}")
    rerun = smoke.sh("run the tests", command)
    unnamed = [d for d, w in where.items() if not w]
    if unnamed:
        files = list(dict.fromkeys(re.findall(r"ERROR collecting (\S+)", result.output)))
        counted = ", ".join(f"{n} {what}" for what, n in pytest_counts(rerun.output).items()) or "no summary line"
        smoke.finding(title=f"The tests need {', '.join(unnamed)}, which nothing in the repository declares",
                      severity="low", category="tests",
                      details=f"`{command}` in a fresh install stops while collecting {len(files)} test modules "
                              f"(ModuleNotFoundError for {', '.join(modules)}). No requirements file, pyproject.toml, "
                              f"setup.py, tox.ini, Makefile or CI workflow names {', '.join(unnamed)}, so a "
                              f"contributor's fresh install cannot run these tests. Installed by hand, the tests "
                              f"ran: {counted}.",
                      evidence=tail(result.output, EVIDENCE_CHARS),
                      # collection alone: verification gives other pytest repros these modules, not this one
                      repro_command="python -m pytest --collect-only -q " + " ".join(shlex.quote(f) for f in files[:3]))
    return rerun


def install_test_environment(smoke: Smoke, root: Path) -> None:
    """testdeps.declared_setup, run. A failure is a note, not a finding: the project's own runner (uv, tox) may
    resolve them its own way."""
    for what, command in declared_setup(root):
        got = smoke.sh(f"install {what}", command)
        smoke.notes.append(f"installed {what}" if got.exit_code == 0 else
                           f"{what} did not install: {pip_error(got.output)}")


# --- Other ecosystems: install, then the ecosystem's test command ----------------------------------------------------

def tool_missing(smoke: Smoke, kind: str, tool: str) -> bool:
    if shutil.which(tool, path=smoke.workspace.env.get("PATH")):
        return False
    smoke.finding(title=f"Not tested: `{tool}` is not available on the review machine", severity="info",
                  category="environment",
                  details=f"This is a {kind} project; the reviewing machine has no `{tool}`, so smoke could not install "
                          "or test it. This says nothing about the project.")
    smoke.notes.append(f"{tool} not available here")
    return True


def build_and_test(smoke: Smoke, kind: str, install: str | None, test: str | None,
                   failed_ids: Callable[[str], list[str]]) -> None:
    if install:
        res = smoke.sh("install / build", install)
        if res.exit_code != 0:
            reason = (res.output.strip().splitlines() or ["(no output)"])[-1]
            smoke.finding(title=f"Build fails: `{install}`", severity="critical", category="install",
                          details=f"`{install}` fails on a fresh clone: {reason}",
                          evidence=tail(res.output, EVIDENCE_CHARS), repro_command=install)
            smoke.notes.append(f"`{install}` failed")
            return
        smoke.measure(name="install time" if kind == "Node.js" else "build time", value=round(res.seconds, 3), unit="s",
                      command=install)
        smoke.notes.append(f"`{install}` took {res.seconds:.1f} s")
    if not test:
        smoke.finding(title="No test command", severity="medium", category="tests",
                      details=f"This {kind} project declares no test command a new user could run.")
        smoke.notes.append("no test command")
        return
    res = smoke.sh("run the tests", test)
    smoke.measure(name="test suite time", value=round(res.seconds, 3), unit="s", command=test)
    if res.exit_code == 0:
        smoke.notes.append(f"`{test}` passes ({res.seconds:.1f} s)")
        return
    ids = failed_ids(res.output)
    what = "does not finish" if res.timed_out else "fails"
    title = ("Tests do not finish" if res.timed_out else "Tests fail") + (f" ({ids[0]}" + (f" and {len(ids) - 1} more)" if len(ids) > 1 else ")") if ids else "")
    smoke.finding(title=title, severity="high", category="tests",
                  details=f"`{test}` {what} on a fresh clone" + (": " + ", ".join(ids[:20]) if ids else "."),
                  evidence=tail(res.output, EVIDENCE_CHARS), repro_command=test)
    smoke.notes.append(f"`{test}` {what}" + (f" ({len(ids)} failing)" if ids else ""))


def smoke_node(smoke: Smoke, marker: str) -> None:
    if tool_missing(smoke, "Node.js", "npm"):
        return
    try:
        scripts = json.loads((smoke.workspace.root / marker).read_text()).get("scripts", {}) or {}
    except (ValueError, AttributeError):
        smoke.finding(title="package.json is not valid JSON", severity="critical", category="install",
                      details="npm cannot read package.json.")
        return
    test = scripts.get("test", "")
    has_test = bool(test) and "no test specified" not in test
    install = "npm ci" if (smoke.workspace.root / "package-lock.json").is_file() else "npm install"
    build_and_test(smoke, "Node.js", install, "npm test" if has_test else None,
                   lambda out: re.findall(r"^\s*(?:✕|×|\d+\))\s+(.+?)\s*$", out, flags=re.MULTILINE)[:50])


def smoke_rust(smoke: Smoke, marker: str) -> None:
    if tool_missing(smoke, "Rust", "cargo"):
        return
    build_and_test(smoke, "Rust", "cargo build", "cargo test",
                   lambda out: re.findall(r"^test (\S+) \.\.\. FAILED$", out, flags=re.MULTILINE))


def smoke_go(smoke: Smoke, marker: str) -> None:
    if tool_missing(smoke, "Go", "go"):
        return
    build_and_test(smoke, "Go", "go build ./...", "go test ./...",
                   lambda out: re.findall(r"^\s*--- FAIL: (\S+)", out, flags=re.MULTILINE))


def smoke_make(smoke: Smoke, marker: str) -> None:
    if tool_missing(smoke, "make", "make"):
        return
    makefile = (smoke.workspace.root / marker).read_text(errors="replace")
    targets = [t for t in re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", makefile, flags=re.MULTILINE)
               if not t.startswith(".")]
    test = next((t for t in ("test", "check") if t in targets), None)
    # Plain `make` builds the first target; when that is the test target itself, running it twice tells nothing new.
    build = "make" if targets and targets[0] != test else None
    build_and_test(smoke, "make", build, f"make {test}" if test else None, lambda out: [])
