"""The OpenAI-compatible routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions. Streaming is SSE,
data-only chunks ending in `data: [DONE]`; errors are OpenAI-style bodies (APIError)."""
from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request

from backend import chat
from backend.server.jobs import (ERRORS, SHUTDOWN_MESSAGE, outcome, check_model, collect, event_stream, message_text,
                                 new_id, ready_state, render, sampling_params, select_tools, start_job)
from backend.server.guards import APIError, check_prompt_length, check_text, off_loop
from backend.server.schemas import ChatCompletionRequest, CompletionRequest
from backend.server.state import ServerState
from backend.server.worker import Generation

router = APIRouter()


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


def _finish(generation: Generation, calls) -> str:
    return "tool_calls" if calls else ("length" if generation.finish_reason == "length" else "stop")


def _usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


@router.post("/v1/chat/completions", tags=["openai"], responses=ERRORS)
async def chat_completions(request: Request, body: ChatCompletionRequest, state: ServerState = Depends(ready_state)):
    check_model(state, body.model)
    check_text(body)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice.function.name if hasattr(body.tool_choice, "function") else body.tool_choice
    tools = select_tools(tools, choice)
    await check_prompt_length(state, (message_text(m.content) for m in body.messages), "messages")
    prompt_text, prompt_ids = await render(state, openai_messages(body), tools, body.chat_template_kwargs)
    params = sampling_params(state, len(prompt_ids), body.max_completion_tokens or body.max_tokens,
                             body.temperature, body.top_p, body.seed)
    generation = Generation(await start_job(state, request, prompt_ids, params, body.stop))
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
        state.metrics.requests.labels("chat", outcome(generation, calls)).inc()
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
        state.metrics.requests.labels("chat", outcome(generation, parser.tool_calls)).inc()
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
        await check_prompt_length(state, [prompt], "prompt")
        prompt_ids = (await off_loop(state, state.loaded.tokenizer, prompt))["input_ids"]
    else:
        prompt_ids = list(prompt)
        if any(not 0 <= t < state.vocab_size for t in prompt_ids):
            raise APIError(400, f"prompt token ids must lie in [0, {state.vocab_size})", param="prompt")
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    params = sampling_params(state, len(prompt_ids), body.max_tokens, body.temperature, body.top_p, body.seed,
                             prompt_field="prompt")
    generation = Generation(await start_job(state, request, prompt_ids, params, body.stop))
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
