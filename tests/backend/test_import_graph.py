"""The backend's import graph (tests/import_graph.py): no circle, the folders import each other only in the direction
of backend/README.md's table (server -> decoding -> models and dflash; bench and train drive decoding as the server
does), and imports inside functions only where they keep torch off the server's listening path."""

import subprocess
import sys
from pathlib import Path

from tests.import_graph import circles, import_graph

ROOT = Path(__file__).resolve().parents[2]

# Folder (or top-level module) of backend -> what of backend it may import.
MAY_IMPORT = {
    "server": {"decoding", "dflash", "loading", "chat"},
    "bench": {"decoding", "dflash", "models", "loading", "chat"},
    "train": {"decoding", "dflash", "loading", "chat"},
    "decoding": {"models", "dflash", "sampling"},
    "dflash": {"models", "sampling"},
    "models": set(),
    "loading": set(), "chat": set(), "sampling": set(),
}
# The server binds its socket before torch loads: these imports wait until a request or the loading thread needs them.
LAZY_OK = {("backend.server.jobs", "backend.decoding.engine"), ("backend.server.state", "backend.decoding.engine"),
           ("backend.server.state", "backend.dflash.checkpoint"), ("backend.server.state", "backend.decoding.llamacpp")}


def part(module: str) -> str:
    """backend.server.app -> server; backend.chat -> chat."""
    return module.split(".")[1] if "." in module else module


def test_the_backend_has_no_import_circle():
    assert circles(import_graph("backend")) == []


def test_the_command_line_check_passes():
    proc = subprocess.run([sys.executable, "-m", "tests.import_graph", "backend"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "0 circle(s)" in proc.stdout, proc.stdout + proc.stderr


def test_folders_import_only_downward():
    wrong = [f"{e.source}:{e.line} imports {e.target}" for e in import_graph("backend")
             if part(e.source) != part(e.target) and e.target != "backend"
             and part(e.target) not in MAY_IMPORT.get(part(e.source), set())]
    assert wrong == []


def test_imports_inside_functions_only_keep_torch_off_the_listening_path():
    lazy = {(e.source, e.target) for e in import_graph("backend") if e.lazy and e.target.count(".") >= 2}
    assert lazy <= LAZY_OK, sorted(lazy - LAZY_OK)
