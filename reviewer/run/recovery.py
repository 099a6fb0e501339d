"""What a killed review leaves behind, put right by the next `reviewer run`, `loop` or `report` on the machine: runs
left `running` by a dead process become `interrupted`, dead workers' queue rows go back to the queue, and the
workspaces and sandbox folders of dead processes are removed."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from sqlalchemy import update
from sqlmodel import select

from reviewer.run.queue import enqueue, me, worker_name
from reviewer.run.view import log
from reviewer.sandbox.workspace import KEPT_MARKER, remove_workspace
from reviewer.store import db
from reviewer.store.db import PersonaRun, Repository, ReviewQueue, ReviewRun

KEPT_SECONDS = 86400.0  # a failed persona's workspace, kept for a look, is swept this long after


# Folders a review makes, named with their owner's pid: workspaces (reviewer/sandbox/workspace.py, including the
# verifier's and the ref probe's), the doctor's, and the sandbox's scratch folder (reviewer/sandbox/isolation.py).
OWNED_FOLDER = re.compile(r"^(?:reviewer-.+|rvsb)-pid(\d+)-[A-Za-z0-9_]+$")


def process_start_time(pid: int) -> float | None:
    """When a process started (seconds since the epoch), from /proc; None where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def owner_alive(pid: int | None, since: datetime | None) -> bool:
    """Is the process that started a run still that process? (A pid can be reused after a crash or a reboot.)"""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    started = process_start_time(pid)
    if started is None or since is None:
        return True
    since_epoch = (since if since.tzinfo else since.replace(tzinfo=timezone.utc)).timestamp()
    return started <= since_epoch + 1.0


def run_host(run: ReviewRun) -> str | None:
    try:
        return json.loads(run.machine or "{}").get("hostname")
    except (ValueError, AttributeError):
        return None


def claimer(row: ReviewQueue) -> tuple[str, int | None]:
    """(host, pid) from a row's claimed_by "host:pid"."""
    host, _, pid = (row.claimed_by or "").rpartition(":")
    return host, int(pid) if pid.isdigit() else None


def interrupt_run(s, run: ReviewRun, why: str) -> None:
    """A run whose process is gone: it and its running persona rows become `interrupted`; what they recorded stays."""
    for p in s.exec(select(PersonaRun).where(PersonaRun.run_id == run.id, PersonaRun.status == "running")).all():
        p.status, p.error, p.finished_at = "interrupted", why, db.utcnow()
        s.add(p)
    run.status, run.error, run.finished_at = "interrupted", why, db.utcnow()
    s.add(run)


def recover_dead_runs(s, watched_urls: list[str], console: Console) -> int:
    """Runs of this machine left `running` by a process that is gone (kill -9, power loss) become interrupted. Runs of
    other machines are left to their leases (a shared database): a pid means nothing on another box."""
    host = socket.gethostname()
    recovered = 0
    for run in s.exec(select(ReviewRun).where(ReviewRun.status == "running")).all():
        if run.pid == os.getpid() or (run_host(run) not in (None, host)):
            continue  # ours, or another machine's
        if owner_alive(run.pid, run.started_at):
            continue  # alive: reviewing (under another box lock) or between its last row and its exit
        why = f"the reviewing process (pid {run.pid}) ended without finishing the run (killed or crashed)"
        interrupt_run(s, run, why)
        recovered += 1
        url = s.get(Repository, run.repository_id).url
        log(console, f"run {run.id} ({url} @ {(run.commit_sha or '?')[:12]}) was left running by pid {run.pid}: "
                     "marked interrupted", "yellow")
        if url in watched_urls and run.commit_sha and enqueue(s, run.repository_id, run.commit_sha, run.ref,
                                                              run_id=run.id, attempts=1):
            log(console, f"queued {run.commit_sha[:12]} of {url} again", "yellow")
    return recovered


def requeue_own_dead_jobs(s, worker: str, console: Console) -> int:
    """Jobs this worker (same name, same box) claimed in a process that is gone: queued again at once, without waiting
    for their lease. Other workers' jobs, even on this box, wait for their lease."""
    host = socket.gethostname()
    requeued = 0
    for row in s.exec(select(ReviewQueue).where(ReviewQueue.status == "running")).all():
        claimed_host, pid = claimer(row)
        if row.claimed_by == me() or claimed_host not in ("", host) or row.worker not in (None, worker):
            continue
        if claimed_host and owner_alive(pid, row.started_at):
            continue
        done = s.execute(update(ReviewQueue).where(ReviewQueue.id == row.id, ReviewQueue.claimed_by == row.claimed_by,
                                                   ReviewQueue.status == "running").values(
            status="queued", claimed_by=None, lease_expires_at=None,
            error="the loop reviewing it ended without finishing (killed or crashed); queued again")).rowcount
        if done:
            requeued += 1
            log(console, f"queue item {row.id} ({row.commit_sha[:12]}) was left running: queued again", "yellow")
    return requeued


def requeue_expired(s, console: Console) -> int:
    """Jobs whose lease ran out (their worker stopped renewing it: killed, crashed, cut off) go back to the queue; the
    run their worker had started is marked interrupted. Whoever polls does this; the UPDATE re-checks the expiry, so a
    lease renewed a moment ago is left alone."""
    now = db.db_now(s)
    requeued = 0
    expired = s.exec(select(ReviewQueue).where(ReviewQueue.status == "running", ReviewQueue.lease_expires_at != None,  # noqa: E711
                                               ReviewQueue.lease_expires_at < now)).all()
    for row in expired:
        late = (now - as_utc(row.heartbeat_at)).total_seconds() if row.heartbeat_at else None
        why = (f"worker {row.worker or '?'} ({row.claimed_by}) stopped renewing its lease"
               + (f" (last heartbeat {late:.0f} s ago)" if late is not None else "") + "; queued again")
        done = s.execute(update(ReviewQueue).where(ReviewQueue.id == row.id, ReviewQueue.status == "running",
                                                   ReviewQueue.lease_expires_at < now).values(
            status="queued", claimed_by=None, lease_expires_at=None, error=why)).rowcount
        if not done:
            continue  # renewed or taken care of by another worker in the meantime
        requeued += 1
        host, pid = claimer(row)
        for run in s.exec(select(ReviewRun).where(ReviewRun.repository_id == row.repository_id,
                                                  ReviewRun.commit_sha == row.commit_sha,
                                                  ReviewRun.status == "running", ReviewRun.pid == pid)).all():
            if run_host(run) in (None, host):
                interrupt_run(s, run, f"its worker {row.worker or '?'} stopped renewing its lease (killed or cut off)")
        log(console, f"queue item {row.id} ({row.commit_sha[:12]}): lease expired, {why}", "yellow")
    return requeued


def remove_orphans(parents: list[Path | None], console: Console) -> int:
    """Workspaces and sandbox scratch folders whose process is gone (killed before it could remove them: 24-28 MB
    each, piling up in /tmp), from the system's temporary folder and `parents`. The pid in a folder's name is its
    owner; owner_alive compares that process's start with the folder's last change, so a reused pid does not keep
    an orphan alive. A workspace kept on purpose (KEPT_MARKER) goes a day after it was kept. Returns how many went."""
    removed = 0
    for parent in dict.fromkeys(Path(p) for p in [*parents, tempfile.gettempdir()] if p):
        try:
            entries = list(parent.iterdir())
        except OSError:
            continue
        for path in entries:
            match = OWNED_FOLDER.match(path.name)
            if not match or not path.is_dir() or path.is_symlink():
                continue
            try:
                changed = path.stat().st_mtime
                kept = (path / KEPT_MARKER).stat().st_mtime if (path / KEPT_MARKER).exists() else None
            except OSError:
                continue
            if owner_alive(int(match.group(1)), datetime.fromtimestamp(changed, timezone.utc)):
                continue
            if kept is not None and time.time() - kept < KEPT_SECONDS:
                continue
            (remove_workspace if path.name.startswith("reviewer-") else shutil.rmtree)(path)
            removed += 1
    if removed:
        log(console, f"removed {removed} workspace(s) and sandbox folder(s) left by killed reviews", "yellow")
    return removed


def as_utc(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def recover(db_path: str, watched_urls: list[str], console: Console, worker: str | None = None) -> int:
    """Call with the machine lock held. Dead runs of this machine become interrupted; this worker's own dead jobs and
    every job whose lease expired are queued again. Returns how many rows were recovered."""
    with db.session(db_path) as s:
        recovered = recover_dead_runs(s, watched_urls, console)
        recovered += requeue_own_dead_jobs(s, worker or worker_name(), console)
        recovered += requeue_expired(s, console)
        s.commit()
    return recovered
