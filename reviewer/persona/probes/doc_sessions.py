"""The docs' shell sessions run as a reader types them: a block of `$ ` lines is one shell in one working directory,
its lines in order (`tool set KEY value` twice, then `tool list`, which needs them). Each line that runs the project
is compared with the output the docs show after it; a line is judged only when every line before it ran and did
what the docs show (a line that cannot run, or fails where a value of ours was filled in, ends what is judged).

The session runs in a fresh copy of the repository (no .git) with a fresh HOME, twice, and a different output counts
only when both runs agree (a clock, an id, a temporary path). Steps come from doctext.sessions; what a step is and how
its placeholders are filled is there. Findings are recorded by docs_claims.py's way of recording command findings.
The session runs in sandboxed/sessions.py; this is the host half, the steps and the script.
"""

from __future__ import annotations

from pathlib import Path

from reviewer.persona.probes import doctext
from reviewer.persona.probes.runner import data, script
from reviewer.persona.probes.thresholds import DOC_COMMAND_TIMEOUT_S

MAX_SESSION_STEPS = 30


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
    return script("sessions", "check", {"steps": data(steps), "timeout": repr(DOC_COMMAND_TIMEOUT_S),
                                        "only": repr(only), "strict": repr(strict)})
