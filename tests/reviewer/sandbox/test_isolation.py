"""The sandbox's parts, each against the real thing: the egress proxy on a real unix socket with real HTTP servers
behind it, bubblewrap with a real filesystem view, the limits with real processes, `reviewer doctor`, the event table.
The hostile repositories that attack all of it together are in test_hostile.py."""

from __future__ import annotations

import http.server
import io
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from reviewer.sandbox import egress_proxy, isolation, limits, supervisor
from reviewer.sandbox.egress_proxy import EgressProxy, host_allowed
from reviewer.sandbox.isolation import IsolationError, Sandbox, run_sandboxed, withhold_secrets
from reviewer.sandbox.limits import Limits, MiB
from reviewer.store import db

needs_bwrap = pytest.mark.skipif(not isolation.probe_bwrap().ok, reason=f"no sandbox: {isolation.probe_bwrap().detail}")


# ------------------------------------------------------------------------------------------------------ allowlist

@pytest.mark.parametrize("host,port,allow,expected", [
    ("pypi.org", 443, ["pypi.org"], True),
    ("PyPI.org.", 443, ["pypi.org"], True),
    ("pypi.org", 80, ["pypi.org"], True),
    ("pypi.org", 22, ["pypi.org"], False),  # an entry without a port opens the web ports only
    ("evil.pypi.org.attacker.net", 443, ["pypi.org"], False),
    ("files.pythonhosted.org", 443, ["*.pythonhosted.org"], True),
    ("pythonhosted.org.evil", 443, ["*.pythonhosted.org"], False),
    ("127.0.0.1", 3141, ["127.0.0.1:3141"], True),
    ("127.0.0.1", 3142, ["127.0.0.1:3141"], False),
    ("127.0.0.1", 80, ["pypi.org"], False),
    ("anything", 443, [], False),
])
def test_host_allowed(host, port, allow, expected):
    assert host_allowed(host, port, allow) is expected


def test_auto_allowlist_has_the_registries():
    setup = egress_proxy.RegistrySetup(hosts=["pypi.internal.example:8443"])
    allow = egress_proxy.expand_allowlist(["auto", "github.com"], setup)
    assert allow == ["pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "pypi.internal.example:8443",
                     "github.com"]
    assert egress_proxy.expand_allowlist([], setup) == []


def test_registry_locations(tmp_path):
    (tmp_path / "index" / "simple").mkdir(parents=True)
    setup = egress_proxy.RegistrySetup()
    assert egress_proxy.add_location(setup, "https://user:tok3n@pypi.corp.example/simple") == \
        "https://pypi.corp.example/simple"  # credentials never reach the sandbox
    assert egress_proxy.add_location(setup, f"file://{tmp_path}/index/simple") == f"file://{tmp_path}/index/simple"
    assert egress_proxy.add_location(setup, "http://10.0.0.5:3141/root/pypi") == "http://10.0.0.5:3141/root/pypi"
    assert setup.hosts == ["pypi.corp.example", "10.0.0.5:3141"]
    assert setup.ro_paths == [tmp_path / "index"]  # the folder above simple/, where ../../files/ points


# ---------------------------------------------------------------------------------------------------------- proxy

class Hello(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802
        body = f"hello {self.path} via {self.headers.get('Connection')}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def web():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


def through(sock_path: Path, request: bytes) -> bytes:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(sock_path))
    s.sendall(request)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    return data


def test_proxy_forwards_allowed_and_refuses_the_rest(tmp_path, web):
    sock = tmp_path / "p.sock"
    with EgressProxy(sock, [f"127.0.0.1:{web}"]) as proxy:
        answer = through(sock, f"GET http://127.0.0.1:{web}/pkg?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                               f"Proxy-Connection: keep-alive\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 200")
        assert answer.endswith(b"hello /pkg?x=1 via close")  # origin-form path, hop-by-hop headers replaced
        refused = through(sock, b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n")
        assert refused.startswith(b"HTTP/1.1 403") and b"not on the network allowlist" in refused
        for _ in range(2):
            assert through(sock, b"CONNECT evil.example:443 HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 403")
        assert through(sock, b"GET / HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 400")  # not a proxy request
        refusals = {(r.method, r.host, r.port): r.count for r in proxy.refusals()}
        assert proxy.passed == [f"GET 127.0.0.1:{web}"]
    assert refusals == {("GET", "example.com", 80): 1, ("CONNECT", "evil.example", 443): 2}
    assert not sock.exists()


def test_proxy_connect_tunnels_bytes_both_ways(tmp_path):
    echo = socket.create_server(("127.0.0.1", 0))
    port = echo.getsockname()[1]

    def serve():
        conn, _ = echo.accept()
        while data := conn.recv(65536):
            conn.sendall(data.upper())
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    with EgressProxy(tmp_path / "p.sock", [f"127.0.0.1:{port}"]):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(str(tmp_path / "p.sock"))
        s.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
        assert s.recv(100) == b"HTTP/1.1 200 Connection established\r\n\r\n"
        payload = os.urandom(300_000).hex().encode()  # bigger than any buffer on the way
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        assert got == payload.upper()
    echo.close()


# -------------------------------------------------------------------------------------------------- environment

def test_withhold_secrets_by_name_and_by_value():
    host_env = {"OPENAI_API_KEY": "sk-abcdef123456", "AWS_CA_BUNDLE": "/etc/ssl/certs/ca.pem", "HOME": "/home/u"}
    env = {"PATH": "/usr/bin", "GITHUB_TOKEN": "ghp_x", "SNEAKY": "Bearer sk-abcdef123456",
           "REQUESTS_CA_BUNDLE": "/etc/ssl/certs/ca.pem", "LANG": "C.UTF-8"}
    kept, events = withhold_secrets(env, host_env)
    assert kept == {"PATH": "/usr/bin", "REQUESTS_CA_BUNDLE": "/etc/ssl/certs/ca.pem", "LANG": "C.UTF-8"}
    assert [e.kind for e in events] == ["env_withheld"] and "GITHUB_TOKEN, SNEAKY" in events[0].detail


# ------------------------------------------------------------------------------------------------- the sandbox view

@pytest.fixture
def ws(tmp_path):
    w = tmp_path / "ws"
    for sub in ("repo", "home", "tmp"):
        (w / sub).mkdir(parents=True)
    return w


def env_for(ws: Path) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(ws / "home"), "TMPDIR": str(ws / "tmp"),
            "LANG": "C.UTF-8"}


def sandboxed(ws: Path, command: str, **kw) -> limits.Outcome:
    box = Sandbox(workspace=ws, limits=kw.pop("limits", Limits(timeout=30)), **kw)
    return run_sandboxed(command, sandbox=box, cwd=ws / "repo", env=env_for(ws))


@needs_bwrap
def test_view_of_the_host(ws, tmp_path, monkeypatch):
    home = tmp_path / "userhome"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text("KEY-MARKER")
    monkeypatch.setenv("HOME", str(home))
    script = (
        f"cat {home}/.ssh/id_rsa; ls {tmp_path}; echo ws-ok > ok.txt; echo tmp-ok > /tmp/t.txt; "
        "touch /etc/x /usr/x /x 2>&1; cat /etc/shadow 2>&1 | head -c 40; echo; "
        "echo pid=$$; ls /proc | grep -c '^[0-9]'; hostname; cat /proc/self/status | grep CapEff; "
        "echo x 2>&1 > /proc/sys/kernel/domainname"  # namespaced, so harmless if it ever worked; read-only like all sysctls
    )
    o = sandboxed(ws, script)
    assert "KEY-MARKER" not in o.output
    assert f"{home}/.ssh/id_rsa: No such file" in o.output
    assert (ws / "repo" / "ok.txt").read_text() == "ws-ok\n"  # the workspace is writable
    assert (ws / "tmp" / "t.txt").read_text() == "tmp-ok\n"  # /tmp is the workspace's tmp/
    assert o.output.count("Read-only file system") == 4
    assert "/proc/sys/kernel/domainname: Read-only file system" in o.output
    assert "root:" not in o.output  # /etc/shadow is masked (empty) even when the reviewer is root
    assert "sandbox" in o.output and "CapEff:\t0000000000000000" in o.output
    assert int(o.output.split("pid=")[1].split()[0]) < 10  # a fresh PID namespace
    assert any(e.kind == "escape_refused" and e.inferred for e in o.events)


@needs_bwrap
def test_workspace_holding_the_home_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "ws" / "home"))
    (tmp_path / "ws" / "home").mkdir(parents=True)
    (tmp_path / "ws" / "repo").mkdir()
    with pytest.raises(IsolationError, match="contains"):
        sandboxed(tmp_path / "ws", "true")


@needs_bwrap
def test_no_network_but_the_proxy(ws, web):
    # The host's server on 127.0.0.1 is a different loopback from the sandbox's; through the proxy it is refused.
    o = sandboxed(ws, f"python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:{web}/', timeout=3)\" "
                      f"2>&1 | tail -1; curl -sS -m 5 --noproxy '' -x http://127.0.0.1:3128 http://127.0.0.1:{web}/ 2>&1 | head -1")
    assert "Connection refused" in o.output and "hello" not in o.output
    assert [e.detail for e in o.events if e.kind == "network_refused" and not e.inferred] == \
        [f"GET http://127.0.0.1:{web}/ refused: not on the network allowlist"]


@needs_bwrap
def test_allowlisted_host_passes_through_the_forwarder(ws, web):
    o = sandboxed(ws, f"curl -sS -m 10 --noproxy '' -x http://127.0.0.1:3128 http://127.0.0.1:{web}/inside",
                  network_allow=[f"127.0.0.1:{web}"])
    assert o.exit_code == 0, o.output
    assert o.output == "hello /inside via close"


# ---------------------------------------------------------------------------------------------------------- limits

@needs_bwrap
def test_memory_limit(ws):
    # Grows step by step, as a real leak would: the cgroup's OOM kill (exact), else RLIMIT_DATA's MemoryError.
    o = sandboxed(ws, "python3 -c 'x = []\nwhile True: x.append(bytearray(16 << 20))'",
                  limits=Limits(timeout=30, memory_bytes=128 * MiB))
    assert o.exit_code != 0
    assert "memory_limit" in {e.kind for e in o.events}, o.events


@needs_bwrap
def test_timeout_kills_everything_and_says_what(ws):
    t = time.monotonic()
    o = sandboxed(ws, "sleep 300 & sleep 301", limits=Limits(timeout=1.5))
    assert time.monotonic() - t < 10
    assert o.timed_out and o.exit_code is None and "[killed: the command ran past its 1.5 s timeout]" in o.output
    [event] = [e for e in o.events if e.kind == "timeout"]
    assert "sleep 300" in event.detail and "sleep 301" in event.detail
    assert not any("sleep 30" in supervisor.command_line(p) for p in supervisor.descendant_pids(os.getpid()))


@needs_bwrap
def test_timeout_holds_for_a_command_that_closes_its_output(ws):
    t = time.monotonic()
    o = sandboxed(ws, "exec >/dev/null 2>&1; sleep 30", limits=Limits(timeout=1.5))
    assert time.monotonic() - t < 10
    assert o.timed_out and "timeout" in {e.kind for e in o.events}


@needs_bwrap
def test_file_size_limit_on_a_direct_child(ws):
    o = sandboxed(ws, "exec head -c 50000000 /dev/zero > big.bin",
                  limits=Limits(timeout=30, disk_bytes=None, file_size_bytes=10 * MiB))
    assert "file_size_limit" in {e.kind for e in o.events}, o.events
    assert (ws / "repo" / "big.bin").stat().st_size == 10 * MiB


@needs_bwrap
def test_many_empty_files_hit_the_file_limit(ws):
    # No bytes, only inodes: the file count stops it.
    o = sandboxed(ws, "mkdir many && cd many && for i in $(seq 1 20000); do : > f$i; done; echo done",
                  limits=Limits(timeout=60, max_files=5_000))
    assert [e.kind for e in o.events if not e.inferred] == ["disk_limit"], o.events
    assert "files, over its limit of 5000" in o.events[0].detail


def test_output_buffer_keeps_head_and_tail():
    buf = supervisor.OutputBuffer(100)
    buf.add(b"A" * 60)
    for _ in range(1000):
        buf.add(b"m" * 100)
    buf.add(b"Z" * 60)
    text, truncated = buf.text(100)
    assert truncated and text.startswith("A" * 50) and text.endswith("Z" * 50)
    assert "bytes left out" in text


def test_isolation_none_is_loud_and_still_limited(ws):
    o = sandboxed(ws, "echo $HOME; sleep 30", mode="none", limits=Limits(timeout=1))
    kinds = [e.kind for e in o.events]
    assert kinds[0] == "isolation_disabled" and "WITHOUT a sandbox" in o.events[0].detail
    assert "timeout" in kinds and o.timed_out


def test_resolve_mode_without_bwrap(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    isolation.probe_bwrap.cache_clear()
    try:
        assert isolation.resolve_mode("none") == "none"
        with pytest.raises(IsolationError, match="--isolation none"):
            isolation.resolve_mode("auto")
        with pytest.raises(IsolationError, match="apt-get install bubblewrap"):
            isolation.resolve_mode("bwrap")
    finally:
        isolation.probe_bwrap.cache_clear()


# ---------------------------------------------------------------------------------------------- doctor, database

@needs_bwrap
def test_doctor_reports_and_exits_by_verdict(tmp_path):
    from reviewer.config import Settings
    from reviewer.sandbox.doctor import doctor_command

    out = io.StringIO()
    code = doctor_command(Settings(db=str(tmp_path / "r.db")), Console(file=out, width=200))
    text = out.getvalue()
    for check in ("bubblewrap", "home_hidden", "database_hidden", "system_read_only", "no_direct_network",
                  "proxy_reachable", "refusal_recorded", "process_limit", "memory_limit", "allowlist"):
        assert check in text
    assert code == (0 if "Full isolation is available" in text else 1)
    assert code == 0 or os.geteuid() == 0  # only root without a pids cgroup lacks a process limit here


def test_doctor_without_bwrap(monkeypatch, tmp_path):
    from reviewer.config import Settings
    from reviewer.sandbox.doctor import doctor_command

    monkeypatch.setenv("PATH", str(tmp_path))
    isolation.probe_bwrap.cache_clear()
    out = io.StringIO()
    try:
        code = doctor_command(Settings(db=str(tmp_path / "r.db")), Console(file=out, width=200))
    finally:
        isolation.probe_bwrap.cache_clear()
    assert code == 1
    assert "bwrap is not installed" in out.getvalue() and "--isolation none" in out.getvalue()


def test_sandbox_event_rows(tmp_path):
    path = str(tmp_path / "r.db")
    with db.session(path) as s:
        repo = db.get_or_create_repository(s, "file:///x")
        run = db.ReviewRun(repository_id=repo.id)
        s.add(run)
        s.flush()
        pr = db.PersonaRun(run_id=run.id, persona="smoke")
        s.add(pr)
        s.flush()
        s.add(db.SandboxEvent(run_id=run.id, persona_run_id=pr.id, persona="smoke", kind="network_refused",
                              detail="CONNECT evil.example:443 refused", command="pip install x"))
        s.commit()
    with db.session(path) as s:
        [row] = s.exec(db.select(db.SandboxEvent)).all()
    assert (row.kind, row.persona, row.inferred) == ("network_refused", "smoke", False)
