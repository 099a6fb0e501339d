"""What a review killed with SIGKILL leaves behind, and who cleans it up (issues 29 and 42): the first command to
notice the run is dead, `reviewer report` here, shows its run as interrupted at once (it used to say `running` until
some later `reviewer run`) and removes its workspace (a disk-capped mount on a loop device, where the machine allows:
it used to stay mounted until the next review) and its sandbox scratch folder, leaving alone what a live process
owns. Real processes, a real database, a real sandbox; nothing mocked."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from reviewer.sandbox import diskcap
from tests.reviewer.run.test_run import make_repo, running

ROOT = Path(__file__).resolve().parents[3]


def reviewer(*args: str, env: dict, cwd: Path, wait: bool = True):
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    argv = [sys.executable, "-m", "reviewer.cli", *args]
    if wait:
        return subprocess.run(argv, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=300)
    return subprocess.Popen(argv, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def leftovers(folder: Path, pid: int) -> list[Path]:
    return sorted(p for p in folder.iterdir() if f"-pid{pid}-" in p.name)


def mounted(path: Path) -> bool:
    return any(line.split()[1] == str(path) for line in Path("/proc/self/mounts").read_text().splitlines())


def test_sigkilled_review_is_reconciled_and_swept_by_report(tmp_path):
    marker = f"300.{os.getpid()}{time.monotonic_ns() % 10**6}"
    hang = make_repo(tmp_path / "hang", {"Makefile": f"test:\n\tsleep {marker}\n"})
    quick = make_repo(tmp_path / "quick", {"Makefile": "test:\n\ttrue\n"})
    work, scratch, db = tmp_path / "work", tmp_path / "tmp", tmp_path / "reviews.db"
    scratch.mkdir()
    env = {"REVIEWER_LOCK_FILE": str(tmp_path / "review.lock"), "REVIEWER_WORKDIR": str(work),
           "TMPDIR": str(scratch), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    proc = reviewer("run", str(hang), "--db", str(db), "--persona", "smoke", env=env, cwd=tmp_path, wait=False)
    deadline = time.monotonic() + 120
    while not running(marker) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(marker), proc.communicate()
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 30
    while running(marker) and time.monotonic() < deadline:  # bwrap --die-with-parent takes the command with it
        time.sleep(0.1)

    # What the kill left: the workspace and the sandbox's scratch folder, both named after the dead pid.
    [workspace] = [p for p in leftovers(work, proc.pid) if p.is_dir()]
    assert (workspace / "repo" / "Makefile").exists()
    if diskcap.unavailable_reason() is None:  # root: the workspace is its own disk-capped file system
        assert mounted(workspace) and Path(str(workspace) + ".img").is_file()
    assert leftovers(scratch, proc.pid), list(scratch.iterdir())
    # Folders of a live process, and folders without an owner's pid, are not ours to remove.
    live = work / f"reviewer-other-pid{os.getpid()}-abc123"
    unowned = work / "reviewer-old-abc123"
    for folder in (live, unowned):
        folder.mkdir()

    shown = reviewer("report", "--db", str(db), "--format", "json", env=env, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    [run] = json.loads(shown.stdout)["runs"]  # stdout stays pure JSON; what was reconciled is said on stderr
    assert run["status"] == "interrupted" and "ended without finishing" in run["error"], run
    assert [(p["name"], p["status"]) for p in run["personas"]] == [("smoke", "interrupted")]
    assert "marked interrupted" in shown.stderr
    assert not workspace.exists() and not mounted(workspace)
    assert not Path(str(workspace) + ".img").exists()
    assert leftovers(work, proc.pid) == [] and leftovers(scratch, proc.pid) == []
    assert live.is_dir() and unowned.is_dir()
    assert "left by killed reviews" in shown.stderr

    again = reviewer("run", str(quick), "--db", str(db), "--persona", "smoke", env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert live.is_dir() and unowned.is_dir()
    assert "left by killed reviews" not in again.stdout  # nothing left for it


def test_report_on_a_file_that_is_not_a_database_is_one_line(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database\n" * 100)
    for path in ("/etc/passwd", str(notes)):
        done = reviewer("report", "--db", path, env={"XDG_CONFIG_HOME": str(tmp_path / "config")}, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and f"cannot open the database {path}" in lines[0], done.stderr
        assert "Traceback" not in done.stderr + done.stdout


def test_report_paths_with_a_missing_folder_are_errors(tmp_path):
    """A typo in --db or -o is an error (it used to be "No reviews yet" and "Wrote ..."): one line, exit code 2, no
    traceback, nothing written. A database file not made yet in a folder that exists is still "No reviews yet"."""
    env, db = {"XDG_CONFIG_HOME": str(tmp_path / "config")}, tmp_path / "reviews.db"
    missing_db = tmp_path / "missing" / "dir" / "x.db"
    missing = reviewer("report", "--db", str(missing_db), env=env, cwd=tmp_path)
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert missing.stderr.strip().splitlines() == [
        f"error: no database at {missing_db}: the folder {missing_db.parent} does not exist"], missing.stderr
    assert "No reviews" not in missing.stdout and not (tmp_path / "missing").exists()
    for fmt in ("html", "markdown", "json", "table"):
        out = tmp_path / "nonexistent" / "dir" / f"r.{fmt}"
        done = reviewer("report", "--db", str(db), "--format", fmt, "-o", str(out), env=env, cwd=tmp_path)
        assert done.returncode == 2, (fmt, done.stdout, done.stderr)
        assert done.stderr.strip().splitlines() == [
            f"error: cannot write {out}: the folder {out.parent} does not exist"], done.stderr
        assert "Wrote" not in done.stdout and "Traceback" not in done.stderr
    assert not (tmp_path / "nonexistent").exists() and not db.exists()
    fresh = reviewer("report", "--db", str(db), env=env, cwd=tmp_path)
    assert fresh.returncode == 0 and "No reviews" in fresh.stdout, fresh.stdout + fresh.stderr
    helped = reviewer("report", "--help", env=env, cwd=tmp_path)
    assert "marked interrupted first" in " ".join(helped.stdout.split()), helped.stdout
