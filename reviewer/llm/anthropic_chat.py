"""`--llm anthropic`: the official Anthropic SDK, with OpenAI-format messages and tools converted both ways."""

from __future__ import annotations

import json
import time

from reviewer.llm.client import ChatResponse, LLMClient, RetryPolicy, ToolCall, parse_arguments


class AnthropicChat(LLMClient):
    """Anthropic's Messages API through the official SDK; OpenAI-format messages and tools converted both ways."""

    kind = "anthropic"

    def __init__(self, name: str, sdk, model: str, context_window: int, *,
                 stream: bool = True, retry: RetryPolicy | None = None):
        super().__init__(name, model, context_window, retry)
        self.sdk, self.stream = sdk, stream

    def _chat_once(self, messages, tools, on_delta, request_timeout, params) -> ChatResponse:
        system, converted = to_anthropic_messages(messages)
        args: dict = dict(model=self.model, messages=converted, max_tokens=int(params.get("max_tokens") or 4096))
        if system:
            args["system"] = system
        if tools:
            args["tools"] = [to_anthropic_tool(t) for t in tools]
        if params.get("stop"):
            args["stop_sequences"] = [params["stop"]] if isinstance(params["stop"], str) else list(params["stop"])
        if request_timeout is not None:
            args["timeout"] = max(1.0, request_timeout)
        start = time.perf_counter()
        if self.stream:
            with self.sdk.messages.stream(**args) as events:
                for piece in events.text_stream:
                    if on_delta:
                        on_delta(piece)
                message = events.get_final_message()
        else:
            message = self.sdk.messages.create(**args)
            if on_delta:
                on_delta("".join(b.text for b in message.content if b.type == "text"))
        return from_anthropic_message(message, time.perf_counter() - start)


def to_anthropic_tool(tool: dict) -> dict:
    fn = tool["function"]
    return {"name": fn["name"], "description": fn.get("description", ""),
            "input_schema": fn.get("parameters") or {"type": "object", "properties": {}}}


def to_anthropic_messages(messages: list[dict]) -> tuple[str, list[dict]]:
    """OpenAI chat messages -> (system text, Anthropic messages). Tool results become tool_result blocks in a user
    turn; consecutive turns of one role are merged because Anthropic wants them alternating."""
    system: list[str] = []
    out: list[dict] = []

    def add(role: str, blocks: list[dict]) -> None:
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})

    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "system":
            system.append(content)
        elif role == "tool":
            add("user", [{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": content or "(empty)"}])
        elif role == "assistant":
            blocks = [{"type": "text", "text": content}] if content else []
            for tc in m.get("tool_calls") or []:
                args = parse_arguments(tc["function"].get("arguments")) or {}
                blocks.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"], "input": args})
            add("assistant", blocks or [{"type": "text", "text": "(no reply)"}])
        else:
            add("user", [{"type": "text", "text": content or "(empty)"}])
    return "\n\n".join(system), out


def from_anthropic_message(message, seconds: float) -> ChatResponse:
    text, calls = [], []
    for block in message.content:
        if block.type == "text":
            text.append(block.text)
        elif block.type == "tool_use":
            calls.append(ToolCall(block.id, block.name, dict(block.input or {}), json.dumps(block.input or {})))
    reason = {"end_turn": "stop", "tool_use": "tool_calls", "max_tokens": "length"}.get(message.stop_reason or "",
                                                                                        message.stop_reason or "stop")
    usage = message.usage
    return ChatResponse("".join(text), calls, usage.input_tokens, usage.output_tokens, seconds, reason)
