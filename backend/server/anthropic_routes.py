"""The Anthropic-compatible routes: POST /v1/messages (streaming as named SSE events, message_start ... message_stop)
and /v1/messages/count_tokens; errors are Anthropic-style bodies (APIError)."""
from __future__ import annotations

import json

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
    parser = chat.OutputParser(tools, in_reasoning=chat.starts_in_reasoning(prompt_text))
    mid, model = new_id("msg_"), state.loaded.name

    def stop_reason(calls) -> str:
        if calls:
            return "tool_use"
        if generation.stop_string is not None:
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
        state.metrics.requests.labels("messages", outcome(generation, calls)).inc()
        return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
                "stop_reason": stop_reason(calls), "stop_sequence": generation.stop_string, "usage": usage(),
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
        state.metrics.requests.labels("messages", outcome(generation, parser.tool_calls)).inc()
        yield event("message_delta", {"delta": {"stop_reason": stop_reason(parser.tool_calls),
                                                "stop_sequence": generation.stop_string},
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
