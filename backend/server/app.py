"""The inference server: assembles the app (the routes of openai_routes.py and anthropic_routes.py, health, metrics,
API key, error bodies), loads the model in the background, and runs uvicorn (`serve`).

Data flow for a request: route (openai_routes.py, anthropic_routes.py, over jobs.py) -> render the prompt (chat.py)
-> Job into the FIFO -> the engine thread (worker.py) runs Engine.generate under the job's stop policy (stops.py) and
hands text deltas back through the event loop -> Generation -> the route shapes text into OpenAI chunks / Anthropic
events / JSON bodies.

One engine, batch 1, by design: requests wait in FIFO order; a request that waits longer than `queue_timeout` gets a 503
with a clear message; a client that disconnects cancels its generation at once, and a stop string that matches ends it
at the engine's yield that completed it. The
model loads on a background thread after the socket is up: /health says 503 until it is ready.
"""
from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import secrets
import socket
import stat
import sys
import threading
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.loading import LoadedModel, ModelLoadError, check_model_spec
from backend.server.guards import (DEFAULT_BODY_TIMEOUT, APIError, BodyGuard, body_too_large_message, error_response,
                                   unparsable_body_message, validation_message)
from backend.server import anthropic_routes, openai_routes
from backend.server.limits import (DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEPALIVE_TIMEOUT, DEFAULT_MAX_QUEUE, LimitError,
                                   ServeLimits, plan_limits, protocol_factory, raise_fd_limit)
from backend.server.logs import count_accept_errors, install_log_limits
from backend.server.state import ServerState

log = logging.getLogger("reviewer.backend")

DEFAULT_QUEUE_TIMEOUT = float(os.environ.get("REVIEWER_QUEUE_TIMEOUT", "600"))
def check_api_key(request: Request) -> None:
    """With --api-key, every route but /health needs it: `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY`
    (Anthropic); either header is accepted on every route."""
    key = request.app.state.reviewer.api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    if not secrets.compare_digest(given.encode(), key.encode()):
        raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY or x-api-key: KEY)",
                       code="invalid_api_key")


# ---- the app ---------------------------------------------------------------------------------------------------------

def create_app(model: str | LoadedModel = "embedded", drafter: str = "none", device: str = "auto", dtype: str = "auto",
               max_context: int | None = None, api_key: str | None = None,
               queue_timeout: float = DEFAULT_QUEUE_TIMEOUT, max_body_bytes: int | None = None,
               body_timeout: float = DEFAULT_BODY_TIMEOUT, limits: ServeLimits | None = None,
               cpu_engine: str = "auto", threads: int | None = None) -> FastAPI:
    """The ASGI app. The model loads on a background thread once the app starts (lifespan), so the socket answers
    /health (503) at once. `model` may also be an already loaded LoadedModel (tests). `max_body_bytes`: the request
    body cap (default: sized to the context window); `body_timeout`: seconds a body may take to arrive; `limits`:
    the connection and queue caps (the connection ones act only under serve's protocol, limits.py). `cpu_engine`:
    auto, torch or llama.cpp (ServerState._engine_kind); `threads`: llama.cpp's threads (default: chosen for the
    machine, backend/decoding/llamacpp.py)."""
    state = ServerState(model, drafter, device, dtype, max_context, api_key, queue_timeout, max_body_bytes,
                        body_timeout, limits, cpu_engine, threads)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.prompt_slot = asyncio.Semaphore(1)
        threading.Thread(target=state.load, name="reviewer-loader", daemon=True).start()
        yield
        state.stopping.set()
        if state.worker:
            state.worker.stop()

    # The schema route is our own (below) so that --api-key covers it too.
    app = FastAPI(title="reviewer inference server", version="1", lifespan=lifespan,
                  openapi_url=None, docs_url=None, redoc_url=None)
    app.state.reviewer = state
    app.add_middleware(BodyGuard, state=state)
    keyed = [Depends(check_api_key)]

    # Both are coroutines, so they never wait for a thread of the pool that the routes' sync work may have filled.
    @app.get("/health", tags=["server"], responses={503: {"description": "loading or failed"}})
    async def health():
        """200 once the model is ready, 503 while it loads or after it failed. `saturated` lists the caps that are
        full ("connections", "queue"): a saturated server is healthy but turns new work away."""
        if state.load_error:
            return JSONResponse({"status": "error", "error": state.load_error, **state.saturation}, status_code=503)
        if not state.ready.is_set():
            return JSONResponse({"status": "loading", **state.saturation}, status_code=503)
        return {"status": "ok", "model": state.loaded.name, "max_context": state.loaded.max_context,
                **state.saturation}

    @app.get("/metrics", tags=["server"], dependencies=keyed, response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    app.include_router(openai_routes.router, dependencies=keyed)
    app.include_router(anthropic_routes.router, dependencies=keyed)

    @app.get("/openapi.json", include_in_schema=False, dependencies=keyed)
    def openapi():
        return schema_as_on_the_wire(app.openapi())

    add_error_handlers(app, state)
    return app


def add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every refusal as the APIs' error body (400 for a malformed request on every route, not FastAPI's 422), counted
    on /metrics under its route."""
    routes = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages"}

    def count_refusal(request: Request, outcome: str) -> None:
        if request.url.path in routes:
            state.metrics.requests.labels(routes[request.url.path], outcome).inc()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        count_refusal(request, {"queue_timeout": "timeout", "queue_full": "busy"}.get(exc.code, "cancelled" if exc.status == 499 else
                                                                     "rejected" if exc.status < 500 else "error"))
        headers = {"Retry-After": "5"} if exc.status == 503 else None
        return error_response(request, exc.status, exc.message, exc.code, exc.param, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        # OpenAI answers malformed requests with 400 (not FastAPI's 422); so do we, on every route.
        count_refusal(request, "rejected")
        message, where = validation_message(exc.errors())
        return error_response(request, 400, message, code="invalid_request", param=where)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message, headers = str(exc.detail), getattr(exc, "headers", None)
        if exc.status_code == 413:  # from BodyGuard
            count_refusal(request, "rejected")
            message = body_too_large_message(state)
        elif exc.status_code == 408:
            count_refusal(request, "rejected")
        elif exc.status_code == 400:  # FastAPI's "There was an error parsing the body"
            count_refusal(request, "rejected")
            message = unparsable_body_message(exc.__cause__)
            return error_response(request, 400, message, code="invalid_request")
        return error_response(request, exc.status_code, message, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}")



def schema_as_on_the_wire(schema: dict) -> dict:
    """FastAPI documents a 422 for every route with a body; the server answers validation errors with 400 (the
    APIs' own status, already listed with the routes' other errors): the 422s and their schemas go."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int, uds: str | None) -> socket.socket:
    """The listening socket, bound here rather than by uvicorn so that a port in use or a bad address is one line of
    ours and status 2 (uvicorn logs its own lines and exits 1). A unix socket file left by a killed server (nobody
    answers on it) is replaced; one that answers is in use."""
    def refuse(message: str):
        print(f"reviewer serve: {message}", file=sys.stderr)
        raise SystemExit(2)

    if uds:
        if os.path.exists(uds):
            if not stat.S_ISSOCK(os.stat(uds).st_mode):
                refuse(f"--uds {uds} exists and is not a socket")
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(uds)
                    refuse(f"--uds {uds} is in use: another server answers on it")
                except (ConnectionRefusedError, FileNotFoundError):
                    os.unlink(uds)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(uds)
        except OSError as exc:
            sock.close()
            refuse(f"cannot listen on unix socket {uds}: {exc.strerror or exc}")
        os.chmod(uds, 0o666)  # as uvicorn does: the socket's folder decides who may connect
    else:
        if not 0 <= port <= 65535:
            refuse(f"--port must be between 0 and 65535 (0: any free port), got {port}")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                refuse(f"port {port} on {host} is already in use (another server?); pick another --port, or --port 0 "
                       "for any free one")
            refuse(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    sock.set_inheritable(True)
    return sock


def check_serve_options(model, drafter, host, uds, api_key, allow_remote_without_key, max_body_bytes, body_timeout,
                        cpu_engine, threads, max_connections, max_queue, header_timeout,
                        keepalive_timeout) -> ServeLimits:
    """serve's arguments checked before a socket is bound: one line and status 2 for a mistake; returns the
    connection limits planned under the file-descriptor limit (raised first)."""
    try:
        check_model_spec(model)
    except ModelLoadError as exc:
        print(f"reviewer serve: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if drafter not in (None, "", "auto", "none") and not os.path.exists(os.path.expanduser(drafter)):
        print(f"reviewer serve: drafter not found: {drafter} (give a drafter folder, 'auto' or 'none')", file=sys.stderr)
        raise SystemExit(2)
    allow_remote_without_key = allow_remote_without_key or os.environ.get("REVIEWER_ALLOW_REMOTE_WITHOUT_KEY") == "1"
    if uds is None and not is_loopback(host) and not api_key and not allow_remote_without_key:
        print(f"reviewer serve: refusing to listen on {host} (not a loopback address) without --api-key; "
              "set one, or REVIEWER_ALLOW_REMOTE_WITHOUT_KEY=1 to allow it anyway", file=sys.stderr)
        raise SystemExit(2)
    if max_body_bytes is not None and max_body_bytes < 1:
        print(f"reviewer serve: --max-body-mb must be positive, got {max_body_bytes / 2**20:g}", file=sys.stderr)
        raise SystemExit(2)
    if not body_timeout > 0:
        print(f"reviewer serve: --body-timeout must be a positive number of seconds, got {body_timeout:g}",
              file=sys.stderr)
        raise SystemExit(2)
    if cpu_engine not in ("auto", "torch", "llama.cpp"):
        print(f"reviewer serve: --cpu-engine must be auto, torch or llama.cpp, got {cpu_engine!r}", file=sys.stderr)
        raise SystemExit(2)
    if threads is not None and threads < 1:
        print(f"reviewer serve: --threads must be at least 1, got {threads}", file=sys.stderr)
        raise SystemExit(2)
    try:
        limits = plan_limits(raise_fd_limit(), max_connections, max_queue, header_timeout, keepalive_timeout)
    except LimitError as exc:
        print(f"reviewer serve: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return limits


def serve(model: str, drafter: str, host: str, port: int, uds: str | None, device: str, dtype: str,
          max_context: int | None, api_key: str | None = None, allow_remote_without_key: bool = False,
          max_body_bytes: int | None = None, body_timeout: float = DEFAULT_BODY_TIMEOUT,
          max_connections: int | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
          header_timeout: float = DEFAULT_HEADER_TIMEOUT, keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT,
          cpu_engine: str = "auto", threads: int | None = None) -> None:
    """Run the server until interrupted (blocking). Prints one "listening on ..." line once the socket is up; the
    model then loads in the background (GET /health: 503 until ready). Exits with status 1 if loading fails, 2 for a
    bad setup (model path, drafter, port, an address in use, limits that cannot work). SIGTERM or Ctrl-C: streams end
    with a final error event, other requests get a 503, and the process exits within a few seconds.
    `max_connections` (default: 1024, lowered to fit the file-descriptor limit), `max_queue`, `header_timeout` and
    `keepalive_timeout`: the connection limits of limits.py (backend/README.md, "Limits"). `cpu_engine`, `threads`:
    the CPU engine (backend/README.md, "The CPU engine")."""
    # OpenMP threads that spin between parallel regions take the cores the reviewer's sandboxed work needs, and stall
    # the torch engine itself when the box is busy (bench/results/cpu_peer-torch_engine-20261203.json): a passive
    # wait, unless the user set one. Read once, when torch loads (on the loading thread, after this).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    limits = check_serve_options(model, drafter, host, uds, api_key, allow_remote_without_key, max_body_bytes,
                                 body_timeout, cpu_engine, threads, max_connections, max_queue, header_timeout,
                                 keepalive_timeout)
    sock = bind_socket(host, port, uds)
    app = create_app(model, drafter, device, dtype, max_context, api_key, max_body_bytes=max_body_bytes,
                     body_timeout=body_timeout, limits=limits, cpu_engine=cpu_engine, threads=threads)
    state: ServerState = app.state.reviewer

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            asyncio.get_running_loop().set_exception_handler(count_accept_errors(state.metrics))
            await super().startup(sockets)
            if self.started:
                if uds:
                    where = f"unix:{uds}"
                else:
                    bound = self.servers[0].sockets[0].getsockname() if self.servers else (host, port)
                    where = f"http://{f'[{host}]' if ':' in host else host}:{bound[1]}"  # port 0 -> the real one
                print(f"reviewer serve: listening on {where} (model {model} loading, drafter {drafter}; GET /health "
                      "turns 200 when ready, and a ready line says whether speculation is on and lossless)",
                      flush=True)

        def handle_exit(self, sig, frame):
            # Runs as a signal handler, which the next signal can interrupt: nothing here may take a lock (StopFlag).
            state.stopping.set()  # before uvicorn stops: requests in flight end now, with a final word
            super().handle_exit(sig, frame)

    # timeout_graceful_shutdown is the ceiling; with `stopping` set, requests in flight end well before it. The
    # connection cap and the header deadline live in our h11 protocol (limits.py), not in limit_concurrency.
    config = uvicorn.Config(app, host=host, port=port, uds=uds, log_level="info", access_log=False,
                            timeout_graceful_shutdown=5, http=protocol_factory(state.gate),
                            timeout_keep_alive=limits.keepalive_timeout, backlog=limits.backlog)
    install_log_limits(state.metrics)  # after uvicorn.Config, which sets up uvicorn's log handlers
    server = Server(config)
    state.on_load_failure = lambda: setattr(server, "should_exit", True)
    state.on_ready = lambda st: print(f"reviewer serve: ready: {st.loaded.name} on {st.loaded.device} "
                                      f"({st.loaded.dtype}): {st.decoding}", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown: that is a normal exit here
        pass
    finally:
        if uds and os.path.exists(uds):
            os.unlink(uds)
    if state.load_error:
        print(f"reviewer serve: the model failed to load: {state.load_error}", file=sys.stderr)
        raise SystemExit(1)
