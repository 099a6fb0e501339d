"""What `reviewer run` checks before anything heavy is imported or written: the personas (and which ones run by
default on the embedded model), the target and ref, the sandbox policy. Bad input costs one line, in well under a
second: this module imports no LLM SDK, no database layer and no persona runner (cli.py calls it before it imports
reviewer.run.review, which needs them all).
"""

from __future__ import annotations

from dataclasses import dataclass

from reviewer.persona.files import Persona, PersonaError, select_personas
from reviewer.sandbox import isolation
from reviewer.sandbox.workspace import Target, WorkspaceError, resolve_target

# Personas that run code instead of a model (reviewer.run.review.DETERMINISTIC maps each to its runner).
DETERMINISTIC_NAMES = ("smoke",)


class UserError(Exception):
    """Bad input found before anything is written; one line."""


@dataclass
class CheckedInputs:
    personas: list[Persona]
    target: Target
    policy: isolation.Policy
    note: str | None = None  # a line for the user about the personas chosen for them (the embedded default)


def embedded_only(settings) -> bool:
    return all(entry == "embedded" for entry in settings.llm)


def persona_names(settings) -> tuple[list[str], str | None]:
    """The personas to run, and a note when the default was narrowed. On the embedded model (SmolLM2-135M, small
    enough to ship in a wheel) the LLM personas cannot do their job: measured on the example project, the docs
    persona ran 9:44 for 2 steps and no finding. So, unless personas were named (command line, REVIEWER_PERSONAS,
    config), a review on the embedded model runs the deterministic personas only and says how to add the others."""
    names = list(dict.fromkeys(settings.personas))  # each once
    if "personas" in settings.model_fields_set or not embedded_only(settings):
        return names, None
    kept = [n for n in names if n in DETERMINISTIC_NAMES]
    skipped = [n for n in names if n not in DETERMINISTIC_NAMES]
    if not skipped or not kept:
        return names, None
    return kept, (f"the embedded model (SmolLM2-135M) is too small for the LLM personas ({', '.join(skipped)}): "
                  f"running {', '.join(kept)}. Add them with a capable model: --llm http://HOST:PORT/v1 (or openai, "
                  f"anthropic) " + " ".join(f"--persona {n}" for n in names) + " (docs/backends.md)")


def check_inputs(target: str, settings, ref: str | None) -> CheckedInputs:
    """Everything that can be wrong with what the user typed, before the lock and before the database; the
    personas, the target and the sandbox policy (built once: every persona's workspace and the verification use it)."""
    names, note = persona_names(settings)
    try:
        personas = select_personas(names, settings.personas_dir)
    except PersonaError as e:
        raise UserError(str(e)) from None
    if not personas:
        raise UserError("no persona selected")
    for p in personas:
        if p.deterministic and p.name not in DETERMINISTIC_NAMES:
            raise UserError(f"persona {p.name!r} ({p.source}) says `deterministic: true`, but only "
                            f"{', '.join(DETERMINISTIC_NAMES)} run without an LLM")
    try:
        policy = isolation.Policy.from_settings(settings)  # bubblewrap missing or broken: one line, nothing written
    except isolation.IsolationError as e:
        raise UserError(str(e)) from None
    try:
        return CheckedInputs(personas, resolve_target(target, ref), policy, note)
    except WorkspaceError as e:
        raise UserError(str(e)) from None
