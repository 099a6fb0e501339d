"""What every API route shares, from a request to a queued Job and back: the ready check, the model name check,
sampling parameters within the window, rendering the conversation off the event loop, tool_choice, queueing (503
while stopping or after the queue timeout), the disconnect watch, collecting text, and the SSE stream with its
farewell on shutdown. openai_routes.py and anthropic_routes.py shape requests and answers in their APIs' forms."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid

import anyio
from fastapi import Request
from sse_starlette.sse import EventSourceResponse

from backend import chat
from backend.server.guards import APIError, off_loop
from backend.server.metrics import Metrics
from backend.server.state import ServerState
from backend.server.stops import StopPolicy
from backend.server.worker import Generation, Job

ERRORS = {400: {"description": "bad request (OpenAI- or Anthropic-style error body)"},
          401: {"description": "missing or wrong API key"}, 404: {"description": "unknown model"},
          408: {"description": "the request body did not arrive in time"},
          413: {"description": "the request body is larger than the server accepts"},
          503: {"description": "model loading, the queue is full or its wait timed out, the connection cap is "
                                "reached, or the server is shutting down (with Retry-After)"}}
SHUTDOWN_MESSAGE = "the server is shutting down; this answer is incomplete, send the request again"
SHUTDOWN_GRACE = 2.0  # seconds a stream gets after SIGTERM to send its final event, before sse-starlette cuts it


def ready_state(request: Request) -> ServerState:
    """Dependency: the server state once the model is ready; a 503 while it loads or after it failed."""
    state = request.app.state.reviewer
    if state.load_error:
        raise APIError(503, f"the model failed to load: {state.load_error}", code="model_load_failed")
    if not state.ready.is_set():
        raise APIError(503, "the model is still loading; retry when GET /health returns 200", code="model_loading")
    return state


def check_model(state: ServerState, name: str) -> None:
    if name not in state.model_ids:
        raise APIError(404, f"model {name!r} is not served here; this server serves {state.loaded.name!r}",
                       code="model_not_found", param="model")


def sampling_params(state: ServerState, prompt_len: int, max_tokens: int | None, temperature, top_p, seed,
                    prompt_field: str = "messages"):
    from backend.decoding.engine import SamplingParams  # here, not at the top: the server binds before torch loads

    window = state.loaded.max_context
    if prompt_len >= window:
        raise APIError(400, f"the prompt has {prompt_len} tokens but the context window holds {window}; shorten it",
                       code="context_length_exceeded", param=prompt_field)
    if max_tokens is not None and max_tokens > window:
        raise APIError(400, f"max_tokens is {max_tokens} but the context window holds {window} tokens",
                       code="invalid_value", param="max_tokens")
    room = window - prompt_len  # a request for more than fits stops with finish_reason "length"
    temperature = 1.0 if temperature is None else float(temperature)  # None: the APIs' documented default
    top_p = 1.0 if top_p is None else float(top_p)
    # A temperature this close to 0, or a nucleus this small, picks the top token anyway: decode greedily, because
    # dividing logits by 4e-47 overflows and a top_p of 2e-308 rounds to 0 in float32 (both found by schemathesis).
    if temperature < 1e-4 or top_p < 1e-6:
        temperature, top_p = 0.0, 1.0
    return SamplingParams(
        max_tokens=min(max_tokens or room, room),
        temperature=temperature,
        top_p=top_p,
        seed=None if seed is None else seed % 2**63,
    )  # stop ids: start_job sets them from the request's StopPolicy


async def start_job(state: ServerState, request: Request, prompt_ids: list[int], params,
                    stops: str | list[str] | None) -> Job:
    """Queue a job and wait (FIFO) until the engine starts it; 503 after queue_timeout, cancelled if the client leaves.
    Its stop policy: the model's stop ids and the request's stop strings (`stops`), applied by the worker."""
    if state.waiting >= state.limits.max_queue:
        raise APIError(503, f"the server is busy: {state.waiting} requests are already waiting for the engine, the "
                            f"most it queues (--max-queue); retry later", code="queue_full")
    stop = StopPolicy.of(state.stop_ids, stops)
    job = Job(prompt_ids=prompt_ids, params=dataclasses.replace(params, stop_token_ids=stop.ids), stop=stop,
              tokenizer=state.loaded.tokenizer, loop=asyncio.get_running_loop())
    state.worker.submit(job)
    state.waiting += 1
    try:
        return await wait_for_start(state, request, job)
    finally:
        state.waiting -= 1


async def wait_for_start(state: ServerState, request: Request, job: Job) -> Job:
    deadline = time.monotonic() + state.queue_timeout
    while not job.started.is_set():
        try:
            await asyncio.wait_for(job.started.wait(), timeout=min(0.25, max(deadline - time.monotonic(), 0.01)))
        except asyncio.TimeoutError:
            pass
        if job.started.is_set():
            break
        if await request.is_disconnected():
            job.cancelled = True
            raise APIError(499, "client disconnected while waiting")
        if state.stopping.is_set():
            job.cancelled = True
            raise APIError(503, SHUTDOWN_MESSAGE, code="server_shutdown")
        if time.monotonic() >= deadline:
            job.cancelled = True
            raise APIError(503, f"the server is busy: this request waited {state.queue_timeout:g} s for the engine, "
                                "which serves one request at a time; retry later", code="queue_timeout")
    if state.stopping.is_set():  # the engine took it up just as the server began to stop: a 503 all the same, not a
        job.cancelled = True     # short answer that wins the race against the shutdown
        raise APIError(503, SHUTDOWN_MESSAGE, code="server_shutdown")
    return job


async def watch_disconnect(request: Request, job: Job, state: ServerState) -> None:
    while not job.cancelled:
        await asyncio.sleep(0.2)
        if await request.is_disconnected() or state.stopping.is_set():
            job.cancelled = True


async def collect(request: Request, generation: Generation, state: ServerState, route: str) -> str:
    """Non-streamed: gather all text, cancelling the generation if the client disconnects or the server stops
    meanwhile (a 503 then). An engine failure is counted on the route and answered as a 500 with the reason."""
    watcher = asyncio.create_task(watch_disconnect(request, generation.job, state))
    try:
        text = "".join([delta async for delta in generation.deltas()])
    except Exception as exc:
        state.metrics.requests.labels(route, "error").inc()
        raise APIError(500, f"generation failed: {exc}") from None
    finally:
        watcher.cancel()
    if state.stopping.is_set() and generation.finish_reason == "cancelled":
        raise APIError(503, SHUTDOWN_MESSAGE, code="server_shutdown")
    return text


def event_stream(events, generation: Generation, metrics: Metrics, route: str, farewell: dict) -> EventSourceResponse:
    """SSE response over `events`; a client that goes away cancels the generation at once. When the server shuts
    down (sse-starlette sets `shutdown`), the generation is cancelled and `farewell` (an error chunk or event) is the
    stream's last item, so a client knows the answer was cut short."""
    shutdown = anyio.Event()

    async def guarded():
        stop = asyncio.ensure_future(shutdown.wait())
        source, step = events.__aiter__(), None
        try:
            while True:
                step = asyncio.ensure_future(source.__anext__())
                await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # shutting down: stop waiting for the engine, say so, end
                    step.cancel()
                    with contextlib.suppress(BaseException):
                        await step
                    generation.job.cancelled = True
                    metrics.requests.labels(route, "cancelled").inc()
                    yield farewell
                    return
                try:
                    yield step.result()
                except StopAsyncIteration:
                    return
        finally:
            stop.cancel()
            if step is not None and not step.done():  # the client left (sse-starlette cancelled us): stop the route
                step.cancel()
            if generation.stats is None and not shutdown.is_set():  # not finished: the client left (or it failed)
                generation.job.cancelled = True
                if not generation.failed:
                    metrics.requests.labels(route, "cancelled").inc()

    async def closed(_message) -> None:
        generation.job.cancelled = True

    return EventSourceResponse(guarded(), ping=15, sep="\n", client_close_handler_callable=closed,
                               shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_GRACE)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def message_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


async def render(state: ServerState, messages: list[dict], tools: list[dict] | None,
                 template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    try:
        return await off_loop(state, chat.render_chat, state.loaded.tokenizer, messages, tools, state.tool_style,
                              template_kwargs)
    except chat.ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None


def select_tools(tools: list[dict] | None, choice: str | None) -> list[dict] | None:
    """Apply tool_choice: "none" hides the tools; a named choice offers only that one. ("required" cannot be forced
    without constrained decoding: the tools are offered as with "auto".)"""
    if choice in (None, "auto"):
        return tools
    if choice == "none":
        return None
    if not tools:
        raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice == "required":
        return tools
    picked = [t for t in tools if t["function"]["name"] == choice]
    if not picked:
        raise APIError(400, f"tool_choice names {choice!r}, which is not among the tools", param="tool_choice")
    return picked


def outcome(generation: Generation, calls=()) -> str:
    return "tool_calls" if calls else generation.finish_reason
