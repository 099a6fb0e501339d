"""What an LLM persona is told first: where it is, what it has, what is known already, what to do."""

from __future__ import annotations

from reviewer.persona.files import Persona
from reviewer.sandbox.workspace import Target, Workspace

README_CHARS = 4000


def build_task(persona: Persona, ws: Workspace, target: Target, *, max_steps: int, baseline: list[str]) -> str:
    """The first user message of an LLM persona: where it is, what it has, what is known already, what to do."""
    top = sorted(p.name + ("/" if p.is_dir() else "") for p in ws.root.iterdir() if p.name != ".git")
    readme = next((p for p in sorted(ws.root.iterdir()) if p.is_file() and p.name.lower().startswith("readme")), None)
    lines = [
        "Review this repository the way a new user would, with your focus: " + (", ".join(persona.focus) or persona.description) + ".",
        "",
        f"Repository: {target.url}",
        f"Commit: {target.commit}" + (f" ({target.ref})" if target.ref else f" (default branch {target.branch})" if target.branch else ""),
        f"Working directory (a fresh clone; every path you give is relative to it): {ws.root}",
        f"A fresh virtual environment is active: `python` and `pip` are {ws.venv}/bin/python and {ws.venv}/bin/pip. "
        "Nothing is installed in it yet: install the project the way its README says.",
        f"Each bash command runs in a new shell in the working directory (a `cd` does not carry over) with at most "
        f"{ws.command_timeout:g} s; whatever it started in the background is stopped when it returns.",
        f"Top of the repository: {', '.join(top)}",
    ]
    lines += [f"Note: {n}" for n in ws.notes]
    if readme:
        text = readme.read_text(errors="replace")
        cut = f"\n[... {len(text) - README_CHARS} more characters: read_file {readme.name} ...]" if len(text) > README_CHARS else ""
        lines += ["", f"{readme.name}:", "-----", text[:README_CHARS] + cut, "-----"]
    else:
        lines += ["", "The repository has no README."]
    if baseline:
        lines += ["", "Already known from the deterministic smoke check of this commit (do not repeat it; go further):"]
        lines += [f"- {b}" for b in baseline]
    lines += [
        "",
        f"You have {max_steps} steps. Confirm each problem by running something, then record it at once with "
        "record_finding (evidence: the command output; repro_command: one command that shows it). Record every number "
        "you measure with record_measurement (repeat timings and give `repeats`). When done, call finish with a short "
        "summary.",
    ]
    return "\n".join(lines)
