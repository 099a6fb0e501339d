"""The inference server: assembles the app (backend/api.py routes, health, metrics, API key, error bodies), loads the
model in the background, and runs uvicorn (`serve`).

Data flow for a request: route (api.py) -> render the prompt (chat.py) -> Job into the FIFO -> the engine thread
(worker.py) runs Engine.generate and hands token ids back through the event loop -> Generation turns ids into text ->
the route shapes text into OpenAI chunks / Anthropic events / JSON bodies.

One engine, batch 1, by design: requests wait in FIFO order; a request that waits longer than `queue_timeout` gets a 503
with a clear message; a client that disconnects (or a stop string that matches) cancels its generation at once. The
model loads on a background thread after the socket is up: /health says 503 until it is ready.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import sys
import threading
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend import chat
from backend.api import APIError, error_response, router
from backend.loading import LoadedModel, ModelLoadError, check_model_spec, load_model
from backend.metrics import Metrics
from backend.worker import EngineWorker

log = logging.getLogger("reviewer.backend")

DEFAULT_QUEUE_TIMEOUT = float(os.environ.get("REVIEWER_QUEUE_TIMEOUT", "600"))


# ---- server state ----------------------------------------------------------------------------------------------------

class ServerState:
    """What the routes need: settings, metrics, and (once loading finished) the model and the engine worker."""

    def __init__(self, model, drafter: str, device: str, dtype: str, max_context: int | None, api_key: str | None,
                 queue_timeout: float):
        self.model_spec, self.drafter_spec = model, drafter
        self.device, self.dtype, self.max_context_arg = device, dtype, max_context
        self.api_key, self.queue_timeout = api_key, queue_timeout
        self.metrics = Metrics()
        self.loaded: LoadedModel | None = None
        self.worker: EngineWorker | None = None
        self.load_error: str | None = None
        self.on_load_failure = None  # serve() sets this to stop uvicorn
        self.ready = threading.Event()
        # Filled in by load(): what the routes need to render prompts and check requests.
        self.tool_style = "injected"
        self.stop_ids: tuple[int, ...] = ()
        self.vocab_size = 0
        self.decoding = ""  # plain or speculative, lossless or not (Engine.describe_decoding), once loaded
        self.on_ready = None  # called with the state once the model is ready (serve prints the ready line)

    # -- loading (background thread) --
    def load(self) -> None:
        try:
            from backend.engine import Engine, SamplingParams

            loaded = self.model_spec if isinstance(self.model_spec, LoadedModel) else load_model(
                self.model_spec, self.device, self.dtype, self.max_context_arg)
            drafter = resolve_drafter(self.drafter_spec, loaded)
            engine = Engine(loaded.model, drafter=drafter, max_context=loaded.max_context)
            if engine.fast and engine.device.type == "cuda":
                # the fast path compiles its glue and captures CUDA graphs on first use: do it now, while /health
                # says "loading", not inside the first request
                log.info("warming up the fast path (torch.compile + CUDA graphs; up to a minute)")
                list(engine.generate([0] * 8, SamplingParams(max_tokens=4)))
            self.loaded, self.tool_style = loaded, chat.tool_style(loaded.tokenizer)
            self.stop_ids = chat.stop_token_ids(loaded.tokenizer, getattr(loaded.model, "generation_config", None))
            self.vocab_size = loaded.model.get_input_embeddings().weight.shape[0]
            self.worker = EngineWorker(engine, self.metrics)
            self.metrics.model_ready.set(1)
            self.ready.set()
            self.decoding = engine.describe_decoding()
            log.info("model %s ready on %s (%s, context %d tokens): %s", loaded.name, loaded.device,
                     loaded.dtype, loaded.max_context, self.decoding)
            if self.on_ready:
                self.on_ready(self)
        except Exception as exc:  # noqa: BLE001 - any failure must reach /health and the operator, not kill a thread silently
            self.load_error = str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, ModelLoadError):
                log.exception("model loading failed")
            log.error("model loading failed: %s", self.load_error)
            if self.on_load_failure:
                self.on_load_failure()

    @property
    def model_ids(self) -> set[str]:
        """Names a request may use for the loaded model: its id and whatever --model said."""
        ids = {self.loaded.name}
        if isinstance(self.model_spec, str):
            ids.add(self.model_spec)
        return ids


def resolve_drafter(spec: str | None, loaded: LoadedModel):
    """--drafter auto|none|PATH -> a drafter object or None."""
    if spec in (None, "", "none"):
        return None
    try:
        from backend import dflash
    except ModuleNotFoundError as exc:
        if exc.name != "backend.dflash":
            raise
        if spec == "auto":
            log.info("speculative decoding is not available in this build: plain decoding")
            return None
        raise ModelLoadError(f"--drafter {spec}: this build has no DFlash support (backend/dflash.py)") from None
    if spec == "auto":
        spec = dflash.find_shipped_drafter(loaded.name)
        if spec is None:
            log.info("no shipped drafter for %s: plain decoding", loaded.name)
            return None
    try:
        return dflash.load_drafter(spec)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the drafter {spec}: {exc}") from exc


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
               queue_timeout: float = DEFAULT_QUEUE_TIMEOUT) -> FastAPI:
    """The ASGI app. The model loads on a background thread once the app starts (lifespan), so the socket answers
    /health (503) at once. `model` may also be an already loaded LoadedModel (tests)."""
    state = ServerState(model, drafter, device, dtype, max_context, api_key, queue_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, name="reviewer-loader", daemon=True).start()
        yield
        if state.worker:
            state.worker.stop()

    # The schema route is our own (below) so that --api-key covers it too.
    app = FastAPI(title="reviewer inference server", version="1", lifespan=lifespan,
                  openapi_url=None, docs_url=None, redoc_url=None)
    app.state.reviewer = state
    keyed = [Depends(check_api_key)]

    @app.get("/health", tags=["server"], responses={503: {"description": "loading or failed"}})
    def health():
        if state.load_error:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
        if not state.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok", "model": state.loaded.name, "max_context": state.loaded.max_context}

    @app.get("/metrics", tags=["server"], dependencies=keyed)
    def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    app.include_router(router, dependencies=keyed)

    @app.get("/openapi.json", include_in_schema=False, dependencies=keyed)
    def openapi():
        return app.openapi()

    routes = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages"}

    def count_refusal(request: Request, outcome: str) -> None:
        if request.url.path in routes:
            state.metrics.requests.labels(routes[request.url.path], outcome).inc()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        count_refusal(request, {"queue_timeout": "timeout"}.get(exc.code, "cancelled" if exc.status == 499 else
                                                                     "rejected" if exc.status < 500 else "error"))
        headers = {"Retry-After": "5"} if exc.status == 503 else None
        return error_response(request, exc.status, exc.message, exc.code, exc.param, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        # OpenAI answers malformed requests with 400 (not FastAPI's 422); so do we, on every route.
        count_refusal(request, "rejected")
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        message = f"{where}: {first['msg']}" if where else first["msg"]
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problems)"
        return error_response(request, 400, message, code="invalid_request", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(request, exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}")

    return app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(model: str, drafter: str, host: str, port: int, uds: str | None, device: str, dtype: str,
          max_context: int | None, api_key: str | None = None, allow_remote_without_key: bool = False) -> None:
    """Run the server until interrupted (blocking). Prints one "listening on ..." line once the socket is up; the
    model then loads in the background (GET /health: 503 until ready). Exits with status 1 if loading fails."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
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
    app = create_app(model, drafter, device, dtype, max_context, api_key)
    state: ServerState = app.state.reviewer

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
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

    config = uvicorn.Config(app, host=host, port=port, uds=uds, log_level="info", access_log=False,
                            timeout_graceful_shutdown=5)
    server = Server(config)
    state.on_load_failure = lambda: setattr(server, "should_exit", True)
    state.on_ready = lambda st: print(f"reviewer serve: ready: {st.loaded.name} on {st.loaded.device} "
                                      f"({st.loaded.dtype}): {st.decoding}", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown: that is a normal exit here
        pass
    if state.load_error:
        print(f"reviewer serve: the model failed to load: {state.load_error}", file=sys.stderr)
        raise SystemExit(1)

