"""Runs whose process is gone: a review killed with SIGKILL (or lost to a power cut) leaves its run and its persona
rows `running`; the next command on the machine to open the database (`reviewer run`, `loop` or `report`) marks them
`interrupted`, keeping what they recorded. Only runs of this machine: on a shared database a pid means nothing on
another box, and those runs are left to their queue leases (reviewer/run/recovery.py).

The folders such a review leaves behind are the sandbox's to remove (reviewer/sandbox/orphans.py): the store imports
nothing of the reviewer but the leaf `reviewer.liveness`, so whoever may import both calls both.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

from sqlmodel import Session, select

from reviewer.liveness import owner_alive
from reviewer.store import db
from reviewer.store.db import PersonaRun, Repository, ReviewRun


@dataclass(frozen=True)
class DeadRun:
    """A run just marked interrupted, with what its caller needs to say so and to queue its commit again."""
    run_id: int
    repository_id: int
    url: str
    commit_sha: str | None
    ref: str | None
    pid: int | None

    @property
    def message(self) -> str:
        return (f"run {self.run_id} ({self.url} @ {(self.commit_sha or '?')[:12]}) was left running by pid {self.pid}: "
                "marked interrupted")


def run_host(run: ReviewRun) -> str | None:
    """The hostname a run was made on (from its machine fingerprint); None where it is not recorded."""
    try:
        return json.loads(run.machine or "{}").get("hostname")
    except (ValueError, AttributeError):
        return None


def interrupt_run(s: Session, run: ReviewRun, why: str) -> None:
    """A run whose process is gone: it and its running persona rows become `interrupted`; what they recorded stays."""
    for p in s.exec(select(PersonaRun).where(PersonaRun.run_id == run.id, PersonaRun.status == "running")).all():
        p.status, p.error, p.finished_at = "interrupted", why, db.utcnow()
        s.add(p)
    run.status, run.error, run.finished_at = "interrupted", why, db.utcnow()
    s.add(run)


def interrupt_dead_runs(s: Session) -> list[DeadRun]:
    """Runs of this machine left `running` by a process that is gone (kill -9, power loss) become interrupted, in the
    session (the caller commits). Runs of other machines, and this process's own, are left alone."""
    host = socket.gethostname()
    dead: list[DeadRun] = []
    for run in s.exec(select(ReviewRun).where(ReviewRun.status == "running")).all():
        if run.pid == os.getpid() or (run_host(run) not in (None, host)):
            continue  # ours, or another machine's
        if owner_alive(run.pid, run.started_at):
            continue  # alive: reviewing (under another box lock) or between its last row and its exit
        why = f"the reviewing process (pid {run.pid}) ended without finishing the run (killed or crashed)"
        interrupt_run(s, run, why)
        url = s.get(Repository, run.repository_id).url
        dead.append(DeadRun(run_id=run.id, repository_id=run.repository_id, url=url, commit_sha=run.commit_sha,
                            ref=run.ref, pid=run.pid))
    return dead
