"""The docs' shell sessions run inside the sandbox: one bash, one working directory, the lines in order, each project
line judged against the output the docs show (the host half, and the rules: reviewer/persona/probes/doc_sessions.py)."""

from __future__ import annotations

import doctest
import os
import re
import shlex
import shutil
import subprocess
import tempfile

from .commands import OFFLINE
from .prelude import emit


def run_session(steps, timeout):
    """Run the steps in one bash, in a fresh copy of the working directory with a fresh HOME: per step, (exit code,
    stdout, stderr), None for a step that did not run (setup lines, what came after the shell stopped), and exit
    code None for a project line that ran past `timeout`."""
    base = tempfile.mkdtemp(prefix="reviewer-session-")
    work, home = os.path.join(base, "work"), os.path.join(base, "home")
    try:
        shutil.copytree(".", work, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        os.makedirs(home)
        lines = ["cd " + shlex.quote(work)]
        for i, step in enumerate(steps):
            if step["run"] is None or step["kind"] == "setup":
                continue
            # a project line gets its own time limit (it changes no shell state); cd, export and the like run as is
            run = (f"timeout -k 2 {int(timeout)} bash -c {shlex.quote(step['run'])}" if step["kind"] == "project"
                   else step["run"])
            o = os.path.join(base, str(i))
            lines.append(f"{{ {run}\n}} >{o}.out 2>{o}.err </dev/null; echo $? >{o}.rc")
        env = dict(os.environ, HOME=home, XDG_CONFIG_HOME=os.path.join(home, ".config"),
                   XDG_DATA_HOME=os.path.join(home, ".local", "share"), XDG_STATE_HOME=os.path.join(home, ".state"),
                   XDG_CACHE_HOME=os.path.join(home, ".cache"))
        try:
            subprocess.run(["bash", "-c", "\n".join(lines)], env=env, timeout=timeout * (len(steps) + 1),
                           stdin=subprocess.DEVNULL, capture_output=True)
        except subprocess.TimeoutExpired:
            pass
        results = []
        for i in range(len(steps)):
            o = os.path.join(base, str(i))
            if not os.path.exists(o + ".rc"):
                results.append(None)
                continue
            read = lambda path: open(path, errors="replace").read() if os.path.exists(path) else ""  # noqa: E731
            code = int(read(o + ".rc").strip() or 1)
            results.append((None if code in (124, 137) and steps[i]["kind"] == "project" else code,
                            read(o + ".out"), read(o + ".err")))
        return results
    finally:
        shutil.rmtree(base, ignore_errors=True)


def step_verdict(step, result, strict_silence):
    """('ok' | 'unjudged' | a problem dict) of one project step's result."""
    code, out, err = result
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    shown = step["expected"]
    if shown and any(doctest.OutputChecker().check_output(shown + "\n", t, flags) for t in (out, err, out + err)):
        return "ok"  # what the docs show, an error message and a failing exit code included
    offline = OFFLINE.search(out + err)
    ours = step["filled"] and re.search(r"No such file|not found|does not exist|FileNotFoundError|IsADirectory|"
                                        r"Permission denied|[Ii]nvalid", out + err)
    if code is None or offline or ours:
        return "unjudged"  # too slow, the network, or a value of ours the command refused
    if "Traceback (most recent call last)" in out + err:
        return {"what": "traceback", "output": (out + err)[-1500:]}
    if code != 0:
        return "unjudged" if step["filled"] else {"what": f"exit code {code}", "output": (out + err)[-1500:]}
    if shown:
        return {"what": "output", "output": out[-3000:]}
    if strict_silence and out.strip():
        return {"what": "unshown output", "output": out[-3000:]}
    return "ok"


def check_session(steps, timeout, only=None, strict_silence=None):
    """The problems of a session's project lines (only the step `only`, for a repro), each judged only when every
    line before it ran as the docs show. A different output counts when a second run gives it again. Whether a line
    the docs show no output for must print nothing is the whole session's: a repro holds only the lines up to its
    own, and one that dropped the later `tool list` with its output had passed where the session failed."""
    first = run_session(steps, timeout)
    if strict_silence is None:
        strict_silence = any(s["expected"] for s in steps if s["kind"] == "project")
    problems = []
    for i, step in enumerate(steps):
        if step["kind"] == "setup":
            continue
        if step["run"] is None or first[i] is None:
            break  # it could not run: nothing after it is judged
        if step["kind"] == "aux":
            if first[i][0] != 0:
                break
            continue
        verdict = step_verdict(step, first[i], strict_silence)
        if verdict == "unjudged":
            break
        if verdict != "ok" and (only is None or i == only):
            problems.append(dict(verdict, step=i))
        if verdict != "ok" and (verdict["what"] == "traceback" or verdict["what"].startswith("exit code")):
            break  # it failed: what follows builds on it
    if any(p["what"] in ("output", "unshown output") for p in problems):
        again = run_session(steps, timeout)
        problems = [p for p in problems if p["what"] not in ("output", "unshown output")
                    or (again[p["step"]] is not None and again[p["step"]][1] == first[p["step"]][1])]
    return problems


def check(steps, timeout, only=None, strict=None):
    """The check script's entry: exit 1 when a line of the session has a problem."""
    problems = check_session(steps, timeout, only, strict)
    emit({"problems": problems})
    return 1 if problems else 0
