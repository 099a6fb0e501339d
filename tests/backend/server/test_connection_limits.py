"""Connection limits of a real `reviewer serve` (issue 42), over real sockets: a flood of idle connections beyond the
cap leaves /health answering (and saying the server is saturated), a connection that trickles its headers or sends
nothing is closed after the header timeout, an idle keep-alive connection after the keep-alive timeout, the log
grows by a bounded number of lines however many connections are refused, and the limits' bad values are one-line
errors. How fast /health answers under a flood is a benchmark (bench/serve_limits.py), not a test."""
import json
import socket
import time

import httpx
import pytest

from tests.backend.server.test_server import listening_address, start_serve, stop, wait_for

CAP = 8
HEADER_TIMEOUT = 3.0


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def limited(tiny_model, tmp_path_factory):
    """A real serve process on the tiny model with a low connection cap and short timeouts."""
    tmp = tmp_path_factory.mktemp("limited")
    process = start_serve(tmp, model=str(tiny_model("llama")), max_connections=CAP, header_timeout=HEADER_TIMEOUT,
                          keepalive_timeout=1.0)
    url = listening_address(process)
    with httpx.Client(base_url=url, timeout=10) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, timeout=120)
    process.url, process.port = url, port_of(url)
    yield process
    assert stop(process)


def log_lines(process) -> int:
    process.stderr_file.flush()
    with open(process.stderr_file.name) as f:
        return sum(1 for _ in f)


def read_until_closed(sock: socket.socket, wait: float = 15.0) -> tuple[bytes, float]:
    start, answer = time.monotonic(), b""
    sock.settimeout(wait)
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return answer, time.monotonic() - start


def read_response(sock: socket.socket) -> bytes:
    """One whole response (head and Content-Length body) from a keep-alive connection."""
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_flood_of_idle_connections_beyond_the_cap_leaves_health_answering(limited):
    idle = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(CAP + 200)]
    try:
        time.sleep(0.3)  # the server has accepted them all: CAP served, the rest churned through the overflow
        with httpx.Client(base_url=limited.url, timeout=5) as http:
            health = http.get("/health")
            assert health.status_code == 200, health.text
            assert health.json()["saturated"] == ["connections"], health.json()
            assert health.json()["connections"]["served"] == CAP
            metrics = http.get("/metrics")
            assert metrics.status_code == 200 and 'reviewer_connections{tier="served"} 8.0' in metrics.text
            # any other route on a connection beyond the cap: a 503 that says which limit, with Retry-After
            busy = http.get("/v1/models")
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
            assert "--max-connections" in busy.json()["error"]["message"]
        # the idle connections beyond the cap were not held: the first ones were answered 503 and closed to make
        # room for later ones, the last ones (still in the overflow) get the overflow's short header deadline
        answer, _ = read_until_closed(idle[CAP], wait=5)
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer, answer[:200]
        answer, _ = read_until_closed(idle[-1], wait=5)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    finally:
        for sock in idle:
            sock.close()
    with httpx.Client(base_url=limited.url, timeout=5) as http:
        assert wait_for(lambda: http.get("/health").json()["saturated"] == [], timeout=10)


def test_a_connection_that_trickles_its_headers_is_closed_after_the_header_timeout(limited):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nUser-Agent: " + b"a" * 200 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", limited.port)) as sock:
        start, closed = time.monotonic(), False
        for byte in request:  # one byte every 50 ms: the whole request would take over 10 s
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.05)
            if time.monotonic() - start > HEADER_TIMEOUT + 1:
                break
        answer, _ = read_until_closed(sock, wait=5)
    assert closed or answer.startswith(b"HTTP/1.1 408"), answer[:200]
    if answer:
        assert b"--header-timeout" in answer and json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]


def test_a_connection_that_sends_nothing_gets_a_408_and_is_closed(limited):
    with socket.create_connection(("127.0.0.1", limited.port)) as sock:
        answer, seconds = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert seconds < 14  # closed by the server (its header timeout is 3 s), not by our 15 s socket timeout


def test_an_idle_keepalive_connection_is_closed_and_its_next_request_has_the_header_deadline(limited):
    with socket.create_connection(("127.0.0.1", limited.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        answer, seconds = read_until_closed(sock)  # idle after the answer: closed after the 1 s keep-alive timeout
    assert answer == b"" and seconds < 14
    with socket.create_connection(("127.0.0.1", limited.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /heal")  # the next request starts, and stops: the header deadline applies again
        answer, _ = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_the_log_grows_by_a_bounded_number_of_lines_under_many_refused_connections(limited):
    held = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(CAP)]
    try:
        time.sleep(0.2)
        before = log_lines(limited)
        refused = 0
        for _ in range(2000):  # each beyond the cap: turned away with a 503 and a line the log filter bounds
            with socket.create_connection(("127.0.0.1", limited.port)) as sock:
                refused += 1
        time.sleep(0.5)
        grown = log_lines(limited) - before
    finally:
        for sock in held:
            sock.close()
    assert refused == 2000
    with httpx.Client(base_url=limited.url, timeout=5) as http:
        text = http.get("/metrics").text
    turned_away = sum(float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith("reviewer_connections_refused_total{"))
    suppressed = sum(float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("reviewer_log_lines_suppressed_total{"))
    assert turned_away >= 2000 and suppressed >= 1900, (turned_away, suppressed)
    assert grown <= 20, grown  # a few lines of each kind per 10 s window, and a summary


@pytest.mark.parametrize("kwargs,words", [
    (dict(max_connections=0), "--max-connections must be at least 1"),
    (dict(max_connections=10**9), "does not fit the file-descriptor limit"),
    (dict(max_queue=0), "--max-queue must be at least 1"),
    (dict(header_timeout=0), "--header-timeout must be a positive number"),
])
def test_limits_that_cannot_work_are_one_line_errors(tmp_path, kwargs, words):
    process = start_serve(tmp_path, **kwargs)
    assert process.wait(60) == 2
    process.stderr_file.seek(0)
    err = process.stderr_file.read()
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_repeated_log_lines_are_cut_to_a_few_and_a_summary_that_counts_them():
    """The filter itself, on a real logger and handler: a thousand identical errors make BURST lines, then one
    summary line when the window closes, and the counter says how many were left out."""
    import io
    import logging

    from backend.server.logs import BURST, RepeatFilter
    from backend.server.metrics import Metrics

    metrics, stream = Metrics(), io.StringIO()
    handler = logging.StreamHandler(stream)
    limiter = RepeatFilter(metrics, window=0.2)
    handler.addFilter(limiter)
    logger = logging.getLogger("tests.repeat_filter")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for i in range(1000):
            logger.error("accept failed on socket %d", i)
        logger.warning("another kind")  # a different message is not held back by the first
        time.sleep(0.25)
        limiter.flush()
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[:BURST] == [f"accept failed on socket {i}" for i in range(BURST)], lines[:5]
    assert "another kind" in lines
    assert len(lines) == BURST + 2, lines
    assert lines[-1].startswith(f"({1000 - BURST} more like 'accept failed on socket 0' left out"), lines[-1]
    text = metrics.render().decode()
    assert f'reviewer_log_lines_suppressed_total{{logger="tests.repeat_filter"}} {1000 - BURST}.0' in text


EMFILE_SERVER = r'''
import asyncio, json, resource, sys
import uvicorn
from backend.server.limits import ConnectionGate, ServeLimits, protocol_factory
from backend.server.logs import count_accept_errors, install_log_limits
from backend.server.metrics import Metrics

metrics = Metrics()

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = metrics.render()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})

# a cap far above what the descriptors allow: accept() itself runs out, as before issue 42
gate = ConnectionGate(ServeLimits(max_connections=5000, overflow=8), metrics)
config = uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), http=protocol_factory(gate), log_level="info",
                        lifespan="off")
install_log_limits(metrics, window=1.0)

class Server(uvicorn.Server):
    async def startup(self, sockets=None):
        asyncio.get_running_loop().set_exception_handler(count_accept_errors(metrics))
        await super().startup(sockets)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        print("up", flush=True)

Server(config).run()
'''


def test_accept_running_out_of_descriptors_logs_a_bounded_number_of_lines(tmp_path):
    """asyncio logs "socket.accept() out of system resource" for every accept of a burst (up to the 2048 backlog),
    each time the listening socket is ready: that was 139,000 errors in 37 s. A server whose descriptor limit is
    below its connections (here 64, on purpose) logs a few of them a window and counts them all."""
    import subprocess
    import sys

    from backend.server.logs import BURST
    from tests.backend.server.test_server import ROOT

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen([sys.executable, "-c", EMFILE_SERVER, str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=log, text=True)
    held = []
    try:
        assert server.stdout.readline().strip() == "up"
        started = time.monotonic()
        for _ in range(300):  # past the 64 descriptors: the rest wait in the backlog while accept() fails
            held.append(socket.create_connection(("127.0.0.1", port)))
        time.sleep(3)
        for sock in held[:100]:
            sock.close()
        held = held[100:]
        assert wait_for(lambda: len(open(log.name).read().splitlines()) > 0, timeout=10)
        time.sleep(1.5)  # a window closes: its summary is written
        for sock in held:
            sock.close()
        held = []
        text = httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text
        windows = int(time.monotonic() - started) + 2  # the 1 s windows the test lasted
    finally:
        for sock in held:
            sock.close()
        server.terminate()
        server.wait(30)
    errors = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("reviewer_accept_errors_total")))
    log.seek(0)
    lines = log.read().splitlines()
    assert errors > 100, errors  # it did run out, many times
    accept_lines = [line for line in lines if "out of system resource" in line]
    # BURST a window and the window's summary, instead of one (with its traceback) per failed accept
    assert accept_lines and len(accept_lines) <= (BURST + 1) * windows, (len(accept_lines), windows)
    assert any("left out of the log" in line for line in lines), lines[-5:]
    assert len(lines) < 50 * windows, len(lines)
