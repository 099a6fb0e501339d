"""`reviewer run` end to end: the CLI against real git repositories, a real SQLite database, real subprocesses, and
for the LLM personas the scripted model on a real socket through the official `openai` client."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from reviewer.cli import app
from reviewer.examples import git, make_example_repo
from tests.scripted_llm import scripted_llm, tool  # noqa: F401  (scripted_llm is a fixture)

ROOT = Path(__file__).resolve().parents[3]
runner = CliRunner()

TESTER = """---
name: tester
description: A scripted persona for tests.
focus: [correctness]
max_steps: 8
---
You are a careful new user of this project.
"""


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Every test gets its own machine lock, config folder and working directory, so it neither waits for a real
    review on this machine nor reads anybody's reviewer.toml."""
    monkeypatch.setenv("REVIEWER_LOCK_FILE", str(tmp_path / "review.lock"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    return make_example_repo(tmp_path_factory.mktemp("example") / "tinystats")


def report_json(db: Path) -> dict:
    result = runner.invoke(app, ["report", "--db", str(db), "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def make_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    for name, content in files.items():
        (path / name).write_text(content)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    return path


def _default_sigint() -> None:
    # A test runner started in the background (`pytest &` from a script) ignores SIGINT, and children inherit that:
    # Python then installs no KeyboardInterrupt handler. The reviewer starts as it would in a terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def reviewer_process(*args: str, env_extra: dict | None = None, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "reviewer.cli", "run", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint)


# --- the smoke review: no LLM at all --------------------------------------------------------------------------------

def test_smoke_review_of_the_example_project(example, tmp_path):
    db = tmp_path / "reviews.db"
    result = runner.invoke(app, ["run", str(example), "--db", str(db), "--persona", "smoke", "--json"])
    assert result.exit_code == 0, result.output
    # --json: progress on stderr (plain lines: not a terminal), the run as JSON (and nothing else) on stdout.
    assert "smoke step 1: bash install" in result.stderr
    assert "found [high] 1 of 8 tests fail (tests/test_core.py::test_percentile_unsorted)" in result.stderr
    printed = json.loads(result.stdout)
    report = report_json(db)
    assert printed == report  # the same rows `reviewer report --format json` reads back
    [run] = report["runs"]
    assert run["repo"] == example.resolve().as_uri()
    assert run["commit"] == git(example, "rev-parse", "HEAD") and run["ref"] == "main"
    assert run["status"] == "completed" and run["error"] is None and run["finished_at"]
    assert run["llm"] is None  # smoke only: the LLM was never started
    machine = json.loads(run["machine"])
    assert machine["cores"] >= 1 and machine["hostname"] and machine["isolation"] == "bwrap"
    [persona] = run["personas"]
    assert persona["name"] == "smoke" and persona["status"] == "completed" and persona["steps"] >= 3
    assert persona["prompt_tokens"] == 0 and persona["llm_seconds"] == 0
    [finding] = run["findings"]
    assert finding["title"] == "1 of 8 tests fail (tests/test_core.py::test_percentile_unsorted)"
    assert finding["severity"] == "high" and finding["persona"] == "smoke"
    assert finding["state"] == "new" and finding["fingerprint"]  # compared with earlier runs at the end of the run
    assert finding["repro_command"] == "python -m pytest -x tests/test_core.py::test_percentile_unsorted"
    assert {m["name"] for m in run["measurements"]} == {"install time", "import time (tinystats)", "test suite time"}


# --- bad input: one line, non-zero, nothing written -----------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["{plain}"], "not a git repository"),
    (["{missing}"], "no such file or directory"),
    (["https://nonexistent.invalid/owner/repo.git"], "cannot read repository https://nonexistent.invalid/owner/repo.git"),
    (["{example}", "--persona", "nobody"], "unknown persona 'nobody'"),
    (["{example}", "--ref", "v9.9"], "unknown ref 'v9.9'"),
    (["{example}", "--persona", "tester", "--personas-dir", "{personas}", "--llm", "http://127.0.0.1:{port}/v1"],
     "127.0.0.1:{port}"),
])
def test_bad_input_is_one_line_and_writes_nothing(args, message, example, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "personas").mkdir()
    (tmp_path / "personas" / "tester.md").write_text(TESTER)
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fill = dict(plain=tmp_path / "plain", missing=tmp_path / "missing", example=example, personas=tmp_path / "personas",
                port=port)
    db = tmp_path / "reviews.db"
    start = time.monotonic()
    result = runner.invoke(app, ["run", *[a.format(**fill) for a in args], "--db", str(db)])
    assert result.exit_code == 2, result.output
    assert message.format(**fill) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error:") and "Traceback" not in result.output
    assert not db.exists()
    assert time.monotonic() - start < 60


def test_bad_input_is_answered_before_the_llm_sdks_and_the_database_layer_load(tmp_path):
    """A typo must not wait for the openai SDK and SQLAlchemy to import (10-15 s on a busy box): the CLI checks its
    input first. The process reports which heavy modules it had loaded when it answered."""
    code = ("import sys, atexit; atexit.register(lambda: print(sorted(m for m in ('openai', 'anthropic', 'sqlalchemy', "
            "'reviewer.run.review') if m in sys.modules), file=sys.stderr)); from reviewer.cli import app; "
            "app(['run', sys.argv[1]])")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing")], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 2
    error, loaded = proc.stderr.strip().splitlines()
    assert error.startswith("error:") and "no such file or directory" in error
    assert loaded == "[]"


@pytest.mark.parametrize("settings, expected, noted", [
    ({}, ["smoke"], True),  # the embedded default: the deterministic persona, and a note on the others
    ({"personas": ["smoke", "docs"]}, ["smoke", "docs"], False),  # named: run as named
    ({"llm": ["http://127.0.0.1:9/v1"]}, ["smoke", "performance", "correctness", "docs"], False),  # a capable model
])
def test_default_personas_fit_the_backend(settings, expected, noted):
    from reviewer.config import load_settings
    from reviewer.run.inputs import persona_names

    names, note = persona_names(load_settings(**settings))
    assert names == expected
    assert bool(note) == noted
    if note:
        assert "--llm" in note and "--persona docs" in note


def test_personas_named_in_the_environment_count_as_named(monkeypatch):
    from reviewer.config import load_settings
    from reviewer.run.inputs import persona_names

    monkeypatch.setenv("REVIEWER_PERSONAS", "docs")
    assert persona_names(load_settings()) == (["docs"], None)


# --- the scripted model: a whole LLM review --------------------------------------------------------------------------

def tool_outputs(request: dict) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "tool"]


def test_scripted_review_feeds_real_workspace_output_back(example, tmp_path, scripted_llm):  # noqa: F811
    seen: dict[str, str] = {}

    def after_readme(request):
        seen["readme"] = tool_outputs(request)[-1]
        return tool("bash", command="python -m pip install -q -e '.[test]' && python -m pytest -q -rf tests/test_core.py")

    def after_tests(request):
        seen["tests"] = out = tool_outputs(request)[-1]
        failed = next(line for line in out.splitlines() if line.startswith("FAILED"))
        return tool("record_finding", title="percentile ignores the order of its input", severity="high",
                    category="correctness", details="percentile([5, 1, 3], 100) returns 3, not 5.", evidence=failed,
                    repro_command="python -m pytest -q tests/test_core.py::test_percentile_unsorted",
                    file="tinystats/core.py", line=37)

    llm = scripted_llm([
        tool("bash", command="cat README.md"),
        after_readme,
        after_tests,
        tool("record_measurement", name="pytest tests/test_core.py", value=0.42, unit="s", command="python -m pytest -q",
             repeats=1),
        tool("finish", summary="percentile is wrong for unsorted input"),
    ])
    personas = tmp_path / "personas"
    personas.mkdir()
    (personas / "tester.md").write_text(TESTER)
    db = tmp_path / "reviews.db"
    result = runner.invoke(app, ["run", str(example), "--db", str(db), "--personas-dir", str(personas),
                                 "--persona", "smoke", "--persona", "tester", "--llm", llm.base_url])
    assert result.exit_code == 0, result.output
    assert "tester found [high] percentile ignores the order of its input" in result.output
    assert "Findings (2)" in result.output and "Measurements" in result.output  # the summary tables
    # What the model was told: the task names the clone, carries the README and the smoke baseline.
    task = llm.requests[0]["messages"][1]["content"]
    assert "Repository: " + example.resolve().as_uri() in task
    assert "Small descriptive statistics" in task and "1 failed, 7 passed" in task
    assert "smoke found: [high] 1 of 8 tests fail (tests/test_core.py::test_percentile_unsorted)" in task
    # The tool output came from the workspace and went back to the model in the next request.
    assert "# tinystats" in seen["readme"] and "pip install -e '.[test]'" in seen["readme"]
    assert "FAILED tests/test_core.py::test_percentile_unsorted" in seen["tests"]
    assert "1 failed, 6 passed" in seen["tests"]  # tests/test_core.py alone: 7 tests
    run = report_json(db)["runs"][0]
    assert run["llm"] == llm.base_url and run["model"] == "scripted-model" and run["status"] == "completed"
    smoke, tester = run["personas"]
    assert (smoke["name"], smoke["status"]) == ("smoke", "completed")
    assert (tester["name"], tester["status"], tester["steps"]) == ("tester", "completed", 5)
    assert tester["prompt_tokens"] > 0 and tester["completion_tokens"] > 0 and tester["llm_seconds"] > 0
    assert tester["summary"] == "percentile is wrong for unsorted input"
    mine = [f for f in run["findings"] if f["persona"] == "tester"]
    assert [(f["title"], f["file"], f["line"]) for f in mine] == [("percentile ignores the order of its input",
                                                                  "tinystats/core.py", 37)]
    assert mine[0]["evidence"].startswith("FAILED tests/test_core.py::test_percentile_unsorted")
    assert {(m["persona"], m["name"], m["value"]) for m in run["measurements"] if m["persona"] == "tester"} == {
        ("tester", "pytest tests/test_core.py", 0.42)}


def test_a_looping_model_is_stopped_by_the_step_budget(example, tmp_path, scripted_llm):  # noqa: F811
    llm = scripted_llm([], after=tool("bash", command="ls"))
    personas = tmp_path / "personas"
    personas.mkdir()
    (personas / "tester.md").write_text(TESTER)
    db = tmp_path / "reviews.db"
    result = runner.invoke(app, ["run", str(example), "--db", str(db), "--personas-dir", str(personas),
                                 "--persona", "tester", "--llm", llm.base_url, "--max-steps", "3"])
    assert result.exit_code == 0, result.output
    run = report_json(db)["runs"][0]
    assert [(p["name"], p["status"], p["steps"]) for p in run["personas"]] == [("tester", "step_budget", 3)]
    assert len(llm.requests) == 3


# --- one review per machine -----------------------------------------------------------------------------------------

def left_running_by_a_killed_reviewer(db: Path) -> int:
    """A run row as `kill -9` leaves it: status running, owned by a pid that no longer exists, on this machine."""
    import socket

    from reviewer.store import db as store
    from reviewer.store.db import ReviewRun

    dead = subprocess.Popen(["true"])
    dead.wait()
    with store.session(str(db)) as s:
        repo = store.get_or_create_repository(s, "file:///elsewhere")
        run = ReviewRun(repository_id=repo.id, status="running", pid=dead.pid,
                        machine=json.dumps({"hostname": socket.gethostname()}))
        s.add(run)
        s.commit()
        return run.id


def test_second_review_waits_or_fails_fast(tmp_path):
    # A repository whose only test takes a few seconds: the first review holds the machine that long.
    repo = make_repo(tmp_path / "slow", {"Makefile": "test:\n\tsleep 5\n"})
    lock_file = tmp_path / "machine.lock"
    env = {"REVIEWER_LOCK_FILE": str(lock_file)}
    db = tmp_path / "reviews.db"
    stale = left_running_by_a_killed_reviewer(db)
    first = reviewer_process(str(repo), "--db", str(db), "--persona", "smoke", env_extra=env, cwd=tmp_path)
    holder = lock_file.with_name(lock_file.name + ".holder.json")
    deadline = time.monotonic() + 60
    while not holder.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert holder.exists(), first.communicate()
    assert json.loads(holder.read_text())["pid"] == first.pid

    # Both started while the first holds the machine: one refuses at once, the other queues and says so.
    busy = reviewer_process(str(repo), "--db", str(db), "--persona", "smoke", "--no-wait", env_extra=env, cwd=tmp_path)
    waiting = reviewer_process(str(repo), "--db", str(db), "--persona", "smoke", env_extra=env, cwd=tmp_path)
    out, err = busy.communicate(timeout=60)
    assert busy.returncode == 75, (out, err)
    assert f"another review is running on this machine (pid {first.pid}" in err
    assert len(err.strip().splitlines()) == 1
    line = waiting.stdout.readline()
    assert line.startswith("Waiting for another review on this machine to finish (pid %d" % first.pid), line
    assert first.poll() is None  # both answers came while the first review still ran
    first_out, first_err = first.communicate(timeout=120)
    assert first.returncode == 0, first_out + first_err
    rest, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, rest + err
    runs = report_json(db)["runs"]
    assert [r["status"] for r in runs] == ["interrupted", "completed", "completed"]
    assert runs[0]["id"] == stale and "ended without finishing" in runs[0]["error"]  # recovered under the lock
    assert runs[2]["started_at"] >= runs[1]["finished_at"]  # never overlapped
    assert not holder.exists()


def running(marker: str) -> list[int]:
    """Host pids whose command line holds marker (the sandboxed command cannot write anything outside its workspace,
    so it is found from outside)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_interrupt_marks_the_run_and_kills_the_command(tmp_path):
    marker = f"300.{os.getpid()}{time.monotonic_ns() % 10**6}"  # a unique `sleep` argument
    repo = make_repo(tmp_path / "hang", {"Makefile": f"test:\n\tsleep {marker}\n"})
    db = tmp_path / "reviews.db"
    work = tmp_path / "work"
    proc = reviewer_process(str(repo), "--db", str(db), "--persona", "smoke", cwd=tmp_path,
                            env_extra={"REVIEWER_LOCK_FILE": str(tmp_path / "l.lock"), "REVIEWER_WORKDIR": str(work)})
    deadline = time.monotonic() + 60
    while not running(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(marker), proc.communicate()
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    time.sleep(0.5)
    for pid in running(marker):  # gone, or a zombie about to be reaped
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    run = report_json(db)["runs"][0]
    assert run["status"] == "interrupted" and run["finished_at"]
    assert [(p["name"], p["status"]) for p in run["personas"]] == [("smoke", "interrupted")]
    assert work.is_dir() and not list(work.iterdir())  # the persona's workspace was removed
    assert not (tmp_path / "l.lock.holder.json").exists()  # and the machine released
