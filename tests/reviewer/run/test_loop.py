"""`reviewer loop` over real local git repositories with the smoke persona (no LLM): passes, the lifecycle across
commits, verification, kill -9 and SIGTERM mid-review, two loops on one machine, and bad input.

Each test gets its own lock file (REVIEWER_LOCK_FILE) so it never waits for reviews of other test sessions; the
subprocess tests run the real CLI as a program."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from reviewer import cli
from reviewer.examples import git, make_example_repo
from reviewer.run.loop import LoopError, Watched, poll, read_repos_file
from reviewer.run.verify import verify_findings
from reviewer.store import db

ROOT = Path(__file__).resolve().parents[3]
runner = CliRunner()
# The real CLI as a program.
LOOP_CLI = "import sys; from reviewer import cli; sys.argv = ['reviewer'] + sys.argv[1:]; cli.main()"


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("REVIEWER_LOCK_FILE", str(tmp_path / "review.lock"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def loop(db_path, *args):
    return runner.invoke(cli.app, ["loop", "--db", str(db_path), "--persona", "smoke", *args])


def query(db_path, sql, *params):
    con = sqlite3.connect(db_path, timeout=30)
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def make_project(dest: Path, test_seconds: float = 2.0) -> Path:
    """A tiny `make` project whose test target takes a moment and fails: smoke reviews it in seconds (no pip), and the
    moment leaves time to signal a loop while its persona runs."""
    source = dest.parent / f"{dest.name}-source"
    source.mkdir()
    (source / "Makefile").write_text(f"all:\n\t@echo built\n\ntest:\n\t@sleep {test_seconds}\n\t@echo 'FAIL: test_sum'\n"
                                     "\t@false\n")
    (source / "README.md").write_text("# quick\n\nRun `make test`.\n")
    return make_example_repo(dest, source=source)


def commit_change(repo: Path, message: str) -> str:
    (repo / "README.md").write_text((repo / "README.md").read_text() + f"\n{message}\n")
    git(repo, "commit", "-q", "-am", message)
    return git(repo, "rev-parse", "HEAD")


def start_loop(env_dir: Path, db_path: Path, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", LOOP_CLI, "loop", "--db", str(db_path), "--persona", "smoke", *args],
        cwd=env_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_for(db_path: Path, sql: str, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if db_path.exists():
            try:
                rows = query(str(db_path), sql)
            except sqlite3.OperationalError:  # tables not made yet
                rows = []
            if rows:
                return rows
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for: {sql}")


@pytest.mark.slow  # installs the example project four times (two reviews, two verifications)
def test_three_passes_track_the_finding_across_commits(env):
    repo = make_example_repo(env / "tinystats")
    url = repo.resolve().as_uri()
    dbp = env / "reviews.db"

    first = loop(dbp, "--once", "--repo", str(repo))
    assert first.exit_code == 0, first.output
    assert "new commit" in first.output and "pass done: 1 review(s)" in first.output
    runs = query(str(dbp), "SELECT id, status, commit_sha FROM reviewrun")
    assert [r[1] for r in runs] == ["completed"]
    (fid, title, state, verified, verification), = query(
        str(dbp), "SELECT id, title, state, verified, verification FROM finding WHERE duplicate_of IS NULL")
    assert "tests fail" in title and state == "new"
    assert verified == 1 and "-> reproduces" in verification  # smoke's repro command fails again in a fresh clone

    second = loop(dbp, "--once", "--repo", str(repo))
    assert second.exit_code == 0, second.output
    assert "pass done: 0 review(s)" in second.output
    assert len(query(str(dbp), "SELECT id FROM reviewrun")) == 1  # the unchanged commit is not reviewed again

    head = commit_change(repo, "A note.")
    third = loop(dbp, "--once", "--repo", str(repo))
    assert third.exit_code == 0, third.output
    runs = query(str(dbp), "SELECT id, status, commit_sha FROM reviewrun ORDER BY id")
    assert [(r[1], r[2]) for r in runs][1] == ("completed", head)
    rows = query(str(dbp), "SELECT title, state, verified FROM finding WHERE run_id = ? AND duplicate_of IS NULL",
                 runs[1][0])
    assert [(r[1], r[2]) for r in rows] == [("persisting", 1)] and rows[0][0] == title
    assert [r[0] for r in query(str(dbp), "SELECT status FROM reviewqueue ORDER BY id")] == ["done", "done"]

    report = runner.invoke(cli.app, ["report", "--db", str(dbp), "--format", "json", "--state", "persisting"])
    (run,) = [r for r in json.loads(report.output)["runs"] if r["findings"]]
    assert run["repo"] == url and run["findings"][0]["verified"] is True

    # An unreachable repository beside a good one: logged, the pass goes on, the exit code says so.
    fourth = loop(dbp, "--once", "--repo", str(repo), "--repo", "file:///nonexistent/repo.git")
    assert fourth.exit_code == 1
    assert "cannot read repository file:///nonexistent/repo.git" in fourth.output
    assert "next try in" in fourth.output and "1 repository could not be read" in fourth.output
    assert "Traceback" not in fourth.output


def test_verification_sets_up_first_and_says_false_when_the_repro_passes(env):
    repo = make_project(env / "quick", test_seconds=0)
    head = git(repo, "rev-parse", "HEAD")
    dbp = str(env / "v.db")
    with db.session(dbp) as s:
        r = db.get_or_create_repository(s, repo.resolve().as_uri())
        plain = db.ReviewRun(repository_id=r.id, commit_sha=head, status="completed")
        installed = db.ReviewRun(repository_id=r.id, commit_sha=head, status="completed")
        s.add(plain)
        s.add(installed)
        s.flush()
        for run_id, title, repro in [(plain.id, "exits 0", "python -c 'import sys; sys.exit(0)'"),
                                     (plain.id, "no repro", None),
                                     (plain.id, "needs the install", "test -f installed.txt"),
                                     (plain.id, "runner missing", "python -m no_such_runner -x tests"),
                                     (plain.id, "command missing", "no-such-command --check"),
                                     (installed.id, "needs the install", "test -f installed.txt")]:
            s.add(db.Finding(run_id=run_id, persona="docs", title=title, severity="low", category="c",
                             repro_command=repro))
        # How smoke installed the project in the second run: verification does the same first.
        s.add(db.Measurement(run_id=installed.id, persona="smoke", name="install time", value=1.0, unit="s",
                             command="echo done > installed.txt"))
        s.commit()
        plain_id, installed_id = plain.id, installed.id
    # a repro that fails for want of its own tool says nothing about the finding: not checked, not "reproduces"
    assert verify_findings(dbp, plain_id) == {"reproduced": 1, "not_reproduced": 1, "unchecked": 2}
    assert verify_findings(dbp, installed_id) == {"reproduced": 0, "not_reproduced": 1, "unchecked": 0}
    rows = {(run, t): (v, text) for run, t, v, text in query(dbp, "SELECT run_id, title, verified, verification FROM finding")}
    assert rows[(plain_id, "exits 0")][0] == 0 and "does not reproduce (exit code 0)" in rows[(plain_id, "exits 0")][1]
    assert rows[(plain_id, "no repro")] == (None, None)
    assert rows[(plain_id, "runner missing")][0] is None and "not checked: no module no_such_runner" in rows[
        (plain_id, "runner missing")][1]
    assert rows[(plain_id, "command missing")][0] is None and "not checked: the command was not found" in rows[
        (plain_id, "command missing")][1]
    verified, text = rows[(plain_id, "needs the install")]
    assert verified == 1 and "exit code 1" in text and "-> reproduces" in text  # no setup, no file: "reproduces"
    verified, text = rows[(installed_id, "needs the install")]
    assert verified == 0 and text.startswith("setup `echo done > installed.txt`: exit code 0")
    assert verify_findings(dbp, plain_id) == {"reproduced": 0, "not_reproduced": 0, "unchecked": 0}  # done once


def test_verification_gives_pytest_repros_the_modules_the_tests_import_and_nothing_installs(env):
    """Smoke installs a module the tests import and nothing declares (dpath's nose2) before judging the tests, so the
    fresh workspace gets it too for a pytest repro that stops for it: a passing test then does not "reproduce" for
    want of six. The finding that nothing declares it reproduces by collection alone (`--collect-only`), without."""
    source = env / "needy-source"
    for name, text in {"pyproject.toml": '[build-system]\nrequires = ["setuptools>=61"]\n'
                                         'build-backend = "setuptools.build_meta"\n[project]\nname = "needy"\n'
                                         'version = "0.1"\n',
                       "needy/__init__.py": "def one():\n    return 1\n",
                       "tests/test_one.py": "import six\nfrom needy import one\n\n\ndef test_one():\n"
                                            "    assert one() == 1\n\n\ndef test_two():\n    assert one() == 2\n"}.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(text)
    repo = make_example_repo(env / "needy", source=source)
    dbp = str(env / "m.db")
    with db.session(dbp) as s:
        r = db.get_or_create_repository(s, repo.resolve().as_uri())
        run = db.ReviewRun(repository_id=r.id, commit_sha=git(repo, "rev-parse", "HEAD"), status="completed")
        s.add(run)
        s.flush()
        for title, repro in [("passes", "python -m pytest -x tests/test_one.py::test_one"),
                             ("fails", "python -m pytest -x tests/test_one.py::test_two"),
                             ("undeclared", "python -m pytest --collect-only -q tests/test_one.py")]:
            s.add(db.Finding(run_id=run.id, persona="smoke", title=title, severity="low", category="tests",
                             repro_command=repro))
        s.add(db.Measurement(run_id=run.id, persona="smoke", name="install time", value=1.0, unit="s",
                             command="python -m pip install -e ."))
        s.commit()
        run_id = run.id
    assert verify_findings(dbp, run_id) == {"reproduced": 2, "not_reproduced": 1, "unchecked": 0}
    rows = {t: (v, text) for t, v, text in query(dbp, "SELECT title, verified, verification FROM finding")}
    assert rows["passes"][0] == 0 and "setup `python -m pip install six`" in rows["passes"][1], rows["passes"]
    assert rows["fails"][0] == 1 and "assert 1 == 2" in rows["fails"][1], rows["fails"]
    assert rows["undeclared"][0] == 1 and "pip install six" not in rows["undeclared"][1], rows["undeclared"]


def test_kill_9_mid_review_then_restart_requeues_it(env):
    repo = make_project(env / "quick", test_seconds=5)
    dbp = env / "reviews.db"
    proc = start_loop(env, dbp, "--once", "--repo", str(repo))
    try:
        # Kill it once the review has recorded something (the build time), while the persona still runs its tests.
        wait_for(dbp, "SELECT m.id FROM measurement m JOIN personarun p ON p.id = m.persona_run_id "
                      "WHERE p.status = 'running'")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert query(str(dbp), "SELECT status FROM reviewrun") == [("running",)]
    assert query(str(dbp), "SELECT status, attempts FROM reviewqueue") == [("running", 1)]
    measured = query(str(dbp), "SELECT run_id, name, value FROM measurement")

    restart = loop(dbp, "--once", "--repo", str(repo))
    assert restart.exit_code == 0, restart.output
    assert "was left running by pid" in restart.output and "marked interrupted" in restart.output
    runs = query(str(dbp), "SELECT id, status, error, commit_sha FROM reviewrun ORDER BY id")
    assert [r[1] for r in runs] == ["interrupted", "completed"]
    assert "killed or crashed" in runs[0][2] and runs[0][3] == runs[1][3]  # the same commit, reviewed again
    assert query(str(dbp), "SELECT status FROM personarun WHERE run_id = ?", runs[0][0]) == [("interrupted",)]
    # Nothing lost: what the killed review recorded is still there.
    assert set(measured) <= set(query(str(dbp), "SELECT run_id, name, value FROM measurement"))
    assert query(str(dbp), "SELECT status, attempts, run_id FROM reviewqueue") == [("done", 2, runs[1][0])]


def test_watching_reviews_each_new_commit_and_stops_on_sigterm_while_idle(env):
    repo = make_project(env / "quick", test_seconds=0)
    dbp = env / "reviews.db"
    proc = start_loop(env, dbp, "--repo", str(repo), "--interval", "0.5")
    try:
        wait_for(dbp, "SELECT id FROM reviewqueue WHERE status = 'done'")
        head = commit_change(repo, "second")
        wait_for(dbp, f"SELECT id FROM reviewqueue WHERE status = 'done' AND commit_sha = '{head}'")
        time.sleep(1.5)  # a few idle polls: the unchanged head is not queued again
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "stopped by signal after 2 review(s)" in out
    assert [r[0] for r in query(str(dbp), "SELECT status FROM reviewrun")] == ["completed", "completed"]
    assert len(query(str(dbp), "SELECT id FROM reviewqueue")) == 2


def test_sigterm_finishes_cleanly_and_requeues(env):
    repo = make_project(env / "quick", test_seconds=5)
    dbp = env / "reviews.db"
    proc = start_loop(env, dbp, "--once", "--repo", str(repo))
    try:
        wait_for(dbp, "SELECT id FROM personarun WHERE status = 'running' AND steps >= 0")
        wait_for(dbp, "SELECT id FROM measurement")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "stopped by signal during a review" in out and "Traceback" not in out
    assert query(str(dbp), "SELECT status FROM reviewrun") == [("interrupted",)]
    assert query(str(dbp), "SELECT status FROM personarun") == [("interrupted",)]
    assert query(str(dbp), "SELECT status, attempts FROM reviewqueue") == [("queued", 1)]
    assert not Path(str(env / "review.lock") + ".holder.json").exists()  # the lock was let go


def test_two_loops_never_review_at_the_same_time(env):
    # No sleep in their tests: a review holds the machine for seconds anyway (a clone and a virtual environment for
    # the persona, another for the verification), while the other loop, started at the same moment, reaches the lock.
    first = make_project(env / "one", test_seconds=0)
    second = make_project(env / "two", test_seconds=0)
    dbp = env / "reviews.db"
    db.get_engine(str(dbp))  # made once, before two processes race to make it
    procs = [start_loop(env, dbp, "--once", "--repo", str(first)), start_loop(env, dbp, "--once", "--repo", str(second))]
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        outputs.append(out)
        assert p.returncode == 0, out
    runs = query(str(dbp), "SELECT started_at, finished_at, status FROM reviewrun ORDER BY started_at")
    assert [r[2] for r in runs] == ["completed", "completed"]
    (s1, f1, _), (s2, f2, _) = [(datetime.fromisoformat(a), datetime.fromisoformat(b), c) for a, b, c in runs]
    assert f1 <= s2, f"reviews overlapped: {runs}"
    assert any("Waiting for another review" in out for out in outputs)


def test_repos_file_bad_lines_are_named(env):
    repo = make_example_repo(env / "tinystats")
    listing = env / "repos.txt"
    listing.write_text(f"# watched\n{repo}\n\nnot a url\n./missing-dir\nftp://example.org/x.git\n"
                       "https://example.org/ok.git  # a comment\n")
    result = loop(env / "r.db", "--once", "--repos-file", str(listing))
    assert result.exit_code == 2
    out = " ".join(result.output.split())
    assert "has 3 bad line(s)" in out
    assert "line 4: 'not a url' has spaces" in out
    assert "line 5:" in out and "missing-dir: no such file or directory" in out
    assert "line 6: unsupported URL scheme 'ftp://'" in out
    assert "Traceback" not in result.output
    listing.write_text(f"{repo}\nhttps://example.org/ok.git # a comment\n")
    assert [w.url for w in read_repos_file(listing)] == [repo.resolve().as_uri(), "https://example.org/ok.git"]


@pytest.mark.parametrize("args,message", [
    ([], "no repository to watch"),
    (["--repo", "/nonexistent/path"], "--repo /nonexistent/path: /nonexistent/path: no such file or directory"),
    (["--repo", "https://example.org/x.git", "--interval", "0"], "--interval must be a positive number"),
    (["--repo", "https://example.org/x.git", "--max-reviews", "0"], "--max-reviews must be at least 1"),
    (["--repos-file", "missing.txt"], "cannot read repos file missing.txt"),
])
def test_bad_options_are_one_clear_line(env, args, message):
    result = loop(env / "r.db", "--once", *args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_unknown_persona_is_refused_before_anything(env):
    result = runner.invoke(cli.app, ["loop", "--db", str(env / "r.db"), "--persona", "nosuch", "--once", "--repo",
                                     "https://example.org/x.git"])
    assert result.exit_code == 2 and "nosuch" in result.output
    assert not (env / "r.db").exists() or not query(str(env / "r.db"), "SELECT id FROM reviewqueue")


def test_unreachable_repository_backs_off_and_recovers(env):
    from rich.console import Console

    missing = env / "later"
    w = Watched(url=missing.as_uri(), origin="--repo")
    console = Console(file=open(os.devnull, "w"))
    dbp = str(env / "r.db")
    start = time.monotonic()
    assert not poll(w, dbp, 10.0, console)
    assert w.failures == 1 and 19 <= w.next_poll - start <= 21  # twice the interval
    assert not poll(w, dbp, 10.0, console)
    assert w.failures == 2 and 39 <= w.next_poll - start <= 41  # then doubling
    make_example_repo(missing)  # it appears: the next poll queues its head and resets the backoff
    assert poll(w, dbp, 10.0, console)
    assert w.failures == 0 and w.last_error is None
    assert query(dbp, "SELECT status, attempts FROM reviewqueue") == [("queued", 0)]
    with pytest.raises(LoopError):
        read_repos_file(env / "nope.txt")


def test_a_review_that_cannot_start_stays_queued(env):
    """An unreachable LLM is not the commit's fault: the row keeps its place (attempt not counted), exit code 1."""
    repo = make_project(env / "quick", test_seconds=0)
    dbp = env / "r.db"
    result = runner.invoke(cli.app, ["loop", "--db", str(dbp), "--once", "--repo", str(repo), "--persona", "docs",
                                     "--llm", "http://127.0.0.1:1/v1"])
    assert result.exit_code == 1
    out = " ".join(result.output.split())
    assert "cannot reach the LLM at http://127.0.0.1:1/v1" in out
    assert "it stays queued" in out and "1 still queued" in out
    assert query(str(dbp), "SELECT status, attempts FROM reviewqueue") == [("queued", 0)]
    assert query(str(dbp), "SELECT id FROM reviewrun") == []


def test_a_probe_repro_gets_the_test_environment_smoke_gave_the_probes(tmp_path):
    """Smoke runs the probes after the tests' environment is installed (python-dotenv's CLI needs click, which only its
    tox.ini brings): a probe's script gets it in verification too; a plain command does not."""
    from reviewer.run.verify import repro_setup

    (tmp_path / "tox.ini").write_text("[testenv]\ndeps =\n    click\n")
    probe = "python - <<'REVIEWER_PROBE'\nprint(1)\nREVIEWER_PROBE"
    assert repro_setup(tmp_path, probe) == ["python -m pip install click"]
    assert repro_setup(tmp_path, "tool --help") == []
    assert repro_setup(tmp_path, "python -m pytest -x tests")[0].endswith("python -m pip install pytest")
