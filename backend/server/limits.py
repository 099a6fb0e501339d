"""Connection limits (issue 42): what a client that holds sockets open, or trickles its headers, can take from the
server. uvicorn and h11 offer an idle keep-alive timeout and nothing else that fits:

- h11 has no timeout for the request line and headers, so a connection that sends nothing, or a header a byte at a
  time, was held forever (and before the headers end, the API key is not even looked at). `GuardedH11Protocol`
  closes it after `header_timeout` with a 408.
- uvicorn's `limit_concurrency` is checked only once a request's headers have arrived (idle connections still take a
  file descriptor each, up to the process limit, where accept() fails in a loop and every failure is logged), and it
  answers /health with the same 503 as everything else. The cap here is taken at accept: up to `max_connections`
  are served; `overflow` more are accepted for a short window in which only /health and /metrics are answered (the
  rest get a 503 with Retry-After and are closed). When the overflow is full too, its oldest connection still
  waiting for its headers is closed (a 503 written to it) to make room: a flood of idle sockets churns through the
  overflow, and a monitor that sends `GET /health` as soon as it connects is answered. Only if every overflow
  connection is being answered does a new one get the 503 at once.

`ConnectionGate` holds the counts (read by /health and /metrics); `plan_limits` fits the cap under the file-descriptor
limit, which `raise_fd_limit` first raises to its hard value. Nothing here imports the rest of the server but
metrics.py.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from backend.server.metrics import Metrics

log = logging.getLogger("reviewer.backend")

DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_QUEUE = 64
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_KEEPALIVE_TIMEOUT = 5.0
OVERFLOW_HEADER_SECONDS = 2.0  # an overflow connection has this long to ask for /health or /metrics
FD_RESERVE = 256  # descriptors kept for everything but client connections (model files, logs, threads, pipes)
BACKLOG = 2048  # uvicorn's default listen backlog; asyncio accepts up to this many sockets in one go
RETRY_AFTER_SECONDS = 1
HEALTH_PATHS = ("/health", "/metrics")


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """The connection-level settings of `reviewer serve` (the request-level ones, body cap and timeouts, are in
    guards.py). `overflow` and `backlog` follow from the others (plan_limits)."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_queue: int = DEFAULT_MAX_QUEUE
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT
    overflow: int = 64
    backlog: int = BACKLOG


class LimitError(ValueError):
    """A setting that cannot work (a cap above what the descriptor limit allows): serve exits 2 with it."""


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (the usual soft default, 1024, is what a server outgrows
    first); return the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def overflow_for(max_connections: int) -> int:
    return max(8, min(256, max_connections // 16))


def plan_limits(fd_limit: int, max_connections: int | None, max_queue: int, header_timeout: float,
                keepalive_timeout: float) -> ServeLimits:
    """Fit the connection cap well under the descriptor limit: held connections (served + overflow), one accept
    burst (the backlog) and FD_RESERVE must all fit, so accept() never runs out of descriptors. A default cap is
    lowered to fit; an explicit one that does not fit is an error."""
    backlog = max(16, min(BACKLOG, fd_limit // 8))
    room = fd_limit - backlog - FD_RESERVE
    fits = int(room * 16 / 17)  # max_connections + its overflow (1/16 of it) <= room
    if max_connections is None:
        max_connections = min(DEFAULT_MAX_CONNECTIONS, fits)
        if max_connections < 1:
            raise LimitError(f"the file-descriptor limit ({fd_limit}) is too low to serve; raise it (ulimit -n)")
    elif max_connections < 1:
        raise LimitError(f"--max-connections must be at least 1, got {max_connections}")
    elif max_connections + overflow_for(max_connections) > room:
        raise LimitError(f"--max-connections {max_connections} does not fit the file-descriptor limit ({fd_limit}): "
                         f"at most {max(fits, 0)} here (the rest is kept for the accept backlog and the server's own "
                         "files); raise ulimit -n or lower it")
    if max_queue < 1:
        raise LimitError(f"--max-queue must be at least 1, got {max_queue}")
    for name, value in (("--header-timeout", header_timeout), ("--keepalive-timeout", keepalive_timeout)):
        if not value > 0:
            raise LimitError(f"{name} must be a positive number of seconds, got {value:g}")
    return ServeLimits(max_connections, max_queue, header_timeout, keepalive_timeout, overflow_for(max_connections),
                       backlog)


class ConnectionGate:
    """Counts of open connections by tier, shared by every connection of one server; decides a new connection's tier.
    Runs on the event loop only (no lock)."""

    def __init__(self, limits: ServeLimits, metrics: Metrics):
        self.limits, self.metrics = limits, metrics
        self.served = 0
        self.waiting_overflow: dict[int, GuardedH11Protocol] = {}  # by id, oldest first, until its headers arrive
        self.overflow = 0
        metrics.connection_limit.set(limits.max_connections)
        metrics.queue_limit.set(limits.max_queue)

    def admit(self, protocol: GuardedH11Protocol) -> str:
        """"served", "overflow" (only /health and /metrics answered) or "refused" (503 and closed at once)."""
        if self.served < self.limits.max_connections:
            self.served += 1
            tier = "served"
        else:
            if self.overflow >= self.limits.overflow and self.waiting_overflow:
                oldest = self.waiting_overflow[next(iter(self.waiting_overflow))]
                self.refuse("over_cap")
                self.release(oldest, oldest.tier)  # now: its connection_lost comes on a later loop iteration
                oldest.tier = "evicted"
                oldest.close_with(canned(503, self.busy_message(), RETRY_AFTER_SECONDS))
            if self.overflow >= self.limits.overflow:
                self.refuse("over_cap")
                return "refused"
            self.overflow += 1
            self.waiting_overflow[id(protocol)] = protocol
            tier = "overflow"
        self.metrics.connections.labels(tier).inc()
        return tier

    def headers_arrived(self, protocol: GuardedH11Protocol) -> None:
        self.waiting_overflow.pop(id(protocol), None)  # being answered: no longer the one to make room

    def busy_message(self) -> str:
        return f"the server is at its connection cap ({self.limits.max_connections}, --max-connections); retry soon"

    def release(self, protocol: GuardedH11Protocol, tier: str) -> None:
        self.waiting_overflow.pop(id(protocol), None)
        if tier == "served":
            self.served -= 1
        elif tier == "overflow":
            self.overflow -= 1
        else:
            return
        self.metrics.connections.labels(tier).dec()

    def refuse(self, reason: str) -> None:
        """Count a connection turned away; the log line is one of a kind, so the log filter (logs.py) keeps a few a
        window and a summary, however many arrive."""
        self.metrics.connections_refused.labels(reason).inc()
        log.warning("connection turned away (%s): the server holds %d connections, its cap is %d (--max-connections)",
                    reason, self.served, self.limits.max_connections)

    @property
    def saturated(self) -> bool:
        return self.served >= self.limits.max_connections


def canned(status: int, message: str, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 response with a JSON error body and Connection: close, for answers written below the app."""
    body = json.dumps({"error": {"message": message, "type": "server_overloaded" if status == 503 else
                                 "invalid_request_error", "param": None, "code": None}}).encode()
    reason = {408: "Request Timeout", 503: "Service Unavailable"}[status]
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n" + (f"retry-after: {retry_after}\r\n" if retry_after else "") + "\r\n")
    return head.encode() + body


def overflow_app(app, gate: ConnectionGate):
    """The app as an overflow connection sees it: /health and /metrics as usual, anything else a 503 with
    Retry-After; every answer closes the connection."""
    busy = json.dumps({"error": {"message": gate.busy_message(), "type": "server_overloaded",
                                 "param": None, "code": "too_many_connections"}}).encode()

    async def guarded(scope, receive, send):
        if scope["type"] != "http" or scope["path"] in HEALTH_PATHS:
            async def closing_send(message):
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
                await send(message)
            return await app(scope, receive, closing_send)
        gate.refuse("overflow")
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"retry-after", str(RETRY_AFTER_SECONDS).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": busy})

    return guarded


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the connection cap taken at accept (ConnectionGate) and a deadline for the request
    line and headers: from the connection's start, or from the first byte of a keep-alive connection's next request
    (uvicorn's own timeout_keep_alive covers the idle time between requests)."""

    def __init__(self, *args, gate: ConnectionGate, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.tier = gate, "refused"
        self.made = False  # uvicorn's connection_made ran (not for a connection refused at accept)
        self.header_timer = None
        self.awaiting_headers = True

    def connection_made(self, transport) -> None:
        self.tier = self.gate.admit(self)
        if self.tier == "refused":
            transport.write(canned(503, self.gate.busy_message(), RETRY_AFTER_SECONDS))
            transport.close()
            return
        super().connection_made(transport)
        self.made = True
        if self.tier == "overflow":
            self.app = overflow_app(self.app, self.gate)
        self.start_header_timer()

    def connection_lost(self, exc) -> None:
        if not self.made:
            return  # refused at accept: uvicorn's bookkeeping never saw it
        self.gate.release(self, self.tier)  # a no-op for one evicted (released then)
        self.tier = "gone"
        self.cancel_header_timer()
        super().connection_lost(exc)

    def header_seconds(self) -> float:
        limit = self.gate.limits.header_timeout
        return min(limit, OVERFLOW_HEADER_SECONDS) if self.tier == "overflow" else limit

    def start_header_timer(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.header_seconds(), self.header_timeout)

    def cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def data_received(self, data: bytes) -> None:
        if self.awaiting_headers:
            self.start_header_timer()
        super().data_received(data)
        self.check_headers_done()

    def check_headers_done(self) -> None:
        # h11 leaves IDLE for the peer once a whole request line and headers have been parsed
        if self.awaiting_headers and self.conn.their_state is not h11.IDLE:
            self.awaiting_headers = False
            self.cancel_header_timer()
            self.gate.headers_arrived(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer, runs any pipelined request
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.awaiting_headers = True
            if self.conn.trailing_data[0]:  # part of the next request already arrived: its clock runs
                self.start_header_timer()
        else:
            self.check_headers_done()

    def header_timeout(self) -> None:
        self.header_timer = None
        if not self.awaiting_headers or self.transport.is_closing():
            return
        self.gate.refuse("header_timeout")
        self.close_with(canned(408, f"the request line and headers did not arrive within {self.header_seconds():g} "
                                    "s (--header-timeout)"))

    def close_with(self, response: bytes) -> None:
        """Answer below the app and close: only while no request is in progress (awaiting its headers)."""
        self.cancel_header_timer()
        if not self.transport.is_closing():
            self.transport.write(response)
            self.transport.close()


def protocol_factory(gate: ConnectionGate):
    """What uvicorn.Config(http=...) takes: our protocol, bound to one server's gate."""
    return functools.partial(GuardedH11Protocol, gate=gate)
