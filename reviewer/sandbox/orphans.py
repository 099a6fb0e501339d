"""Folders a killed review leaves behind: its workspaces (with their loop-mounted disk images, diskcap.py), the
doctor's, and the sandbox's scratch folder. Each is named with its owner's pid, so the next command on the machine
(`reviewer run`, `loop` or `report`) can tell an orphan from a folder in use and remove it: 24-28 MB each, and a
mounted image, that would otherwise pile up in /tmp.

Here rather than beside the store's dead runs (reviewer/store/deadruns.py): removing a workspace means unmounting its
disk image, sandbox code that the store may not import; this folder imports only the leaf `reviewer.liveness`.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from reviewer.liveness import owner_alive
from reviewer.sandbox.workspace import KEPT_MARKER, remove_workspace

KEPT_SECONDS = 86400.0  # a failed persona's workspace, kept for a look, is swept this long after

# Folders a review makes, named with their owner's pid: workspaces (workspace.py, including the verifier's and the ref
# probe's), the doctor's, and the sandbox's scratch folder (isolation.py).
OWNED_FOLDER = re.compile(r"^(?:reviewer-.+|rvsb)-pid(\d+)-[A-Za-z0-9_]+$")


def removed_note(removed: int) -> str:
    """What the callers say after a sweep that removed something."""
    return f"removed {removed} workspace(s) and sandbox folder(s) left by killed reviews"


def is_orphan(path: Path) -> bool:
    """A folder named by OWNED_FOLDER whose owner is gone and that is not kept on purpose (or kept over a day ago).
    owner_alive compares the owner's start with the folder's last change, so a reused pid keeps no orphan alive."""
    match = OWNED_FOLDER.match(path.name)
    if not match or not path.is_dir() or path.is_symlink():
        return False
    try:
        changed = path.stat().st_mtime
        kept = (path / KEPT_MARKER).stat().st_mtime if (path / KEPT_MARKER).exists() else None
    except OSError:
        return False
    if owner_alive(int(match.group(1)), datetime.fromtimestamp(changed, timezone.utc)):
        return False
    return kept is None or time.time() - kept >= KEPT_SECONDS


def remove_orphans(parents: list[Path | None]) -> int:
    """Remove the orphans in the system's temporary folder and `parents` (a workspace through remove_workspace, which
    unmounts its disk image first). Returns how many went."""
    removed = 0
    for parent in dict.fromkeys(Path(p) for p in [*parents, tempfile.gettempdir()] if p):
        try:
            entries = list(parent.iterdir())
        except OSError:
            continue
        for path in entries:
            if is_orphan(path):
                (remove_workspace if path.name.startswith("reviewer-") else shutil.rmtree)(path)
                removed += 1
    return removed
