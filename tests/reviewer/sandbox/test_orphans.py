"""The folders of dead processes (reviewer/sandbox/orphans.py), in a real folder with real processes: a folder named
with a pid whose process is gone goes, one of a live process, one without a pid, one kept on purpose less than a day
ago and a plain file stay. The system's temporary folder is pointed at the test's own, so no one else's is touched."""

import os
import subprocess
import sys
import tempfile
import time

from reviewer.sandbox import orphans
from reviewer.sandbox.workspace import KEPT_MARKER


def test_only_the_folders_of_dead_processes_go(tmp_path, monkeypatch):
    work, scratch = tmp_path / "work", tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead, alive = proc.pid, os.getpid()
    gone = [work / f"reviewer-smoke-pid{dead}-abc123", scratch / f"rvsb-pid{dead}-x_y9",
            work / f"reviewer-docs-pid{dead}-kept01"]
    stay = [work / f"reviewer-smoke-pid{alive}-abc123", work / "reviewer-old-abc123",
            work / f"reviewer-docs-pid{dead}-kept02", work / f"unrelated-pid{dead}-abc"]
    for folder in gone + stay:
        (folder / "repo").mkdir(parents=True)
        (folder / "repo" / "Makefile").write_text("test:\n\ttrue\n")
    (gone[2] / KEPT_MARKER).write_text("kept\n")
    long_ago = time.time() - orphans.KEPT_SECONDS - 60
    os.utime(gone[2] / KEPT_MARKER, (long_ago, long_ago))
    (stay[2] / KEPT_MARKER).write_text("kept\n")
    a_file = work / f"reviewer-file-pid{dead}-abc"
    a_file.write_text("not a folder\n")

    assert orphans.remove_orphans([work, None]) == 3
    assert [p for p in gone if p.exists()] == []
    assert [p for p in stay if not p.is_dir()] == [] and a_file.is_file()
    assert orphans.remove_orphans([work]) == 0
    assert orphans.removed_note(3) == "removed 3 workspace(s) and sandbox folder(s) left by killed reviews"
