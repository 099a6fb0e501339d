"""Personas: Markdown files with YAML front matter; the body is the system prompt.

Front matter keys: name, description, focus, max_steps, and optional `model` settings (temperature, max_tokens,
top_p) and `deterministic: true` for personas that need no LLM (smoke). Later folders override earlier ones by name,
so a user can replace a built-in persona by writing one with the same name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

BUILTIN_DIR = Path(__file__).resolve().parents[2] / "personas"


class PersonaError(Exception):
    """A persona file that cannot be used, or an unknown persona name; one line for the user."""


@dataclass
class Persona:
    name: str
    description: str
    system_prompt: str
    focus: list[str] = field(default_factory=list)
    max_steps: int = 30
    model_settings: dict = field(default_factory=dict)
    deterministic: bool = False
    source: Path | None = None

    def summary(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "focus": self.focus,
            "max_steps": self.max_steps,
            "needs_llm": not self.deterministic,
            "source": str(self.source) if self.source else None,
        }


def parse_persona(path: Path) -> Persona:
    text = path.read_text(encoding="utf-8")
    if not text.startswith("---"):
        raise PersonaError(f"{path}: a persona file starts with YAML front matter between '---' lines")
    try:
        _, front, body = text.split("---", 2)
        meta = yaml.safe_load(front) or {}
    except (ValueError, yaml.YAMLError) as e:
        raise PersonaError(f"{path}: bad front matter: {str(e).splitlines()[0]}") from None
    if not isinstance(meta, dict) or not meta.get("name"):
        raise PersonaError(f"{path}: front matter needs at least 'name' and 'description'")
    max_steps = meta.get("max_steps", 30)
    if not isinstance(max_steps, int) or max_steps < 1:
        raise PersonaError(f"{path}: max_steps must be a positive integer")
    focus = meta.get("focus", [])
    model = meta.get("model") or {}
    if not isinstance(model, dict):
        raise PersonaError(f"{path}: 'model' must be a mapping of settings (temperature, tool_format, ...)")
    if model.get("tool_format", "native") not in ("native", "text"):
        raise PersonaError(f"{path}: model.tool_format must be native or text, got {model['tool_format']!r}")
    return Persona(
        name=str(meta["name"]),
        description=str(meta.get("description", "")),
        system_prompt=body.strip(),
        focus=[focus] if isinstance(focus, str) else list(focus),
        max_steps=max_steps,
        model_settings=dict(model),
        deterministic=bool(meta.get("deterministic", False)),
        source=path,
    )


def load_personas(extra_dirs: list[Path] | tuple[Path, ...] = ()) -> dict[str, Persona]:
    """Built-in personas, then each extra folder in order; a later file with the same name wins."""
    found: dict[str, Persona] = {}
    for folder in [BUILTIN_DIR, *map(Path, extra_dirs)]:
        if not folder.is_dir():
            raise PersonaError(f"personas folder not found: {folder}")
        for path in sorted(folder.glob("*.md")):
            if path.name.lower() == "readme.md":
                continue
            persona = parse_persona(path)
            found[persona.name] = persona
    return found


def select_personas(names: list[str], extra_dirs=()) -> list[Persona]:
    available = load_personas(extra_dirs)
    unknown = [n for n in names if n not in available]
    if unknown:
        raise PersonaError(f"unknown persona {', '.join(map(repr, unknown))} (available: {', '.join(available)})")
    return [available[n] for n in names]
