"""Scale-out (issue 11): one PostgreSQL database as the shared review queue of several `reviewer loop` workers.

A real PostgreSQL server (tests/postgres.py: initdb + pg_ctl in a temporary folder), real git repositories, the real
CLI as subprocesses, the smoke persona (deterministic, no LLM). Worker "boxes" are simulated by lock files: each box has
its own machine lock (REVIEWER_LOCK_FILE), and two workers share one box to show that a box still runs one review at a
time. The schema is made and upgraded in place on both SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from rich.console import Console
from sqlalchemy import inspect, text

from reviewer.run.loop import LoopError, lease_seconds
from reviewer.run.queue import Heartbeat, claim, enqueue
from reviewer.run.recovery import recover
from reviewer.store import db
from tests.postgres import pg_database, postgres  # noqa: F401  (fixtures)
from tests.reviewer.run.test_loop import commit_change, make_project
from tests.scripted_llm import scripted_llm  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[3]
LOOP_CLI = "import sys; from reviewer import cli; sys.argv = ['reviewer'] + sys.argv[1:]; cli.main()"
quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115


def rows(url: str, sql: str, **params) -> list[tuple]:
    with db.get_engine(url).connect() as conn:
        return [tuple(r) for r in conn.execute(text(sql), params).all()]


def wait_until(what: str, check, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def utc(dt):
    """A timestamp from a raw query as an aware UTC datetime (SQLite hands back text, PostgreSQL naive UTC)."""
    if isinstance(dt, str):
        dt = datetime.fromisoformat(dt)
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


# --- schema ---------------------------------------------------------------------------------------------------------

def downgrade_to_v2(url: str) -> None:
    """Make a current database look like one written by schema v2: no v3 or v4 columns, no unique index, version 2."""
    with db.get_engine(url).begin() as conn:
        conn.execute(text("DROP INDEX uq_reviewqueue_repo_commit"))
        for table, column in [("reviewqueue", "worker"), ("reviewqueue", "lease_expires_at"),
                              ("reviewqueue", "heartbeat_at"), ("reviewrun", "worker"),
                              ("personarun", "tokens_estimated")]:
            conn.execute(text(f'ALTER TABLE "{table}" DROP COLUMN "{column}"'))
        conn.execute(text("UPDATE meta SET value = '2' WHERE key = 'schema_version'"))
        conn.execute(text("INSERT INTO repository (url, created_at) VALUES ('file:///r', '2026-01-01')"))
        for status in ("done", "queued"):  # two loops that polled at once before v3 queued one commit twice
            conn.execute(text("INSERT INTO reviewqueue (repository_id, commit_sha, status, attempts, enqueued_at) "
                              "VALUES (1, 'abc', :status, 1, '2026-01-01')"), {"status": status})
    db.get_engine(url).dispose()
    db._engines.pop(db.database_url(url))


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_schema_is_created_and_upgraded_in_place(backend, tmp_path, request):
    url = str(tmp_path / "r.db") if backend == "sqlite" else request.getfixturevalue("pg_database")()
    db.get_engine(url)
    downgrade_to_v2(url)
    engine = db.get_engine(url)  # opens the v2 database and upgrades it
    with engine.connect() as conn:
        assert db.stored_version(conn) == db.SCHEMA_VERSION == 4
        assert "tokens_estimated" in {c["name"] for c in inspect(conn).get_columns("personarun")}  # v4
        columns = {c["name"] for c in inspect(conn).get_columns("reviewqueue")}
        assert {"worker", "lease_expires_at", "heartbeat_at"} <= columns
        assert "worker" in {c["name"] for c in inspect(conn).get_columns("reviewrun")}
        assert any(i["name"] == "uq_reviewqueue_repo_commit" and i["unique"]
                   for i in inspect(conn).get_indexes("reviewqueue"))
    assert rows(url, "SELECT status FROM reviewqueue") == [("done",)]  # the older row kept, its duplicate merged
    with db.session(url) as s:  # and now a commit is queued once, however often it is offered
        assert not enqueue(s, 1, "abc", None)
        assert enqueue(s, 1, "def", None) and not enqueue(s, 1, "def", None)
        s.commit()
    assert len(rows(url, "SELECT id FROM reviewqueue")) == 2


def test_postgres_url_forms_and_a_server_that_is_down(pg_database, tmp_path):
    url = pg_database()
    assert db.database_url(url).startswith("postgresql+psycopg://")
    assert db.database_url(url.replace("postgresql://", "postgres://")).startswith("postgresql+psycopg://")
    assert db.display_url("postgresql://me:secret@host/db") == "postgresql://me:***@host/db"
    from typer.testing import CliRunner

    from reviewer import cli

    dead = "postgresql://me:secret@127.0.0.1:1/reviews"
    result = CliRunner().invoke(cli.app, ["loop", "--db", dead, "--persona", "smoke", "--once", "--repo",
                                          str(make_project(tmp_path / "p", test_seconds=0))])
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and "cannot open the database postgresql://me:***@127.0.0.1:1/reviews" in out
    assert "secret" not in result.output and "Traceback" not in result.output


# --- claims and leases, in process ------------------------------------------------------------------------------------

def queue_commits(url: str, count: int) -> list[str]:
    with db.session(url) as s:
        repo = db.get_or_create_repository(s, "file:///shared")
        commits = [f"{i:040x}" for i in range(count)]
        for c in commits:
            enqueue(s, repo.id, c, "main")
        s.commit()
    return commits


def test_concurrent_claims_take_each_row_once(pg_database):
    """Eight threads (eight connections) claim from one queue at once: every row is taken by exactly one of them."""
    url = pg_database()
    commits = queue_commits(url, 24)
    taken: list[tuple[str, int]] = []
    start = threading.Barrier(8)

    def worker(name: str) -> None:
        start.wait()
        while True:
            with db.session(url) as s:
                row = claim(s, ["file:///shared"], name, 60)
            if row is None:
                return
            taken.append((name, row.id))

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ids = [row_id for _, row_id in taken]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == len(commits)
    assert rows(url, "SELECT count(*) FROM reviewqueue WHERE status = 'running' AND attempts = 1") == [(24,)]
    assert len({name for name, _ in taken}) > 1  # the work was actually shared


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_heartbeat_keeps_a_slow_job_and_an_expired_lease_is_requeued(backend, tmp_path, request):
    url = str(tmp_path / "r.db") if backend == "sqlite" else request.getfixturevalue("pg_database")()
    queue_commits(url, 2)
    lease = 3.0
    with db.session(url) as s:
        slow = claim(s, ["file:///shared"], "slow", lease)
        dead = claim(s, ["file:///shared"], "dead", lease)
    # `dead` stands for a worker on another box that stopped: a claim by a host and pid we cannot see.
    with db.session(url) as s:
        s.execute(text("UPDATE reviewqueue SET claimed_by = 'elsewhere:4242' WHERE id = :id"), {"id": dead.id})
        s.commit()
    with Heartbeat(url, slow.id, lease, quiet) as beat:
        time.sleep(2.5 * lease)  # far past the first lease: only the heartbeat keeps the slow job
        assert recover(url, [], quiet, "someone") == 1
        assert not beat.lost
    (slow_row,), (dead_row,) = [rows(url, "SELECT status, claimed_by, error, lease_expires_at, heartbeat_at "
                                          "FROM reviewqueue WHERE id = :id", id=i) for i in (slow.id, dead.id)]
    assert slow_row[0] == "running" and slow_row[1].endswith(f":{os.getpid()}")
    assert utc(slow_row[4]) > utc(slow.heartbeat_at) + timedelta(seconds=lease)  # renewed more than once
    assert dead_row[:2] == ("queued", None) and "worker dead (elsewhere:4242) stopped renewing its lease" in dead_row[2]
    with db.session(url) as s:  # and the requeued job can be claimed again, by anyone
        again = claim(s, ["file:///shared"], "someone", lease)
    assert again.id == dead.id and again.attempts == 2 and again.worker == "someone"


def test_lease_setting_is_checked(monkeypatch):
    monkeypatch.setenv("REVIEWER_LEASE_SECONDS", "1")
    with pytest.raises(LoopError, match="at least 3 s"):
        lease_seconds()
    monkeypatch.setenv("REVIEWER_LEASE_SECONDS", "soon")
    with pytest.raises(LoopError, match="must be a number of seconds"):
        lease_seconds()
    monkeypatch.setenv("REVIEWER_LEASE_SECONDS", "7.5")
    assert lease_seconds() == 7.5


# --- many workers, many boxes, one database ---------------------------------------------------------------------------

WORKERS = {"a1": "box-a", "b1": "box-b", "c1": "box-c", "c2": "box-c"}  # two workers share box c
LEASE = 5


def start_worker(name: str, box: str, url: str, repos: list[Path], folder: Path) -> tuple[subprocess.Popen, Path]:
    log = folder / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REVIEWER_WORKER": name, "REVIEWER_LEASE_SECONDS": str(LEASE),
           "REVIEWER_LOCK_FILE": str(folder / f"{box}.lock"), "XDG_CONFIG_HOME": str(folder / "config")}
    args = ["loop", "--db", url, "--persona", "smoke", "--interval", "2"]
    for r in repos:
        args += ["--repo", str(r)]
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", LOOP_CLI, *args], cwd=folder, stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    return proc, log


def test_many_workers_review_every_commit_once_and_survive_a_kill(pg_database, tmp_path):
    url = pg_database()
    repos = [make_project(tmp_path / f"repo{i}", test_seconds=3) for i in range(3)]
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    try:
        for name, box in WORKERS.items():  # all at once, against an empty database: they race to make the schema
            procs[name], logs[name] = start_worker(name, box, url, repos, tmp_path)
        def running(check):  # a worker that dies unexpectedly fails the test at once, with its log
            def wrapped():
                for name, p in procs.items():
                    assert name == killed or p.poll() is None, f"worker {name} exited:\n{logs[name].read_text()}"
                return check()
            return wrapped

        killed = None
        wait_until("the three heads to be queued",
                   running(lambda: len(rows(url, "SELECT id FROM reviewqueue")) == 3), 120)
        commits = {r.resolve().as_uri(): {commit_change(r, "second")} for r in repos}  # three more jobs

        def victim():
            # A worker in the middle of a review: its run has recorded a measurement and its persona still runs.
            found = rows(url, "SELECT q.id, q.worker FROM reviewqueue q JOIN reviewrun r ON r.repository_id = "
                              "q.repository_id AND r.commit_sha = q.commit_sha JOIN personarun p ON p.run_id = r.id "
                              "JOIN measurement m ON m.persona_run_id = p.id WHERE q.status = 'running' AND "
                              "r.status = 'running' AND p.status = 'running'")
            return found[0] if found else None

        killed_row, killed = wait_until("a worker in the middle of a review", running(victim), 150)
        procs[killed].send_signal(signal.SIGKILL)
        procs[killed].wait(30)
        killed_at = time.time()
        (lease_end,), = rows(url, "SELECT lease_expires_at FROM reviewqueue WHERE id = :id", id=killed_row)

        wait_until("all six jobs done", running(lambda: rows(
            url, "SELECT count(*) FROM reviewqueue WHERE status = 'done'") == [(6,)]), 200)
    finally:
        for name, p in procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    outputs = {name: log.read_text() for name, log in logs.items()}
    for name, p in procs.items():
        if name != killed:
            assert p.returncode == 0, outputs[name]
        assert "Traceback" not in outputs[name], outputs[name]

    # Every commit (3 heads + 3 new ones) reviewed exactly once: one completed run each, nothing lost.
    queue = rows(url, "SELECT q.id, r.url, q.commit_sha, q.status, q.attempts, q.worker, q.run_id FROM reviewqueue q "
                      "JOIN repository r ON r.id = q.repository_id ORDER BY q.id")
    assert len(queue) == 6 and {q[3] for q in queue} == {"done"}
    for url_, new in commits.items():
        assert new <= {q[2] for q in queue if q[1] == url_}
    completed = rows(url, "SELECT r.id, r.repository_id, r.commit_sha, r.worker, r.started_at, r.finished_at "
                          "FROM reviewrun r WHERE r.status = 'completed' ORDER BY r.id")
    per_commit = Counter((c[1], c[2]) for c in completed)
    assert len(per_commit) == 6 and set(per_commit.values()) == {1}, per_commit
    assert {q[6] for q in queue} == {c[0] for c in completed}  # each row points at its one completed run

    # The killed worker's job went back to the queue only after its lease ran out, and another worker reviewed it.
    (job,) = [q for q in queue if q[0] == killed_row]
    assert job[4] == 2 and job[5] != killed, job
    (run,) = [c for c in completed if c[0] == job[6]]
    assert utc(run[4]) >= utc(lease_end), (run, lease_end)
    interrupted = rows(url, "SELECT id, pid FROM reviewrun WHERE status = 'interrupted'")
    assert [pid for _, pid in interrupted] == [procs[killed].pid]
    assert sum("lease expired" in out for out in outputs.values()) == 1
    # A live worker's job is never taken away: every other row was claimed once.
    assert [q[0] for q in queue if q[4] != 1] == [killed_row]

    # One review at a time per box: the two workers of box c never overlapped (nor did any worker with itself).
    for box in set(WORKERS.values()):
        spans = sorted((utc(c[4]), utc(c[5])) for c in completed if WORKERS.get(c[3]) == box)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"reviews overlapped on {box}: {spans}"
    assert {c[3] for c in completed} <= set(WORKERS) - {None}

    # `reviewer report` says which worker ran what.
    report = subprocess.run([sys.executable, "-c", LOOP_CLI, "report", "--db", url, "--format", "json"],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    reported = {r["id"]: r["worker"] for r in json.loads(report.stdout)["runs"] if r["status"] == "completed"}
    assert reported == {c[0]: c[3] for c in completed}

    by_worker = Counter(c[3] for c in completed)
    summary = (f"multi-worker summary: {len(queue)} jobs on {len(WORKERS)} workers ({len(set(WORKERS.values()))} boxes;"
               f" c1 and c2 share box-c); completed runs per worker: "
               + ", ".join(f"{w}={by_worker.get(w, 0)}" for w in WORKERS)
               + f"; killed {killed} (SIGKILL) mid-review of queue item {killed_row}; re-queued after the lease "
               f"({LEASE} s) by another worker: 1 (attempts 2, reviewed by {job[5]}, started "
               f"{(utc(run[4]).timestamp() - killed_at):.1f} s after the kill); interrupted runs kept: {len(interrupted)};"
               f" every commit reviewed exactly once: {len(per_commit)}/6")
    print("\n" + summary)


# The worker sends itself SIGTERM right after psycopg has sent SQLAlchemy's pool pre-ping (";" on psycopg) and before
# it reads the answer: the KeyboardInterrupt is raised inside psycopg's generator, so the connection is left ACTIVE, and
# the pre-ping's `finally` then fails to restore autocommit ("can't change 'autocommit' now: connection in transaction
# status ACTIVE"), an ordinary database error that replaces the KeyboardInterrupt. Only the moment of the signal is
# arranged; the database, psycopg and SQLAlchemy are the real ones. A SIGTERM from outside lands there by chance.
SIGTERM_IN_PRE_PING = """
import os, signal, psycopg
send = psycopg.Cursor._execute_send
def execute_send(self, query, *args, **kwargs):
    send(self, query, *args, **kwargs)
    if query.query == b";" and not getattr(execute_send, "fired", False):
        execute_send.fired = True
        os.kill(os.getpid(), signal.SIGTERM)
psycopg.Cursor._execute_send = execute_send
"""


def test_a_sigterm_lost_in_a_database_call_still_stops_the_loop(pg_database, tmp_path):
    """The many-workers test once saw a worker ignore SIGTERM: the signal landed in a pool pre-ping, came out as
    "can't change 'autocommit' now", and the loop took it for a database hiccup, retried, and ran on."""
    url = pg_database()
    repo = make_project(tmp_path / "quick", test_seconds=0)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REVIEWER_LOCK_FILE": str(tmp_path / "review.lock"),
           "XDG_CONFIG_HOME": str(tmp_path / "config")}
    log = tmp_path / "loop.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", SIGTERM_IN_PRE_PING + LOOP_CLI, "loop", "--db", url,
                                 "--persona", "smoke", "--interval", "1", "--repo", str(repo)], cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        proc.wait(60)  # the first pre-ping comes within seconds; a loop that ignored the signal would run for ever
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    output = log.read_text()
    assert proc.returncode == 0, output
    assert "stopped by signal" in output and "Traceback" not in output, output
    assert rows(url, "SELECT count(*) FROM reviewqueue") == [(0,)]  # it stopped at its first database call


# --- several inference endpoints behind one client; the API key from config -------------------------------------------

PERSONA = """---
name: {name}
description: A scripted persona for tests.
focus: [correctness]
max_steps: 6
---
You are persona {name}.
"""


def scripted_persona_turn(request: dict):
    """Whatever endpoint gets the request: a first step runs a command, the step after it finishes."""
    from tests.scripted_llm import tool

    if any(m["role"] == "tool" for m in request["messages"]):
        return tool("finish", summary="looked around")
    return tool("bash", command="ls")


def persona_of(request: dict) -> str:
    return request["messages"][0]["content"].split("You are persona ", 1)[1].split(".", 1)[0]


def test_review_routes_each_persona_to_one_endpoint_and_fails_over_when_one_stops(tmp_path, scripted_llm, monkeypatch):  # noqa: F811
    """`reviewer run` with two LLM personas and two scripted endpoints; the first endpoint to be asked anything stops
    right after answering, in the middle of that persona's run: the run carries on at the other endpoint, and the next
    persona is routed there whole (the stopped one does not answer the routing probe)."""
    from typer.testing import CliRunner

    from reviewer import cli

    monkeypatch.setenv("REVIEWER_LOCK_FILE", str(tmp_path / "review.lock"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    servers = []

    def first_answer_then_stop(request):
        if sum(len(s.requests) for s in servers) == 1:  # the very first request of the review, wherever it went
            me = next(s for s in servers if s.requests)
            me._server.should_exit = True  # uvicorn answers this request, then closes its connections and exits
            from tests.scripted_llm import tool

            return tool("bash", command="sleep 2")  # time enough for that before the run's next request
        return scripted_persona_turn(request)

    servers += [scripted_llm([], after=first_answer_then_stop), scripted_llm([], after=first_answer_then_stop)]
    personas = tmp_path / "personas"
    personas.mkdir()
    for name in ("p1", "p2"):
        (personas / f"{name}.md").write_text(PERSONA.format(name=name))
    repo = make_project(tmp_path / "quick", test_seconds=0)
    args = ["run", str(repo), "--db", str(tmp_path / "r.db"), "--personas-dir", str(personas)]
    for name in ("p1", "p2"):
        args += ["--persona", name]
    for s in servers:
        args += ["--llm", s.base_url]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    stopped = next(s for s in servers if s._server.should_exit)
    alive = next(s for s in servers if s is not stopped)
    assert [persona_of(r) for r in stopped.requests] == ["p1"]  # p1's first step, then it was gone
    assert [persona_of(r) for r in alive.requests] == ["p1", "p2", "p2"]  # p1 finished there; p2 went there whole
    from reviewer.report.report import collect_runs

    (run,) = collect_runs(str(tmp_path / "r.db"))
    assert [(p["name"], p["status"], p["steps"]) for p in run["personas"]] == [
        ("p1", "completed", 2), ("p2", "completed", 2)]


@pytest.mark.slow  # starts the real embedded backend (`reviewer serve` as a subprocess)
def test_the_loop_keeps_one_embedded_backend_for_all_its_reviews(tmp_path, tiny_model):
    """Two commits reviewed by an LLM persona with `--llm embedded`: the backend is started once, on the first review,
    and serves both; the runs say `embedded`; it is stopped when the loop ends.

    What is under test is the loop's hold on the backend, not the model: `embedded_model` (REVIEWER_EMBEDDED_MODEL)
    names the tiny test Llama, with a window wide enough for an agent's first prompt in its small tokenizer. The real
    SmolLM2-135M through `reviewer serve` is tests/backend/server/test_server.py::test_embedded_model_end_to_end (on
    two CPU cores it spent ~75 s here: a GGUF conversion and two ~1900-token prefills)."""
    import shutil
    import sqlite3

    model = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1 << 15}))

    personas = tmp_path / "personas"
    personas.mkdir()
    (personas / "brief.md").write_text("---\nname: brief\ndescription: One short step.\nmax_steps: 1\n"
                                       "model: {max_tokens: 8, temperature: 0}\n---\nYou are brief.\n")
    repo = make_project(tmp_path / "quick", test_seconds=0)
    dbp = tmp_path / "r.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REVIEWER_LOCK_FILE": str(tmp_path / "review.lock"),
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "REVIEWER_WORKDIR": str(tmp_path / "work"),
           "REVIEWER_PERSONAS_DIR": str(personas),  # `reviewer loop` has no --personas-dir option
           "REVIEWER_EMBEDDED_MODEL": str(model)}
    log = tmp_path / "loop.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", LOOP_CLI, "loop", "--db", str(dbp), "--persona", "brief",
                                 "--llm", "embedded", "--interval", "1", "--repo", str(repo)], cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT, env=env)

    def done() -> int:
        assert proc.poll() is None, log.read_text()
        try:
            with sqlite3.connect(dbp, timeout=30) as con:
                return con.execute("SELECT count(*) FROM reviewqueue WHERE status = 'done'").fetchone()[0]
        except sqlite3.OperationalError:
            return 0

    try:
        wait_until("the first review", lambda: done() == 1, 300)
        commit_change(repo, "second")
        wait_until("the second review", lambda: done() == 2, 300)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    out = log.read_text()
    assert proc.returncode == 0, out
    assert out.count("embedded LLM backend ready at") == 1, out
    with sqlite3.connect(dbp) as con:
        runs = con.execute("SELECT status, llm FROM reviewrun ORDER BY id").fetchall()
        steps = con.execute("SELECT status, steps, completion_tokens FROM personarun ORDER BY id").fetchall()
    assert runs == [("completed", "embedded"), ("completed", "embedded")], out
    assert [(s[0], s[1]) for s in steps] == [("step_budget", 1)] * 2 and all(s[2] > 0 for s in steps)
    served = list((tmp_path / "work").glob("reviewer-serve-*.log"))
    assert len(served) == 1  # one backend process for both reviews
    port = int(served[0].stem.rsplit("-", 1)[1])
    import httpx

    with pytest.raises(httpx.TransportError):  # and it was stopped with the loop
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_run_sends_the_api_key_from_config_to_a_server_that_requires_one(tmp_path, tiny_model, live_server,
                                                                          monkeypatch):
    """Our own server with --api-key: `reviewer run` with the key in reviewer.toml gets answers; a wrong or missing
    key is one clear line and no run."""
    from typer.testing import CliRunner

    from reviewer import cli

    server = live_server(tiny_model("llama"), api_key="s3cret")
    monkeypatch.setenv("REVIEWER_LOCK_FILE", str(tmp_path / "review.lock"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("REVIEWER_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    personas = tmp_path / "personas"
    personas.mkdir()
    (personas / "brief.md").write_text("---\nname: brief\ndescription: One short step.\nmax_steps: 1\n"
                                       "model: {max_tokens: 4, temperature: 0}\n---\nYou are brief.\n")
    repo = make_project(tmp_path / "quick", test_seconds=0)
    dbp = tmp_path / "r.db"
    args = ["run", str(repo), "--db", str(dbp), "--persona", "brief", "--personas-dir", str(personas),
            "--llm", server.base_url]
    runner = CliRunner()
    for key in (None, "wrong"):
        (tmp_path / "reviewer.toml").write_text(f'api_key = "{key}"\n' if key else "")
        refused = runner.invoke(cli.app, args)
        assert refused.exit_code == 2, refused.output
        assert f"the LLM at {server.base_url} refused the API key (HTTP 401)" in " ".join(refused.output.split())
        assert "Traceback" not in refused.output
    assert not dbp.exists() or rows(str(dbp), "SELECT id FROM reviewrun") == []
    (tmp_path / "reviewer.toml").write_text('api_key = "s3cret"\n')
    from reviewer.config import load_settings
    from reviewer.llm.endpoints import open_llm

    with open_llm(load_settings(llm=[server.base_url])) as llm:  # the key comes from reviewer.toml
        reply = llm.chat([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert reply.completion_tokens > 0 and not reply.usage_estimated
    accepted = runner.invoke(cli.app, args)
    # The tiny test model's 2048-token window cannot hold an agent's first prompt: the server says so, which it only
    # does for a request that passed the key check; the run is stored, with the server's own words.
    (persona,) = rows(str(dbp), "SELECT status, error FROM personarun")
    assert persona[0] == "failed" and "context window holds 2048" in persona[1], accepted.output
    assert "refused the API key" not in accepted.output


def test_a_loop_waits_out_a_database_restart(tmp_path):
    """The database stops (kill, reboot, network cut) while a loop watches: the loop says so, keeps trying, and goes
    on reviewing once the database is back. Its own PostgreSQL server, so the other tests are not disturbed."""
    from tests.postgres import PostgresServer

    server = PostgresServer().start()
    try:
        url = server.create_database()
        repo = make_project(tmp_path / "quick", test_seconds=0)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "REVIEWER_LOCK_FILE": str(tmp_path / "review.lock"),
               "XDG_CONFIG_HOME": str(tmp_path / "config")}
        log = tmp_path / "loop.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-c", LOOP_CLI, "loop", "--db", url, "--persona", "smoke",
                                     "--interval", "1", "--repo", str(repo)], cwd=tmp_path, stdout=out,
                                    stderr=subprocess.STDOUT, env=env)

        def done(count: int):
            def check():
                assert proc.poll() is None, log.read_text()
                try:
                    return rows(url, "SELECT count(*) FROM reviewqueue WHERE status = 'done'") == [(count,)]
                except Exception:  # noqa: BLE001 - the database is down: not yet
                    return False
            return check

        try:
            # Generous waits: a smoke review (clone, venv, install, tests, verification) takes ~20 s on an idle
            # 2-core machine and several times that on a loaded one; these are deadlines, not speed claims.
            wait_until("the first review", done(1), 420)
            server.halt()
            db.get_engine(url).dispose()  # this test's own pooled connections died with the server
            wait_until("the loop to notice", lambda: "failed: " in log.read_text() and "trying again in" in
                       log.read_text(), 60)
            server.resume()
            head = commit_change(repo, "after the restart")
            wait_until("the review of the new commit", done(2), 420)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        out = log.read_text()
        assert proc.returncode == 0, out
        assert "Traceback" not in out
        assert rows(url, "SELECT status FROM reviewrun WHERE commit_sha = :c", c=head) == [("completed",)]
    finally:
        server.stop()
