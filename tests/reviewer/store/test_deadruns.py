"""Runs whose process is gone (reviewer/store/deadruns.py): a real SQLite database and real processes, one that has
exited and one alive; only the runs of this machine whose owner is gone, or whose pid now belongs to a process started
after the run (a reused pid), become interrupted, with their running persona rows."""

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta

from sqlmodel import select

from reviewer.store import db, deadruns
from reviewer.store.db import PersonaRun, ReviewRun


def exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def add_run(s, repo_id: int, pid: int, *, host: str | None = None, status: str = "running", ago: float = 0.0) -> int:
    machine = json.dumps({"hostname": host}) if host else None
    run = ReviewRun(repository_id=repo_id, commit_sha=f"{pid:040d}", status=status, pid=pid, machine=machine,
                    started_at=db.utcnow() - timedelta(seconds=ago))
    s.add(run)
    s.flush()
    s.add(PersonaRun(run_id=run.id, persona="smoke", status="running"))
    s.add(PersonaRun(run_id=run.id, persona="docs", status="completed"))
    return run.id


def test_only_this_machines_runs_whose_owner_is_gone_become_interrupted(tmp_path):
    path, dead = str(tmp_path / "r.db"), exited_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with db.session(path) as s:
            repo = db.get_or_create_repository(s, "file:///x")
            ids = {"dead": add_run(s, repo.id, dead, host=socket.gethostname()),
                   "dead, no host recorded": add_run(s, repo.id, dead),
                   "reused pid": add_run(s, repo.id, live.pid, ago=3600.0),  # its process started after the run
                   "ours": add_run(s, repo.id, os.getpid()),
                   "alive": add_run(s, repo.id, live.pid, ago=-5.0),
                   "another machine": add_run(s, repo.id, dead, host="elsewhere.example"),
                   "finished": add_run(s, repo.id, dead, status="completed")}
            s.commit()
        with db.session(path) as s:
            marked = deadruns.interrupt_dead_runs(s)
            s.commit()
        assert sorted(r.run_id for r in marked) == sorted([ids["dead"], ids["dead, no host recorded"],
                                                           ids["reused pid"]])
        first = next(r for r in marked if r.run_id == ids["dead"])
        assert (first.url, first.pid, first.commit_sha) == ("file:///x", dead, f"{dead:040d}")
        assert first.message == (f"run {ids['dead']} (file:///x @ {f'{dead:040d}'[:12]}) was left running by pid "
                                 f"{dead}: marked interrupted")
        with db.session(path) as s:
            status = {name: s.get(ReviewRun, i).status for name, i in ids.items()}
            personas = {(p.run_id, p.persona): (p.status, p.error) for p in s.exec(select(PersonaRun)).all()}
            error = s.get(ReviewRun, ids["dead"]).error
            assert deadruns.interrupt_dead_runs(s) == []  # nothing left to mark while `live` lives
    finally:
        live.kill()
        live.wait()
    assert status == {"dead": "interrupted", "dead, no host recorded": "interrupted", "reused pid": "interrupted",
                      "ours": "running", "alive": "running", "another machine": "running", "finished": "completed"}
    assert f"pid {dead}" in error and "ended without finishing" in error
    assert personas[(ids["dead"], "smoke")] == ("interrupted", error)
    assert personas[(ids["dead"], "docs")] == ("completed", None)  # what it finished stays as it was
    assert personas[(ids["alive"], "smoke")] == ("running", None)
