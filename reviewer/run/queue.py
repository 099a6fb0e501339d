"""The review queue in the database, shared by every worker of `reviewer loop`: one row per (repository, commit),
claimed atomically, held by a lease that a heartbeat renews."""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

from rich.console import Console
from sqlalchemy import update
from sqlmodel import select

from reviewer.run.view import log
from reviewer.store import db
from reviewer.store.db import Repository, ReviewQueue, ReviewRun
from reviewer.text import first_line

REVIEWED = ("completed", "failed")  # run statuses that count as "this commit was reviewed"


def me() -> str:
    """This process, as a queue row's `claimed_by`: unique among live processes of every box."""
    return f"{socket.gethostname()}:{os.getpid()}"


def worker_name(settings=None) -> str:
    """The worker's name in the queue and the report: `worker` setting, REVIEWER_WORKER, else the host name (so a loop
    restarted on the same box is the same worker and takes back its own dead job at once)."""
    return getattr(settings, "worker", None) or os.environ.get("REVIEWER_WORKER") or socket.gethostname()


def already_reviewed(s, repository_id: int, commit: str) -> bool:
    if s.exec(select(ReviewQueue).where(ReviewQueue.repository_id == repository_id,
                                        ReviewQueue.commit_sha == commit)).first():
        return True  # queued, running, done or given up: nothing new to add
    return s.exec(select(ReviewRun).where(ReviewRun.repository_id == repository_id, ReviewRun.commit_sha == commit,
                                          ReviewRun.status.in_(REVIEWED))).first() is not None  # type: ignore[attr-defined]


def enqueue(s, repository_id: int, commit: str, ref: str | None, **values) -> bool:
    """One queue row per (repository, commit), however many loops see the commit at once (a unique index and
    INSERT ... ON CONFLICT DO NOTHING). True when this call added it."""
    row = {"repository_id": repository_id, "commit_sha": commit, "ref": ref, "status": "queued", "attempts": 0,
           "enqueued_at": db.utcnow(), **values}
    return db.insert_ignore(s, ReviewQueue, row, ["repository_id", "commit_sha"])


def claim(s, urls: list[str], worker: str, lease: float) -> ReviewQueue | None:
    """Take the oldest queued row of the watched repositories, atomically: on PostgreSQL `SELECT ... FOR UPDATE SKIP
    LOCKED` (workers of other boxes skip the row one of them is taking), and everywhere a compare-and-set UPDATE
    (`WHERE status = 'queued'`), so that two workers never both think they own a row. The claimed row carries a
    lease of `lease` seconds of database time."""
    repo_ids = s.exec(select(Repository.id).where(Repository.url.in_(urls))).all()  # type: ignore[attr-defined]
    for _ in range(10):  # each miss means another worker won that row: try the next one
        row = s.exec(select(ReviewQueue).where(ReviewQueue.status == "queued",
                                               ReviewQueue.repository_id.in_(repo_ids))  # type: ignore[attr-defined]
                     .order_by(ReviewQueue.id).limit(1).with_for_update(skip_locked=True)).first()
        if row is None:
            s.rollback()
            return None
        now = db.db_now(s)
        won = s.execute(update(ReviewQueue).where(ReviewQueue.id == row.id, ReviewQueue.status == "queued").values(
            status="running", claimed_by=me(), worker=worker, started_at=now, heartbeat_at=now,
            lease_expires_at=now + timedelta(seconds=lease), attempts=ReviewQueue.attempts + 1)).rowcount == 1
        s.commit()
        if won:
            s.refresh(row)
            return row
    return None


def release(db_path: str, row_id: int, **values) -> bool:
    """Update a row this process claimed, and drop the claim; False (nothing written) when the row is no longer ours
    (our lease lapsed and another worker took it over)."""
    with db.session(db_path) as s:
        done = s.execute(update(ReviewQueue).where(ReviewQueue.id == row_id, ReviewQueue.claimed_by == me()).values(
            claimed_by=None, lease_expires_at=None, **values)).rowcount == 1
        s.commit()
    return done


class Heartbeat:
    """Renews a claimed row's lease every lease/3 seconds on a thread, for as long as the review (and its
    verification) runs: a live worker's job is never taken from it, however slow it is; a dead one's lease runs out
    and another worker queues the job again (`requeue_expired`)."""

    def __init__(self, db_path: str, row_id: int, lease: float, console: Console):
        self.db_path, self.row_id, self.lease, self.console = db_path, row_id, lease, console
        self.lost = False
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, name=f"lease-{row_id}", daemon=True)

    def renew(self) -> bool:
        with db.session(self.db_path) as s:
            now = db.db_now(s)
            renewed = s.execute(update(ReviewQueue).where(
                ReviewQueue.id == self.row_id, ReviewQueue.claimed_by == me(), ReviewQueue.status == "running").values(
                heartbeat_at=now, lease_expires_at=now + timedelta(seconds=self.lease))).rowcount == 1
            s.commit()
        return renewed

    def run(self) -> None:
        while not self.stop_event.wait(self.lease / 3):
            try:
                if not self.renew():
                    self.lost = True
                    log(self.console, f"queue item {self.row_id}: our lease lapsed and another worker took the job "
                                      "over; this review goes on, its result stays beside theirs", "red")
                    return
            except Exception as e:  # noqa: BLE001 - a database hiccup: try again next beat (the lease has slack)
                log(self.console, f"queue item {self.row_id}: could not renew the lease: {first_line(e)}",
                    "yellow")

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.thread.join(timeout=30)
