"""Hostile repositories against the sandbox: each is a real git repository whose install script and tests try to
steal, escape, phone out or take the machine down (tests/fixtures/hostile/). Every attempt must be blocked or
contained, recorded as a sandbox event, leave the host unchanged — and every command must come back.

The user's machine is simulated honestly: HOME points at a temporary home holding ~/.ssh/id_rsa, a secret file, the
reviewer's config and database; API keys sit in the reviewer's environment; a real HTTP server listens on the host.
Limits are small so the machine running the tests survives (2 cores, other jobs).

Set REVIEWER_HOSTILE_TABLE=path.md to get the results table (action, outcome, events) written there.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from reviewer.sandbox import cgroups, diskcap, isolation, limits, supervisor
from reviewer.sandbox.command import sandbox_env
from reviewer.sandbox.isolation import Sandbox, run_sandboxed
from reviewer.sandbox.limits import Limits, MiB

pytestmark = pytest.mark.skipif(not isolation.probe_bwrap().ok, reason=f"no sandbox: {isolation.probe_bwrap().detail}")

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "hostile"
SECRET_KEY = "sk-test-" + uuid.uuid4().hex  # what the reviewer's own environment holds; must never come out
SSH_MARKER = "PRIVATE-KEY-" + uuid.uuid4().hex
HOME_SECRET = "HOME-SECRET-" + uuid.uuid4().hex
INSTALL = "python -m pip install -v --no-build-isolation --no-deps --no-cache-dir ."
TESTS = "python -m unittest discover -s tests -v"
ROWS: list[dict] = []
LIMITS: dict[str, Limits] = {}  # the limits each fixture ran under


# ------------------------------------------------------------------------------------------------------- the host

class CountingHandler(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802
        CountingHandler.hits.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"host server reached")

    def log_message(self, *args):
        pass


def host_ip() -> str | None:
    """A non-loopback address of this machine, if it has one (the proxy must refuse it like any other host)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent; the kernel just picks the outgoing address
        ip = s.getsockname()[0]
        return None if ip.startswith("127.") else ip
    except OSError:
        return None
    finally:
        s.close()


@pytest.fixture(scope="module")
def server():
    srv = http.server.ThreadingHTTPServer(("0.0.0.0", 0), CountingHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


def digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def host(tmp_path, monkeypatch, server):
    """The user's machine: a home with keys and secrets, API keys in the environment, a victim file, a server."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text(f"-----BEGIN OPENSSH PRIVATE KEY-----\n{SSH_MARKER}\n")
    (home / ".ssh" / "id_rsa").chmod(0o600)
    (home / "secret.txt").write_text(HOME_SECRET)
    (home / ".bashrc").write_text("# the user's shell config\n")
    (home / ".config" / "reviewer").mkdir(parents=True)
    (home / ".config" / "reviewer" / "config.toml").write_text(f'api_key = "{SECRET_KEY}"\n')
    db = home / "reviews.db"
    db.write_text(f"database holding {HOME_SECRET}")
    victim = tmp_path / "victim.txt"
    victim.write_text("the host's own file\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN"):
        monkeypatch.setenv(name, SECRET_KEY)
    CountingHandler.hits.clear()
    tag = str(uuid.uuid4().int)[:12]  # digits: the daemon fixture uses it in `sleep 1001.<tag>`
    info = {"home": str(home), "db": str(db), "victim": str(victim), "outside": str(outside), "tag": tag,
            "port": server, "host_ip": host_ip()}
    before = {"home": digest(home), "victim": victim.read_text(), "etc": sorted(os.listdir("/etc"))}
    yield info
    # Nothing of the host changed, whatever the fixture did.
    assert digest(home) == before["home"], "the user's home changed"
    assert victim.read_text() == before["victim"], "the victim file changed"
    assert list(outside.iterdir()) == [], "something was written next to the workspace"
    assert sorted(os.listdir("/etc")) == before["etc"], "/etc changed"
    for path in (f"/etc/reviewer-pwned-{tag}", f"/usr/bin/reviewer-pwned-{tag}", f"/tmp/reviewer-pwned-{tag}",
                 f"/tmp/reviewer-dotdot-{tag}"):
        assert not os.path.exists(path), f"{path} was written on the host"
    assert processes_with(tag) == [], "a process of the fixture outlived its command"


def processes_with(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and str(os.getpid()) != pid:
            found.append(f"{pid}: {cmd}")
    return found


# -------------------------------------------------------------------------------------------------- the repository

@pytest.fixture(scope="module")
def template_venv(tmp_path_factory) -> Path:
    """One virtual environment (pip + setuptools), copied into each workspace: making one per test costs seconds."""
    venv = tmp_path_factory.mktemp("template") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    # `pip install --no-build-isolation` builds with what the venv has: setuptools and wheel (not in every venv).
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", "setuptools", "wheel"], check=True,
                   capture_output=True)
    return venv


def hostile_repo(name: str, dest: Path, targets: dict) -> Path:
    """tests/fixtures/hostile/common + <name>/payload.py + targets.json, committed into a real git repository."""
    shutil.copytree(FIXTURES / "common", dest)
    shutil.copy(FIXTURES / name / "payload.py", dest / "payload.py")
    (dest / "targets.json").write_text(json.dumps(targets))
    env = {**os.environ, "GIT_AUTHOR_NAME": "hostile", "GIT_AUTHOR_EMAIL": "h@example.com",
           "GIT_COMMITTER_NAME": "hostile", "GIT_COMMITTER_EMAIL": "h@example.com"}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", f"hostile fixture {name}"]):
        subprocess.run(["git", *args], cwd=dest, check=True, env=env, capture_output=True)
    return dest


def workspace_for(name: str, tmp_path: Path, host: dict, template_venv: Path, room: int | None = None) -> Path:
    """The fixture's workspace; with `room`, as a review gets it where the machine allows: its own file system
    (reviewer/sandbox/diskcap.py) holding what it holds now plus `room` bytes."""
    src = hostile_repo(name, tmp_path / "src", host)
    ws = tmp_path / "ws"
    ws.mkdir()
    subprocess.run(["git", "clone", "-q", str(src), str(ws / "repo")], check=True, capture_output=True)
    shutil.copytree(template_venv, ws / "venv", symlinks=True)
    (ws / "home").mkdir()
    (ws / "tmp").mkdir()
    if room is not None:
        staged = ws.rename(tmp_path / "ws-staged")
        ws.mkdir()
        why = diskcap.mount_capped(ws, supervisor.disk_usage([staged]) + room)
        if why:
            ws.rmdir()
            staged.rename(ws)
            pytest.skip(f"no kernel disk cap here: {why}")
        subprocess.run(["cp", "-a", f"{staged}/.", str(ws)], check=True)
        shutil.rmtree(staged)
    return ws


def run_phase(ws: Path, command: str, lim: Limits, host: dict) -> limits.Outcome:
    env = sandbox_env(home=ws / "home", tmp=ws / "tmp", venv=ws / "venv")
    box = Sandbox(workspace=ws, limits=lim, protect=[Path(host["db"])])
    return run_sandboxed(command, sandbox=box, cwd=ws / "repo", env=env)


def hostile_run(name: str, tmp_path: Path, host: dict, template_venv: Path, room: int | None = None,
                **limit_args) -> dict[str, limits.Outcome]:
    ws = workspace_for(name, tmp_path, host, template_venv, room)
    base = supervisor.disk_usage([ws])
    lim = Limits(**{"timeout": 20, "cpu_seconds": 4, "memory_bytes": 512 * MiB, "max_processes": 64,
                    "disk_bytes": base + 100 * MiB, "max_output_bytes": 8 * MiB, "keep_output": 20_000, **limit_args})
    LIMITS[name] = lim
    outcomes = {"install": run_phase(ws, INSTALL, lim, host), "test": run_phase(ws, TESTS, lim, host)}
    for phase, o in outcomes.items():
        # The command came back, with bounded output, and nothing secret in it.
        assert o.seconds < lim.timeout + 10
        assert len(o.output) < 3 * lim.keep_output
        for secret in (SECRET_KEY, SSH_MARKER, HOME_SECRET):
            assert secret not in o.output, f"{name}/{phase} leaked a secret"
        ROWS.append({"fixture": name, "phase": phase, "exit": o.exit_code, "seconds": round(o.seconds, 1),
                     "attempts": attempt_lines(o, phase),
                     "events": [f"{e.kind}{' (inferred)' if e.inferred else ''}: {e.detail}" for e in o.events]})
    return outcomes


def kinds(o: limits.Outcome) -> set[str]:
    return {e.kind for e in o.events}


def attempt_lines(o: limits.Outcome, phase: str) -> list[str]:
    """The payload's report lines (pip indents a build's output; unittest's "test_x ... " may precede the first)."""
    return [ln.split(f"HOSTILE {phase} ", 1)[1] for ln in o.output.splitlines() if f"HOSTILE {phase} " in ln]


def attempts(o: limits.Outcome, phase: str) -> dict[str, str]:
    return dict(line.partition(": ")[::2] for line in attempt_lines(o, phase))


def cgroup_has(controller: str) -> bool:
    cg, _ = cgroups.create_cgroup(Limits())
    if cg is None:
        return False
    cg.remove()
    return getattr(cg, f"{controller}_dir") is not None


# ---------------------------------------------------------------------------------------------------------- tests

def test_read_secrets(tmp_path, host, template_venv):
    out = hostile_run("read_secrets", tmp_path, host, template_venv)
    for phase, o in out.items():
        tried = attempts(o, phase)
        assert len(tried) >= 6, o.output  # the payload ran
        assert not any(r.startswith("GOT") for r in tried.values()), tried
        assert "escape_refused" in kinds(o)  # it named paths the sandbox hides


def test_env_dump(tmp_path, host, template_venv):
    out = hostile_run("env_dump", tmp_path, host, template_venv)
    for phase, o in out.items():
        env_lines = [ln for ln in attempt_lines(o, phase) if ln.startswith("env: ")]
        assert any("PATH=" in ln for ln in env_lines), o.output
        assert not any(k in o.output for k in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AWS_SECRET", "GITHUB_TOKEN"))
        # Only the sandbox's own processes are visible, none of the host's.
        assert len([ln for ln in o.output.splitlines() if "/proc/" in ln]) < 10


def test_escape_writes(tmp_path, host, template_venv):
    out = hostile_run("escape_writes", tmp_path, host, template_venv)
    ws = tmp_path / "ws"
    for phase, o in out.items():
        tried = attempts(o, phase)
        assert tried["write /etc"].startswith("refused") and "Read-only" in tried["write /etc"]
        assert tried["write /usr/bin"].startswith("refused")
        assert tried["write next to the workspace"].startswith("refused")
        assert tried["write via home symlink"].startswith("refused")
        # "write via symlink" / "delete the victim" may succeed on the sandbox's own /tmp (the victim's folder lies
        # under the host's /tmp, which the sandbox replaces); the host's file is checked untouched by `host`.
        assert "escape_refused" in kinds(o)
    # What the sandbox calls /tmp is the workspace's own tmp/: the "host /tmp" write landed there.
    assert (ws / "tmp" / f"reviewer-pwned-{host['tag']}").exists()


def test_network(tmp_path, host, template_venv):
    out = hostile_run("network", tmp_path, host, template_venv)
    assert CountingHandler.hits == [], f"the host's server was reached: {CountingHandler.hits}"
    for phase, o in out.items():
        tried = attempts(o, phase)
        assert tried and not any(r.startswith(("GOT", "CONNECTED")) for r in tried.values()), tried
        refused = [e.detail for e in o.events if e.kind == "network_refused" and not e.inferred]
        assert any("example.com:443" in d for d in refused), refused
        assert any(f"127.0.0.1:{host['port']}" in d for d in refused), refused
        if host["host_ip"]:
            assert any(f"{host['host_ip']}:{host['port']}" in d for d in refused), refused


def test_fork_bomb(tmp_path, host, template_venv):
    out = hostile_run("fork_bomb", tmp_path, host, template_venv, timeout=5)
    for o in out.values():
        assert kinds(o) & {"pids_limit", "timeout"}, o.events
        if cgroup_has("pids"):
            assert "pids_limit" in kinds(o)


def test_infinite_loop(tmp_path, host, template_venv):
    out = hostile_run("infinite_loop", tmp_path, host, template_venv, cpu_seconds=2, timeout=10)
    for o in out.values():
        assert kinds(o) & {"cpu_limit", "timeout"}, o.events
    # unittest runs the loop in bash's direct child: the SIGXCPU is seen exactly.
    assert "cpu_limit" in kinds(out["test"])


def test_big_output(tmp_path, host, template_venv):
    out = hostile_run("big_output", tmp_path, host, template_venv)
    for phase, o in out.items():
        assert "PRINTED 1 GiB" not in o.output
        # pip keeps a build's output in memory: the memory limit may stop it before the output limit does.
        assert kinds(o) & {"output_limit", "memory_limit"}, o.events
    assert "output_limit" in kinds(out["test"])


@pytest.fixture
def loaded_machine():
    """Two processes spinning on this 2-core machine for the length of a test: the supervisor's polls come late."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for spinner in spinners:
        spinner.kill()
        spinner.wait()


def test_disk_fill_is_stopped_within_the_cap_on_a_loaded_machine(tmp_path, host, template_venv, loaded_machine):
    free_before = shutil.disk_usage(tmp_path).free
    try:
        out = hostile_run("disk_fill", tmp_path, host, template_venv, room=100 * MiB)
        used = supervisor.disk_usage([tmp_path / "ws"])
    finally:
        diskcap.release(tmp_path / "ws")
    for o in out.values():
        assert "disk_limit" in kinds(o), o.events
    # The limit is base + 100 MiB. Polling alone let a writer at page-cache speed get 144-355 MiB past it on a loaded
    # machine (docs/sandbox.md). The workspace's own file system stops it in the kernel whatever the polls do: its
    # writes fail with ENOSPC once it is full, at most diskcap's margin past the limit.
    allowed = LIMITS["disk_fill"].disk_bytes
    assert used <= diskcap.image_size(allowed), (used // MiB, allowed // MiB)
    assert shutil.disk_usage(tmp_path).free > free_before - 700 * MiB


def test_daemon(tmp_path, host, template_venv):
    out = hostile_run("daemon", tmp_path, host, template_venv, timeout=8)
    for phase, o in out.items():
        # The tests return and leave the daemon: killed and named. In the install, pip itself waits for the daemon
        # (it holds pip's output pipe), so the timeout stops it — and names what it killed.
        killed = [e.detail for e in o.events if e.kind in ("process_killed", "timeout")]
        seconds = {"install": "1001", "test": "1002"}[phase]
        assert any(f"sleep {seconds}.{host['tag']}" in d for d in killed), o.events
        assert any(f"sleep {seconds}.5{host['tag']}" in d for d in killed), o.events


def test_registry_install_through_proxy(tmp_path, template_venv, host):
    """The allowlisted path: a real package from the real registry, through the proxy."""
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError as e:
        pytest.skip(f"no route to pypi.org from this machine: {e}")
    ws = workspace_for("read_secrets", tmp_path, host, template_venv)  # any workspace will do
    cmd = ("PIP_EXTRA_INDEX_URL= PIP_FIND_LINKS= python -m pip install --no-cache-dir --no-deps "
           "--index-url https://pypi.org/simple six && python -c 'import six; print(\"six\", six.__version__)'")
    o = run_phase(ws, cmd, Limits(timeout=120, memory_bytes=1024 * MiB), host)
    assert o.exit_code == 0, o.output
    assert "six 1." in o.output
    assert not [e for e in o.events if e.kind == "network_refused" and not e.inferred], o.events


@pytest.fixture(scope="module", autouse=True)
def results_table():
    yield
    path = os.environ.get("REVIEWER_HOSTILE_TABLE")
    if not path or not ROWS:
        return
    lines = ["| fixture | phase | attempts (as the payload saw them) | exit | events recorded |", "|---|---|---|---|---|"]
    for r in ROWS:
        tried = "<br>".join(a.replace("|", "\\|")[:110] for a in r["attempts"][:8]) or "-"
        events = "<br>".join(e.replace("|", "\\|")[:160] for e in r["events"]) or "-"
        lines.append(f"| {r['fixture']} | {r['phase']} | {tried} | {r['exit']} | {events} |")
    Path(path).write_text("\n".join(lines) + "\n")


def test_review_of_a_hostile_repository(tmp_path, host, monkeypatch):
    """`reviewer run --persona smoke` on a repository whose install script and tests attack: the review completes,
    every attempt is a sandbox event on the persona run, shown in the report, and no secret reaches the database."""
    from rich.console import Console

    from reviewer.config import load_settings
    from reviewer.report import report
    from reviewer.run.review import run_command
    from reviewer.store import db

    repo = hostile_repo("combined", tmp_path / "combined", host)
    monkeypatch.setenv("REVIEWER_LOCK_FILE", str(tmp_path / "review.lock"))
    settings = load_settings(db=str(tmp_path / "reviews.db"), personas=["smoke"], workdir=tmp_path / "work")
    settings.command_timeout = 120
    out = io.StringIO()
    code = run_command(str(repo), settings, console=Console(file=out, width=250))
    text = out.getvalue()
    assert code == 0, text
    [run] = report.collect_runs(settings.db, report.ReportFilter())
    assert run["status"] == "completed" and json.loads(run["machine"])["isolation"] == "bwrap"
    events = run["sandbox_events"]
    assert all(e["persona"] == "smoke" for e in events)
    kinds = {e["kind"] for e in events}
    assert {"network_refused", "process_killed", "escape_refused"} <= kinds, events
    assert any("exfiltrate.example:443" in e["detail"] for e in events if e["kind"] == "network_refused")
    assert any(f"sleep 1003.{host['tag']}" in e["detail"] for e in events if e["kind"] == "process_killed")
    assert "Sandbox events" in text and "exfiltrate.example" in text  # shown at the end of the run
    with db.session(settings.db) as s:
        stored = " ".join(p.transcript + (p.summary or "") for p in s.exec(db.select(db.PersonaRun)).all())
        stored += " ".join(e.detail + (e.command or "") for e in s.exec(db.select(db.SandboxEvent)).all())
    assert "HOSTILE test phone out" in stored  # the payload ran, and its output was stored...
    assert any("tests fail" in f["title"].lower() for f in run["findings"])  # ...and the review went on to judge it
    for secret in (SECRET_KEY, SSH_MARKER, HOME_SECRET):
        assert secret not in stored and secret not in text  # ...without anything it was after
