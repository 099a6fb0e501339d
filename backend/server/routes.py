"""The OpenAI- and Anthropic-compatible endpoints: request -> prompt -> queued Job -> text -> API-shaped response.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (OpenAI); POST /v1/messages and
/v1/messages/count_tokens (Anthropic). Streaming is SSE: data-only chunks ending in `data: [DONE]` for OpenAI, named
events (message_start ... message_stop) for Anthropic. Errors are APIError, rendered in the style of the route.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import anyio
from fastapi import APIRouter, Depends, Request
from sse_starlette.sse import EventSourceResponse

from backend import chat
from backend.server.guards import APIError, check_prompt_length, check_text, off_loop
from backend.server.metrics import Metrics
from backend.server.schemas import ChatCompletionRequest, CompletionRequest, CountTokensRequest, MessagesRequest
from backend.server.state import ServerState
from backend.server.worker import Generation, Job

router = APIRouter()
ERRORS = {400: {"description": "bad request (OpenAI- or Anthropic-style error body)"},
          401: {"description": "missing or wrong API key"}, 404: {"description": "unknown model"},
          408: {"description": "the request body did not arrive in time"},
          413: {"description": "the request body is larger than the server accepts"},
          503: {"description": "model loading, the queue wait timed out, or the server is shutting down"}}
SHUTDOWN_MESSAGE = "the server is shutting down; this answer is incomplete, send the request again"
SHUTDOWN_GRACE = 2.0  # seconds a stream gets after SIGTERM to send its final event, before sse-starlette cuts it


# ---- request plumbing --------------------------------------------------------------------------------------------------

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
        stop_token_ids=state.stop_ids,
    )


async def start_job(state: ServerState, request: Request, prompt_ids: list[int], params) -> Job:
    """Queue a job and wait (FIFO) until the engine starts it; 503 after queue_timeout, cancelled if the client leaves."""
    job = Job(prompt_ids=prompt_ids, params=params, loop=asyncio.get_running_loop())
    state.worker.submit(job)
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


# ---- OpenAI ----------------------------------------------------------------------------------------------------------

@router.get("/v1/models", tags=["openai"], responses=ERRORS)
def models(state: ServerState = Depends(ready_state)):
    loaded = state.loaded
    return {"object": "list", "data": [{
        "id": loaded.name, "object": "model", "created": 0, "owned_by": "reviewer",
        "max_context": loaded.max_context, "context_length": loaded.max_context,  # clients size their prompts by it
        "device": loaded.device, "dtype": loaded.dtype,
    }]}


def openai_messages(body: ChatCompletionRequest) -> list[dict]:
    out = []
    for m in body.messages:
        message = {"role": "system" if m.role == "developer" else m.role, "content": message_text(m.content)}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id or new_id("call_"), "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in m.tool_calls]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id or ""
            if m.name:
                message["name"] = m.name
        if m.reasoning_content:
            message["reasoning_content"] = m.reasoning_content
        out.append(message)
    return out


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


async def render(state: ServerState, messages: list[dict], tools: list[dict] | None,
                 template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    try:
        return await off_loop(state, chat.render_chat, state.loaded.tokenizer, messages, tools, state.tool_style,
                              template_kwargs)
    except chat.ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None


def _finish(generation: Generation, calls) -> str:
    return "tool_calls" if calls else ("length" if generation.finish_reason == "length" else "stop")


def _usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def _outcome(generation: Generation, calls=()) -> str:
    return "tool_calls" if calls else generation.finish_reason


@router.post("/v1/chat/completions", tags=["openai"], responses=ERRORS)
async def chat_completions(request: Request, body: ChatCompletionRequest, state: ServerState = Depends(ready_state)):
    check_model(state, body.model)
    check_text(body)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice.function.name if hasattr(body.tool_choice, "function") else body.tool_choice
    tools = select_tools(tools, choice)
    check_prompt_length(state, (message_text(m.content) for m in body.messages), "messages")
    prompt_text, prompt_ids = await render(state, openai_messages(body), tools, body.chat_template_kwargs)
    params = sampling_params(state, len(prompt_ids), body.max_completion_tokens or body.max_tokens,
                             body.temperature, body.top_p, body.seed)
    stops = [body.stop] if isinstance(body.stop, str) else body.stop
    job = await start_job(state, request, prompt_ids, params)
    generation = Generation(job, state.loaded.tokenizer, stops)
    parser = chat.OutputParser(tools, in_reasoning=chat.starts_in_reasoning(prompt_text))
    cid, created, model = new_id("chatcmpl-"), int(time.time()), state.loaded.name

    def chunk(delta: dict, finish=None, **extra) -> dict:
        return {"data": json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})}

    if not body.stream:
        text = await collect(request, generation, state, "chat")
        reasoning, content, calls = chat.merge_events(parser.push(text) + parser.finish())
        message = {"role": "assistant", "content": content if (content or not calls) else None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [{"id": new_id("call_"), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        state.metrics.requests.labels("chat", _outcome(generation, calls)).inc()
        return {"id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": _finish(generation, calls)}],
                "usage": _usage(generation.stats), "timings": generation.timings()}

    async def stream():
        calls = 0
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for text in generation.deltas():
                for event in parser.push(text):
                    for item in openai_delta(chunk, event, calls):
                        yield item
                    calls += event.kind == "tool_call"
            for event in parser.finish():
                for item in openai_delta(chunk, event, calls):
                    yield item
                calls += event.kind == "tool_call"
        except Exception as exc:  # mid-stream failure: the status line is already sent, so say it in the stream
            generation.failed = True
            state.metrics.requests.labels("chat", "error").inc()
            yield {"data": json.dumps({"error": {"message": f"generation failed: {exc}", "type": "server_error"}})}
            return
        state.metrics.requests.labels("chat", _outcome(generation, parser.tool_calls)).inc()
        yield chunk({}, _finish(generation, parser.tool_calls), timings=generation.timings())
        if body.stream_options and body.stream_options.include_usage:
            yield {"data": json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                       "choices": [], "usage": _usage(generation.stats)})}
        yield {"data": "[DONE]"}

    return event_stream(stream(), generation, state.metrics, "chat", {"data": json.dumps(
        {"error": {"message": SHUTDOWN_MESSAGE, "type": "server_error", "code": "server_shutdown"}})})


def openai_delta(chunk, event: chat.Event, index: int):
    """Chunks for one parser event. A tool call goes out as OpenAI streams them: a first delta with its index, id,
    type and name, then its arguments."""
    if event.kind == "content":
        yield chunk({"content": event.text})
    elif event.kind == "reasoning":
        yield chunk({"reasoning_content": event.text})
    else:
        call = event.tool_call
        yield chunk({"tool_calls": [{"index": index, "id": new_id("call_"), "type": "function",
                                     "function": {"name": call.name, "arguments": ""}}]})
        yield chunk({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})


@router.post("/v1/completions", tags=["openai"], responses=ERRORS)
async def completions(request: Request, body: CompletionRequest, state: ServerState = Depends(ready_state)):
    check_model(state, body.model)
    check_text(body)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported (batch 1)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_prompt_length(state, [prompt], "prompt")
        prompt_ids = (await off_loop(state, state.loaded.tokenizer, prompt))["input_ids"]
    else:
        prompt_ids = list(prompt)
        if any(not 0 <= t < state.vocab_size for t in prompt_ids):
            raise APIError(400, f"prompt token ids must lie in [0, {state.vocab_size})", param="prompt")
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    params = sampling_params(state, len(prompt_ids), body.max_tokens, body.temperature, body.top_p, body.seed,
                             prompt_field="prompt")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop
    job = await start_job(state, request, prompt_ids, params)
    generation = Generation(job, state.loaded.tokenizer, stops)
    cid, created, model = new_id("cmpl-"), int(time.time()), state.loaded.name
    echo = (prompt if isinstance(prompt, str) else state.loaded.tokenizer.decode(prompt_ids)) if body.echo else ""

    def chunk(text: str, finish=None, **extra) -> dict:
        return {"data": json.dumps({"id": cid, "object": "text_completion", "created": created, "model": model,
                                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                                    **extra})}

    def finish() -> str:
        return "length" if generation.finish_reason == "length" else "stop"

    if not body.stream:
        text = await collect(request, generation, state, "completions")
        state.metrics.requests.labels("completions", generation.finish_reason).inc()
        return {"id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": echo + text, "logprobs": None, "finish_reason": finish()}],
                "usage": _usage(generation.stats), "timings": generation.timings()}

    async def stream():
        try:
            if echo:
                yield chunk(echo)
            async for text in generation.deltas():
                yield chunk(text)
        except Exception as exc:
            generation.failed = True
            state.metrics.requests.labels("completions", "error").inc()
            yield {"data": json.dumps({"error": {"message": f"generation failed: {exc}", "type": "server_error"}})}
            return
        state.metrics.requests.labels("completions", generation.finish_reason).inc()
        yield chunk("", finish(), timings=generation.timings())
        if body.stream_options and body.stream_options.include_usage:
            yield {"data": json.dumps({"id": cid, "object": "text_completion", "created": created, "model": model,
                                       "choices": [], "usage": _usage(generation.stats)})}
        yield {"data": "[DONE]"}

    return event_stream(stream(), generation, state.metrics, "completions", {"data": json.dumps(
        {"error": {"message": SHUTDOWN_MESSAGE, "type": "server_error", "code": "server_shutdown"}})})


# ---- Anthropic -------------------------------------------------------------------------------------------------------

def anthropic_conversation(body) -> tuple[list[dict], list[dict] | None]:
    """Anthropic messages/tools -> the OpenAI-shaped messages/tools that chat.render_chat takes."""
    messages = []
    if body.system:
        messages.append({"role": "system", "content": message_text(body.system)})
    for m in body.messages:
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        texts, calls, reasoning = [], [], ""
        for block in m.content:
            if block.type == "text":
                texts.append(block.text)
            elif block.type == "thinking":
                reasoning += block.thinking
            elif block.type == "tool_use":
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            elif block.type == "tool_result":  # results come back as tool turns, before the user's own words
                result = message_text(block.content)
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": f"Error: {result}" if block.is_error else result})
        if m.role == "assistant":
            message = {"role": "assistant", "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning_content"] = reasoning
            messages.append(message)
        elif texts or not any(b.type == "tool_result" for b in m.content):
            messages.append({"role": "user", "content": "".join(texts)})
    tools = None
    if body.tools:
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in body.tools]
    return messages, tools


def anthropic_tool_choice(body) -> str | None:
    choice = body.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice of type 'tool' needs a name", param="tool_choice")
        return choice.name
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


@router.post("/v1/messages", tags=["anthropic"], responses=ERRORS)
async def messages_endpoint(request: Request, body: MessagesRequest, state: ServerState = Depends(ready_state)):
    check_model(state, body.model)
    check_text(body)
    messages, tools = anthropic_conversation(body)
    check_prompt_length(state, (m["content"] for m in messages), "messages")
    tools = select_tools(tools, anthropic_tool_choice(body))
    thinking_off = body.thinking is not None and body.thinking.type == "disabled"
    prompt_text, prompt_ids = await render(state, messages, tools, {"enable_thinking": False} if thinking_off else None)
    params = sampling_params(state, len(prompt_ids), body.max_tokens, body.temperature, body.top_p, None)
    job = await start_job(state, request, prompt_ids, params)
    generation = Generation(job, state.loaded.tokenizer, body.stop_sequences)
    parser = chat.OutputParser(tools, in_reasoning=chat.starts_in_reasoning(prompt_text))
    mid, model = new_id("msg_"), state.loaded.name

    def stop_reason(calls) -> str:
        if calls:
            return "tool_use"
        if generation.stops.matched is not None:
            return "stop_sequence"
        return "max_tokens" if generation.finish_reason == "length" else "end_turn"

    def usage() -> dict:
        s = generation.stats
        return {"input_tokens": s.prompt_tokens, "output_tokens": s.generated_tokens,
                "cache_read_input_tokens": s.cached_tokens, "cache_creation_input_tokens": 0}

    if not body.stream:
        text = await collect(request, generation, state, "messages")
        reasoning, content, calls = chat.merge_events(parser.push(text) + parser.finish())
        blocks = ([{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else [])
        blocks += [{"type": "text", "text": content}] if content or not calls else []
        blocks += [{"type": "tool_use", "id": new_id("toolu_"), "name": c.name, "input": json.loads(c.arguments)}
                   for c in calls]
        state.metrics.requests.labels("messages", _outcome(generation, calls)).inc()
        return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
                "stop_reason": stop_reason(calls), "stop_sequence": generation.stops.matched, "usage": usage(),
                "timings": generation.timings()}

    def event(name: str, data: dict) -> dict:
        return {"event": name, "data": json.dumps({"type": name, **data})}

    async def stream():
        index, open_kind = -1, None
        yield event("message_start", {"message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": len(prompt_ids), "output_tokens": 0}}})

        def blocks_for(e: chat.Event):
            nonlocal index, open_kind
            if open_kind is not None and (e.kind == "tool_call" or e.kind != open_kind):
                yield event("content_block_stop", {"index": index})
                open_kind = None
            if e.kind == "tool_call":
                index += 1
                block = {"type": "tool_use", "id": new_id("toolu_"), "name": e.tool_call.name, "input": {}}
                yield event("content_block_start", {"index": index, "content_block": block})
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": e.tool_call.arguments}})
                yield event("content_block_stop", {"index": index})
                return
            if open_kind is None:
                index, open_kind = index + 1, e.kind
                block = ({"type": "thinking", "thinking": "", "signature": ""} if e.kind == "reasoning"
                         else {"type": "text", "text": ""})
                yield event("content_block_start", {"index": index, "content_block": block})
            delta = ({"type": "thinking_delta", "thinking": e.text} if e.kind == "reasoning"
                     else {"type": "text_delta", "text": e.text})
            yield event("content_block_delta", {"index": index, "delta": delta})

        try:
            async for text in generation.deltas():
                for e in parser.push(text):
                    for item in blocks_for(e):
                        yield item
            for e in parser.finish():
                for item in blocks_for(e):
                    yield item
        except Exception as exc:
            generation.failed = True
            state.metrics.requests.labels("messages", "error").inc()
            yield event("error", {"error": {"type": "api_error", "message": f"generation failed: {exc}"}})
            return
        if open_kind is not None:
            yield event("content_block_stop", {"index": index})
        if index < 0:  # an empty answer is still one (empty) text block, as the API always returns content
            yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            yield event("content_block_stop", {"index": 0})
        state.metrics.requests.labels("messages", _outcome(generation, parser.tool_calls)).inc()
        yield event("message_delta", {"delta": {"stop_reason": stop_reason(parser.tool_calls),
                                                "stop_sequence": generation.stops.matched},
                                      "usage": {"output_tokens": generation.stats.generated_tokens},
                                      "timings": generation.timings()})
        yield event("message_stop", {})

    return event_stream(stream(), generation, state.metrics, "messages", event("error", {"error": {
        "type": "overloaded_error", "message": SHUTDOWN_MESSAGE}}))


@router.post("/v1/messages/count_tokens", tags=["anthropic"], responses=ERRORS)
async def count_tokens(body: CountTokensRequest, state: ServerState = Depends(ready_state)):
    check_model(state, body.model)
    check_text(body)
    messages, tools = anthropic_conversation(body)
    _, prompt_ids = await render(state, messages, tools)
    return {"input_tokens": len(prompt_ids)}

