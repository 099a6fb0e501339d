"""What the smoke persona learns about a Python project from its files (distribution name, extras, the package a user
imports), shared with the probes (reviewer/persona/probes), which work on the same install; and the limits they
share."""

from __future__ import annotations

import configparser
import re
import tomllib
from pathlib import Path

EVIDENCE_CHARS = 4_000  # of a command's output, quoted in a finding
NOT_PACKAGES = {"tests", "test", "testing", "docs", "doc", "examples", "example", "benchmarks", "bench", "scripts",
                "tools", "build", "dist", "site-packages"}
NOT_MODULES = {"setup", "conftest", "noxfile", "tasks", "fabfile", "manage", "versioneer"}


class SmokeTimeout(Exception):
    """The smoke persona's time is up: raised by its next step, passed through by the probes it runs."""


def python_metadata(root: Path) -> tuple[str | None, list[str]]:
    """(distribution name, optional-dependency groups) from pyproject.toml or setup.cfg, where they say; a name that
    only setup.py gives (`setup(name='toolz', ...)`) is read from its text."""
    name, extras = declared_metadata(root)
    if name is None and (root / "setup.py").is_file():
        m = re.search(r"""\bname\s*=\s*['"]([A-Za-z0-9][\w.-]*)['"]""", (root / "setup.py").read_text(errors="replace"))
        name = m.group(1) if m else None
    return name, extras


def declared_metadata(root: Path) -> tuple[str | None, list[str]]:
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        try:
            project = tomllib.loads(pyproject.read_text()).get("project", {})
            return project.get("name"), list(project.get("optional-dependencies", {}))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, AttributeError):
            return None, []
    setup_cfg = root / "setup.cfg"
    if setup_cfg.is_file():
        cfg = configparser.ConfigParser()
        try:
            cfg.read(setup_cfg)
            return cfg.get("metadata", "name", fallback=None), list(cfg["options.extras_require"]) if cfg.has_section(
                "options.extras_require") else []
        except configparser.Error:
            return None, []
    return None, []


def import_name(root: Path, dist_name: str | None) -> str | None:
    """The top-level package a user would import: the one named like the distribution, else the only candidate."""
    candidates: list[str] = []
    for base in (root / "src", root):
        if not base.is_dir():
            continue
        for entry in sorted(base.iterdir()):
            if entry.is_dir() and (entry / "__init__.py").is_file() and entry.name.isidentifier():
                candidates.append(entry.name)
            elif entry.suffix == ".py" and entry.stem.isidentifier() and not entry.stem.startswith("test"):
                candidates.append(entry.stem)
    candidates = [c for c in dict.fromkeys(candidates) if c not in NOT_PACKAGES and c not in NOT_MODULES]
    if dist_name:
        wanted = re.sub(r"[-_.]+", "_", dist_name).lower()
        for c in candidates:
            if c.lower() == wanted:
                return c
    return candidates[0] if len(candidates) == 1 else None
