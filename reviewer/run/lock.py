"""One review at a time per machine, across every `reviewer` process.

The agents time installs, tests and benchmarks; a second review running beside them would make those numbers lie. So a
review holds an OS file lock (`filelock`, flock underneath: released by the kernel even when the process is killed) for
its whole length. The lock file is per machine, not per database or per user: /tmp/reviewer-review.lock unless
REVIEWER_LOCK_FILE (or a `lock_file` setting) says otherwise. Beside it, a small JSON side file names the holder (pid,
target, run id) so whoever waits can say what they wait for.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from filelock import FileLock, Timeout

DEFAULT_LOCK_FILE = Path("/tmp/reviewer-review.lock")


class LockBusy(Exception):
    """Another review holds the machine and we were told not to wait; one line for the user."""


def lock_path(settings=None) -> Path:
    configured = getattr(settings, "lock_file", None) or os.environ.get("REVIEWER_LOCK_FILE")
    return Path(configured).expanduser() if configured else DEFAULT_LOCK_FILE


def holder_path(lock_file: Path) -> Path:
    return lock_file.with_name(lock_file.name + ".holder.json")


def describe_holder(lock_file: Path) -> str:
    """'pid 123 on box, reviewing URL (run 4) since 12:00:01 UTC', or what little is known."""
    try:
        info = json.loads(holder_path(lock_file).read_text())
    except (OSError, ValueError):
        return f"holder unknown; lock file {lock_file}"
    parts = [f"pid {info.get('pid', '?')}"]
    if info.get("target"):
        parts.append(f"reviewing {info['target']}")
    if info.get("run_id") is not None:
        parts.append(f"run {info['run_id']} in {info.get('db', '?')}")
    if info.get("since"):
        parts.append(f"since {info['since']}")
    return ", ".join(parts) + f"; lock file {lock_file}"


def write_holder(lock_file: Path, info: dict) -> None:
    path = holder_path(lock_file)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)  # readers never see half a file


@contextmanager
def review_lock(
    lock_file: Path, *, wait: bool = True, holder: dict | None = None, on_wait: Callable[[str], None] = lambda msg: None
) -> Iterator[Callable[..., None]]:
    """Hold the machine for one review. Yields `update(**info)` to add to the holder record (e.g. the run id).

    With wait=False a busy machine raises LockBusy at once; otherwise `on_wait` is told once and we block until the
    holder finishes (Ctrl-C still interrupts).
    """
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(lock_file, mode=0o666)  # 0o666: one lock for every user of the machine
    try:
        lock.acquire(timeout=0)
    except Timeout:
        who = describe_holder(lock_file)
        if not wait:
            raise LockBusy(f"another review is running on this machine ({who}); run again without --no-wait to queue") from None
        started = time.monotonic()
        on_wait(f"Waiting for another review on this machine to finish ({who}) ...")
        lock.acquire(poll_interval=0.2)
        on_wait(f"Got the machine after waiting {time.monotonic() - started:.0f} s.")
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"), **(holder or {})}

    def update(**more) -> None:
        info.update(more)
        write_holder(lock_file, info)

    try:
        write_holder(lock_file, info)
        yield update
    finally:
        holder_path(lock_file).unlink(missing_ok=True)
        lock.release()
