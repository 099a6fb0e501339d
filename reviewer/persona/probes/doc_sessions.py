"""The docs' shell sessions run as a reader types them: a block of `$ ` lines is one shell in one working directory,
its lines in order (`tool set KEY value` twice, then `tool list`, which needs them). Each line that runs the project
is compared with the output the docs show after it; a line is judged only when every line before it ran and did
what the docs show (a line that cannot run, or fails where a value of ours was filled in, ends what is judged).

The session runs in a fresh copy of the repository (no .git) with a fresh HOME, twice, and a different output counts
only when both runs agree (a clock, an id, a temporary path). Steps come from doctext.sessions; what a step is and how
its placeholders are filled is there. Findings are recorded by docs_claims.py's way of recording command findings.
"""

from __future__ import annotations

from pathlib import Path

from reviewer.persona.probes import doctext, prelude
from reviewer.persona.probes.runner import data, script
from reviewer.persona.probes.thresholds import DOC_COMMAND_TIMEOUT_S

MAX_SESSION_STEPS = 30


# --- runs inside the sandbox (copied into the check scripts) --------------------------------------------------------

def run_session(steps, timeout):
    """Run the steps in one bash, in a fresh copy of the working directory with a fresh HOME: per step, (exit code,
    stdout, stderr), None for a step that did not run (setup lines, what came after the shell stopped), and exit
    code None for a project line that ran past `timeout`."""
    import shlex
    import shutil
    import subprocess
    import tempfile

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
    import doctest

    code, out, err = result
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    shown = step["expected"]
    if shown and any(doctest.OutputChecker().check_output(shown + "\n", t, flags) for t in (out, err, out + err)):
        return "ok"  # what the docs show, an error message and a failing exit code included
    offline = re.search(r"Name or service not known|Temporary failure in name resolution|Network is unreachable|"
                        r"Connection refused|Could not resolve host|Max retries exceeded|ProxyError|SSLError", out + err)
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


SESSION_BODY = """
problems = check_session(STEPS, TIMEOUT, ONLY, STRICT)
emit({"problems": problems})
sys.exit(1 if problems else 0)
"""


# --- the host side ----------------------------------------------------------------------------------------------------

def session_steps(session: doctext.Session, root: Path, file_name) -> list[dict]:
    """The steps as the script takes them. A project line naming a file that is neither in the repository nor named
    by an earlier line (which may make it) cannot run: the reader brings it."""
    steps, earlier = [], ""
    for s in session.steps[:MAX_SESSION_STEPS]:
        run = s.run
        if run and s.kind == "project":
            for token in (t.strip("'\"") for t in run.split()):
                if file_name(token) and not token.startswith("-") and not (root / token).exists() \
                        and token not in earlier:
                    run = None
                    break
        steps.append({"line": s.line, "text": s.text, "expected": s.expected, "kind": s.kind, "run": run,
                      "filled": s.filled})
        earlier += " " + s.text
    return steps


def session_script(steps: list[dict], only: int | None = None, strict: bool | None = None) -> str:
    """The session's check as a script; `strict` (a repro's) is whether the whole session shows any output."""
    head = f"STEPS = {data(steps)}\nTIMEOUT = {DOC_COMMAND_TIMEOUT_S!r}\nONLY = {only!r}\nSTRICT = {strict!r}\n"
    return script(head + SESSION_BODY, prelude.emit, run_session, step_verdict, check_session, imports=("re",))
