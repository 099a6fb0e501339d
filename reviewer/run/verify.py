"""Findings checked instead of trusted: re-run each finding's `repro_command` in a fresh sandbox.

Small local models hallucinate problems. A finding that comes with a command is re-run, after its persona finished, in a
fresh workspace (a new clone of the same commit and a new virtual environment, reviewer/sandbox/workspace.py) where the
project is first installed the way this run's smoke persona installed it (its "install time" measurement names the
command), so that "pytest is missing" never passes for "the tests fail". The rule, exactly:

- `verified = True`  when the repro command exits non-zero or times out: the problem reproduces;
- `verified = False` when it exits 0: it does not;
- `verified = None`  when no check could be made (no repro command, the workspace could not be made, more than
  MAX_PER_PERSONA findings of one persona were waiting, or the repro failed for want of its own tools: the command
  not found, `python -m X` without X, pytest rejecting options of a plugin it lacks).

Besides the install, the fresh workspace gets what smoke gave the tests: pytest when the repro runs it, the project's
declared test environment (reviewer/persona/testdeps.py: a dependency group, tox.ini's deps), and, when the repro
stops for them, the modules the tests import that nothing installs (except for a `--collect-only` repro, which is how
the finding that nothing declares them reproduces). Without them a repro that runs pytest failed with "No module named
pytest", which counted as reproducing whatever the finding said.

`verification` keeps what happened (setup and repro exit codes, seconds, the output's tail) so a reader can judge. A
repro command that depends on files the persona made in its own workspace fails here for the wrong reason; the personas
are told to give commands that work on a fresh clone.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from sqlmodel import select

from reviewer.persona.checkout import REDONE
from reviewer.persona.testdeps import declared_setup, distribution, missing_test_modules
from reviewer.sandbox import isolation
from reviewer.sandbox.workspace import Target, WorkspaceError, create_workspace
from reviewer.store import db
from reviewer.store.db import Finding, Measurement, Repository, ReviewRun
from reviewer.text import tail

MAX_PER_PERSONA = 10
REPRO_TIMEOUT = 300.0
SETUP_TIMEOUT = 600.0
OUTPUT_TAIL = 3000


def setup_command(s, run_id: int) -> str | None:
    """How this run's smoke persona installed the project (None when it did not, or is not in the run): the install
    it redid when a dependency had replaced the checkout's code (reviewer/persona/checkout.py), else the first."""
    rows = s.exec(select(Measurement).where(Measurement.run_id == run_id, Measurement.persona == "smoke",
                                            Measurement.name.in_(("install time", REDONE)))).all()
    row = next((r for r in rows if r.name == REDONE), rows[0] if rows else None)
    return row.command if row and row.command else None


def pending(s, run_id: int, persona: str | None) -> list[Finding]:
    query = select(Finding).where(Finding.run_id == run_id, Finding.repro_command != None,  # noqa: E711
                                  Finding.duplicate_of == None, Finding.verification == None)  # noqa: E711
    rows = [f for f in s.exec(query.order_by(Finding.id)).all() if f.state != "fixed" and f.repro_command.strip()]
    return [f for f in rows if persona is None or f.persona == persona]


def verify_findings(db_path: str, run_id: int, *, persona: str | None = None, settings=None, policy=None,
                    on_progress: Callable[[str], None] = lambda msg: None) -> dict[str, int]:
    """Re-run the repro commands of this run's findings (one persona's, or all) that were not checked yet, in the
    sandbox `policy` (the review's; None: built from settings, once). Returns counts: reproduced, not_reproduced,
    unchecked."""
    with db.session(db_path) as s:
        run = s.get(ReviewRun, run_id)
        if run is None:
            raise ValueError(f"no run with id {run_id}")
        url = s.get(Repository, run.repository_id).url
        setup = setup_command(s, run_id)
        todo = pending(s, run_id, persona)
    target = Target(url=url, commit=run.commit_sha, ref=None)
    policy = policy or isolation.Policy.from_settings(settings)
    counts = {"reproduced": 0, "not_reproduced": 0, "unchecked": 0}
    seen: dict[str, int] = {}
    for finding in todo:
        seen[finding.persona] = seen.get(finding.persona, 0) + 1
        if seen[finding.persona] > MAX_PER_PERSONA:
            save(db_path, finding.id, None, f"not checked: over {MAX_PER_PERSONA} findings of {finding.persona} to verify")
            counts["unchecked"] += 1
            continue
        lines = finding.repro_command.strip().splitlines()
        shown = lines[0] + (" ..." if len(lines) > 1 else "")  # a probe's script: its first line
        on_progress(f"verifying finding {finding.id} ({finding.persona}): {shown}")
        verified, text = check(finding.repro_command, target, setup, settings, policy)
        save(db_path, finding.id, verified, text)
        counts["unchecked" if verified is None else "reproduced" if verified else "not_reproduced"] += 1
    return counts


def check(repro: str, target: Target, setup: str | None, settings, policy) -> tuple[bool | None, str]:
    """One repro command in a fresh workspace: (verified, what happened)."""
    command_timeout = float(getattr(settings, "command_timeout", REPRO_TIMEOUT))
    try:
        ws = create_workspace(target, parent=getattr(settings, "workdir", None), name="verify",
                              policy=policy,
                              command_timeout=max(command_timeout, SETUP_TIMEOUT))
    except WorkspaceError as e:
        return None, f"not checked: no fresh workspace ({e})"
    try:
        lines = []
        for command in ([setup] if setup else []) + repro_setup(ws.root, repro):
            done = ws.run(command, timeout=SETUP_TIMEOUT)
            lines.append(f"setup `{command}`: " + outcome(done))
        result = ws.run(repro, timeout=min(REPRO_TIMEOUT, command_timeout))
        modules = missing_test_modules(result.output, ws.root) if undeclared_imports_matter(repro, result) else []
        if modules:  # what smoke installed for the tests, nothing declares, and this repro is not about
            command = "python -m pip install " + " ".join(distribution(m) for m in modules)
            lines.append(f"setup `{command}`: " + outcome(ws.run(command, timeout=SETUP_TIMEOUT)))
            result = ws.run(repro, timeout=min(REPRO_TIMEOUT, command_timeout))
        missing = None if result.timed_out else missing_tool(repro, result.exit_code, result.output)
        verified = None if missing else result.timed_out or result.exit_code != 0
        lines.append(f"repro `{repro}`: {outcome(result)} -> " + (
            f"not checked: {missing}" if missing else "reproduces" if verified else
            "does not reproduce (exit code 0)"))
        lines.append("--- output ---")
        lines.append(tail(result.output.strip(), OUTPUT_TAIL))
        return verified, "\n".join(lines)
    finally:
        ws.remove()


def repro_setup(root, repro: str) -> list[str]:
    """Commands that give the fresh workspace what smoke gave the tests, for a repro that runs pytest, and for a
    probe's script (smoke runs the probes after the tests' environment is installed: python-dotenv's CLI needs click,
    which only its tox.ini's deps bring, and its documented session "did not reproduce" without it)."""
    probe = "REVIEWER_PROBE" in repro  # reviewer.persona.probes.runner.DELIMITER
    if "pytest" not in repro and not probe:
        return []
    return (["python -c 'import pytest' 2>/dev/null || python -m pip install pytest"] if "pytest" in repro else []) \
        + [command for _, command in declared_setup(root)]


def undeclared_imports_matter(repro: str, result) -> bool:
    """A failed pytest repro gets the third-party modules its tests import that nothing installs (smoke installed them
    before running the tests), unless it only collects: `--collect-only` is how smoke's finding that nothing declares
    them reproduces."""
    return ("pytest" in repro and "--collect-only" not in repro and not result.timed_out
            and result.exit_code not in (0, 127))


def missing_tool(repro: str, exit_code: int, output: str) -> str | None:
    """Why a repro failed for want of its own tools rather than the problem it shows, or None."""
    if exit_code == 127:
        return "the command was not found"
    runner = re.match(r"\s*python[\d.]*\s+-m\s+([\w.]+)", repro)
    if runner and re.search(rf"No module named '?{re.escape(runner.group(1))}'?\s*$", output, re.MULTILINE):
        return f"no module {runner.group(1)} in the fresh workspace"
    if exit_code == 4 and "pytest" in repro and re.search(r"unrecognized arguments?:", output):
        return "pytest rejects options of a plugin the fresh workspace lacks"
    return None


def outcome(result) -> str:
    if result.timed_out:
        return f"timed out after {result.seconds:.1f} s"
    return f"exit code {result.exit_code} in {result.seconds:.1f} s"


def save(db_path: str, finding_id: int, verified: bool | None, text: str) -> None:
    with db.session(db_path) as s:
        row = s.get(Finding, finding_id)
        row.verified, row.verification = verified, text
        s.add(row)
        s.commit()
