"""The Anthropic-compatible routes: POST /v1/messages (streaming as named SSE events, message_start ... message_stop)
and /v1/messages/count_tokens; errors are Anthropic-style bodies (APIError)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request

from backend import chat
from backend.server.jobs import (ERRORS, SHUTDOWN_MESSAGE, outcome, check_model, collect, event_stream, message_text,
                                 new_id, ready_state, render, sampling_params, select_tools, start_job)
from backend.server.guards import APIError, check_prompt_length, check_text
from backend.server.schemas import CountTokensRequest, MessagesRequest
from backend.server.state import ServerState
from backend.server.worker import Generation

router = APIRouter()


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


@dataclass
class Reply:
    """One /v1/messages request once its job has started: what the whole and the streamed reply are built from."""

    state: ServerState
    generation: Generation
    parser: chat.OutputParser
    id: str
    model: str
    prompt_tokens: int


@dataclass
class OpenBlocks:
    """Where a streamed reply is among its content blocks: the last block's index (-1 before the first) and the
    kind of the block still open (a run of text or reasoning deltas shares one block), None when none is."""

    index: int = -1
    open_kind: str | None = None


def stop_reason(generation: Generation, calls) -> str:
    if calls:
        return "tool_use"
    if generation.stop_string is not None:
        return "stop_sequence"
    return "max_tokens" if generation.finish_reason == "length" else "end_turn"


def usage(generation: Generation) -> dict:
    s = generation.stats
    return {"input_tokens": s.prompt_tokens, "output_tokens": s.generated_tokens,
            "cache_read_input_tokens": s.cached_tokens, "cache_creation_input_tokens": 0}


def sse_event(name: str, data: dict) -> dict:
    return {"event": name, "data": json.dumps({"type": name, **data})}


async def whole_message(request: Request, reply: Reply) -> dict:
    """The reply as one message (stream false): thinking, text and tool_use blocks."""
    generation = reply.generation
    text = await collect(request, generation, reply.state, "messages")
    reasoning, content, calls = chat.merge_events(reply.parser.push(text) + reply.parser.finish())
    blocks = ([{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else [])
    blocks += [{"type": "text", "text": content}] if content or not calls else []
    blocks += [{"type": "tool_use", "id": new_id("toolu_"), "name": c.name, "input": json.loads(c.arguments)}
               for c in calls]
    reply.state.metrics.requests.labels("messages", outcome(generation, calls)).inc()
    return {"id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": blocks,
            "stop_reason": stop_reason(generation, calls), "stop_sequence": generation.stop_string,
            "usage": usage(generation), "timings": generation.timings()}


def block_events(blocks: OpenBlocks, e: chat.Event):
    """The SSE events for one parser event: a tool call is a whole block of its own; text and reasoning deltas go
    into the open block of their kind, closing the other kind's first."""
    if blocks.open_kind is not None and (e.kind == "tool_call" or e.kind != blocks.open_kind):
        yield sse_event("content_block_stop", {"index": blocks.index})
        blocks.open_kind = None
    if e.kind == "tool_call":
        blocks.index += 1
        block = {"type": "tool_use", "id": new_id("toolu_"), "name": e.tool_call.name, "input": {}}
        yield sse_event("content_block_start", {"index": blocks.index, "content_block": block})
        yield sse_event("content_block_delta", {"index": blocks.index, "delta": {
            "type": "input_json_delta", "partial_json": e.tool_call.arguments}})
        yield sse_event("content_block_stop", {"index": blocks.index})
        return
    if blocks.open_kind is None:
        blocks.index, blocks.open_kind = blocks.index + 1, e.kind
        block = ({"type": "thinking", "thinking": "", "signature": ""} if e.kind == "reasoning"
                 else {"type": "text", "text": ""})
        yield sse_event("content_block_start", {"index": blocks.index, "content_block": block})
    delta = ({"type": "thinking_delta", "thinking": e.text} if e.kind == "reasoning"
             else {"type": "text_delta", "text": e.text})
    yield sse_event("content_block_delta", {"index": blocks.index, "delta": delta})


async def message_events(reply: Reply):
    """The reply as Anthropic's named SSE events, message_start ... message_stop; a failure mid-stream is an error
    event (the status line is already sent)."""
    generation, parser, blocks = reply.generation, reply.parser, OpenBlocks()
    yield sse_event("message_start", {"message": {
        "id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0}}})
    try:
        async for text in generation.deltas():
            for e in parser.push(text):
                for item in block_events(blocks, e):
                    yield item
        for e in parser.finish():
            for item in block_events(blocks, e):
                yield item
    except Exception as exc:
        generation.failed = True
        reply.state.metrics.requests.labels("messages", "error").inc()
        yield sse_event("error", {"error": {"type": "api_error", "message": f"generation failed: {exc}"}})
        return
    if blocks.open_kind is not None:
        yield sse_event("content_block_stop", {"index": blocks.index})
    if blocks.index < 0:  # an empty answer is still one (empty) text block, as the API always returns content
        yield sse_event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        yield sse_event("content_block_stop", {"index": 0})
    reply.state.metrics.requests.labels("messages", outcome(generation, parser.tool_calls)).inc()
    yield sse_event("message_delta", {"delta": {"stop_reason": stop_reason(generation, parser.tool_calls),
                                                "stop_sequence": generation.stop_string},
                                      "usage": {"output_tokens": generation.stats.generated_tokens},
                                      "timings": generation.timings()})
    yield sse_event("message_stop", {})


@router.post("/v1/messages", tags=["anthropic"], responses=ERRORS)
async def messages_endpoint(request: Request, body: MessagesRequest, state: ServerState = Depends(ready_state)):
    check_model(state, body.model)
    check_text(body)
    messages, tools = anthropic_conversation(body)
    await check_prompt_length(state, (m["content"] for m in messages), "messages")
    tools = select_tools(tools, anthropic_tool_choice(body))
    thinking_off = body.thinking is not None and body.thinking.type == "disabled"
    prompt_text, prompt_ids = await render(state, messages, tools, {"enable_thinking": False} if thinking_off else None)
    params = sampling_params(state, len(prompt_ids), body.max_tokens, body.temperature, body.top_p, None)
    generation = Generation(await start_job(state, request, prompt_ids, params, body.stop_sequences))
    reply = Reply(state=state, generation=generation,
                  parser=chat.OutputParser(tools, in_reasoning=chat.starts_in_reasoning(prompt_text)),
                  id=new_id("msg_"), model=state.loaded.name, prompt_tokens=len(prompt_ids))
    if not body.stream:
        return await whole_message(request, reply)
    return event_stream(message_events(reply), generation, state.metrics, "messages", sse_event("error", {"error": {
        "type": "overloaded_error", "message": SHUTDOWN_MESSAGE}}))


@router.post("/v1/messages/count_tokens", tags=["anthropic"], responses=ERRORS)
async def count_tokens(body: CountTokensRequest, state: ServerState = Depends(ready_state)):
    check_model(state, body.model)
    check_text(body)
    messages, tools = anthropic_conversation(body)
    _, prompt_ids = await render(state, messages, tools)
    return {"input_tokens": len(prompt_ids)}
