"""What a killed review leaves behind, put right by the next `reviewer run` or `loop` on the machine: runs left
`running` by a dead process become `interrupted` (reviewer/store/deadruns.py, which `reviewer report` calls too), the
watched ones are queued again, dead workers' queue rows and expired leases go back to the queue, and the workspaces
and sandbox folders of dead processes are removed (reviewer/sandbox/orphans.py)."""

from __future__ import annotations

import socket
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from sqlalchemy import update
from sqlmodel import select

from reviewer.liveness import owner_alive
from reviewer.run.queue import enqueue, me, worker_name
from reviewer.run.view import log
from reviewer.sandbox import orphans
from reviewer.store import db, deadruns
from reviewer.store.db import ReviewQueue, ReviewRun
from reviewer.store.deadruns import interrupt_run, run_host


def claimer(row: ReviewQueue) -> tuple[str, int | None]:
    """(host, pid) from a row's claimed_by "host:pid"."""
    host, _, pid = (row.claimed_by or "").rpartition(":")
    return host, int(pid) if pid.isdigit() else None


def recover_dead_runs(s, watched_urls: list[str], console: Console) -> int:
    """Runs of this machine left `running` by a process that is gone become interrupted (store/deadruns.py); those of
    a watched repository are queued again. Runs of other machines are left to their leases (a shared database)."""
    dead = deadruns.interrupt_dead_runs(s)
    for run in dead:
        log(console, run.message, "yellow")
        if run.url in watched_urls and run.commit_sha and enqueue(s, run.repository_id, run.commit_sha, run.ref,
                                                                  run_id=run.run_id, attempts=1):
            log(console, f"queued {run.commit_sha[:12]} of {run.url} again", "yellow")
    return len(dead)


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
    """The workspaces and sandbox folders of dead processes in `parents` and the temporary folder, removed
    (sandbox/orphans.py), said in the log. Returns how many went."""
    removed = orphans.remove_orphans(parents)
    if removed:
        log(console, orphans.removed_note(removed), "yellow")
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
