"""Any OpenAI-compatible chat completions endpoint (our backend, llama-server, vLLM, OpenAI itself), through the
official SDK: streaming, tool calls, usage (estimated where the server sends none) and the tools probe."""

from __future__ import annotations

import time

import openai

from reviewer.llm.client import (ChatResponse, LLMClient, RetryPolicy, ToolCall, estimate_prompt_tokens,
                                 estimate_tokens, parse_arguments)
from reviewer.llm.errors import StreamEnded, ToolsUnsupported, sdk_errors
from reviewer.llm.serverinfo import tools_reach_model


class OpenAIChat(LLMClient):
    """Any OpenAI-compatible chat completions endpoint, through the official SDK."""

    def __init__(self, name: str, sdk: openai.OpenAI, model: str, context_window: int, *, kind: str = "local",
                 stream: bool = True, retry: RetryPolicy | None = None):
        super().__init__(name, model, context_window, retry)
        self.sdk, self.kind, self.stream = sdk, kind, stream
        self.tools = "untested"  # "untested" | "seen" | "dropped" | "unknown": does the model see `tools`?
        self.tools_evidence = ""

    def chat(self, messages, tools=None, **kwargs) -> ChatResponse:
        """As LLMClient.chat, plus the tools probe: the first tools request of this endpoint that comes back without
        a tool call asks whether the model saw the tools at all (serverinfo.tools_reach_model). If it did not, this
        endpoint raises ToolsUnsupported for every tools request from then on, so each persona's agent switches to
        tool calls written as text (and its log says why)."""
        if tools and self.tools == "dropped":
            raise ToolsUnsupported(self.dropped_message())
        response = super().chat(messages, tools, **kwargs)
        if tools and response.tool_calls:
            self.tools = "seen"
        elif tools and self.tools == "untested":
            seen, self.tools_evidence = tools_reach_model(self.sdk, self.model, tools)
            self.tools = {True: "seen", False: "dropped", None: "unknown"}[seen]
            if self.tools == "dropped":
                raise ToolsUnsupported(self.dropped_message())
        return response

    def dropped_message(self) -> str:
        return (f"the LLM at {self.name} does not show the model the `tools` it is sent ({self.tools_evidence}): "
                "tool calls are written as text from now on")

    def _request_args(self, messages, tools, params, request_timeout) -> dict:
        params = dict(params)
        extra = {k: params.pop(k) for k in list(params) if k not in OPENAI_PARAMS}
        if self.kind == "openai" and "max_tokens" in params:  # newer OpenAI models only take the new name
            params["max_completion_tokens"] = params.pop("max_tokens")
        args = dict(model=self.model, messages=messages, **params)
        if tools:
            args["tools"] = tools
        if extra:  # e.g. top_k for local servers
            args["extra_body"] = extra
        if request_timeout is not None:
            args["timeout"] = max(1.0, request_timeout)
        return args

    def _chat_once(self, messages, tools, on_delta, request_timeout, params) -> ChatResponse:
        args = self._request_args(messages, tools, params, request_timeout)
        start = time.perf_counter()
        if not self.stream:
            reply = from_completion(self.sdk.chat.completions.create(**args), messages, tools, start)
            if on_delta and reply.content:
                on_delta(reply.content)
            return reply
        content: list[str] = []
        parts: dict[int, dict] = {}  # tool call index -> {"id", "name", "arguments": [pieces]}
        finish_reason, usage, seen = None, None, 0
        dropped = None
        try:
            with self.sdk.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}) as chunks:
                for chunk in chunks:
                    seen += 1
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        delta = choice.delta
                        finish_reason = choice.finish_reason or finish_reason
                        if delta is None:  # some servers send a bare finish chunk
                            continue
                        piece = delta.content or ""
                        reasoning = getattr(delta, "reasoning_content", None) or ""  # thinking models on vLLM
                        for tc in delta.tool_calls or []:
                            slot = parts.setdefault(tc.index if tc.index is not None else len(parts),
                                                    {"id": "", "name": "", "arguments": []})
                            slot["id"] = tc.id or slot["id"]
                            if tc.function:
                                slot["name"] = tc.function.name or slot["name"]
                                slot["arguments"].append(tc.function.arguments or "")
                                piece += tc.function.arguments or ""
                        content.append(delta.content or "")
                        if on_delta and (piece or reasoning):
                            on_delta(reasoning + piece)
        except Exception as e:  # noqa: BLE001 - only a connection the server dropped is handled here
            if not dropped_stream(e):
                raise
            dropped = f"a dropped connection after {seen} chunks ({type(e.__cause__ or e).__name__})"
        if dropped or not seen or finish_reason is None:
            return self._ask_unstreamed(args, messages, tools, dropped or ("no chunks" if not seen else
                                        f"{seen} chunks and no finish reason"), start)
        calls = []
        for i in sorted(parts):
            raw = "".join(parts[i]["arguments"])
            calls.append(ToolCall(parts[i]["id"] or f"call_{i}", parts[i]["name"], parse_arguments(raw), raw))
        return finish_response("".join(content), calls, finish_reason, usage, messages, tools,
                               time.perf_counter() - start)

    def _ask_unstreamed(self, args, messages, tools, what: str, start: float) -> ChatResponse:
        """A stream that ended early says nothing about why; the same request unstreamed gets the server's words
        (a 400 for a prompt that does not fit, which the agent then trims) or, if the failure was passing, the
        answer itself."""
        for attempt in (1, 2):
            try:
                return from_completion(self.sdk.chat.completions.create(**args), messages, tools, start)
            except Exception as e:  # noqa: BLE001 - classified in chat(), with what the stream did
                # The connection that carried the broken stream may go back to the pool broken (llama-cpp-python's
                # next answer on it is a disconnect): once more, on a fresh one.
                if attempt == 1 and dropped_stream(e):
                    continue
                raise StreamEnded(what, e) from None
        raise AssertionError("unreachable")

    def probe(self, timeout: float = 5.0) -> bool:
        """Does the endpoint answer at all (GET /v1/models)? Any HTTP answer counts: only connection errors say no."""
        try:
            self.sdk.with_options(timeout=timeout, max_retries=0).models.list()
        except openai.APIStatusError:
            return True
        except Exception:  # noqa: BLE001 - refused, reset, timed out
            return False
        return True

    def close(self) -> None:
        self.sdk.close()


OPENAI_PARAMS = {"temperature", "top_p", "max_tokens", "seed", "stop", "presence_penalty", "frequency_penalty",
                 "logit_bias", "reasoning_effort", "tool_choice"}


def dropped_stream(e: Exception) -> bool:
    """Did the server drop a streamed request it had taken? llama-cpp-python does that when the prompt does not fit
    (with recent sse-starlette; older ones answer 200 and no chunk). A refused connection or a timeout is not that:
    those are the endpoint's own trouble and handled as such."""
    if not isinstance(e, sdk_errors()[1]):
        return False
    names = {type(x).__name__ for x in (e, e.__cause__, e.__context__) if x is not None}
    return not any("Timeout" in n or n == "ConnectError" for n in names)


def from_completion(resp, messages, tools, start: float) -> ChatResponse:
    """An unstreamed chat completion as a ChatResponse."""
    choice = resp.choices[0]
    msg = choice.message
    calls = [ToolCall(tc.id or f"call_{i}", tc.function.name, parse_arguments(tc.function.arguments),
                      tc.function.arguments or "") for i, tc in enumerate(msg.tool_calls or [])]
    return finish_response(msg.content or "", calls, choice.finish_reason, resp.usage, messages, tools,
                           time.perf_counter() - start)


def finish_response(content, calls, finish_reason, usage, messages, tools, seconds) -> ChatResponse:
    if usage is not None and usage.prompt_tokens:
        return ChatResponse(content, calls, usage.prompt_tokens, usage.completion_tokens or 0, seconds,
                            finish_reason or "stop")
    prompt = estimate_prompt_tokens(messages, tools)
    completion = estimate_tokens(content + "".join(c.raw_arguments for c in calls))
    return ChatResponse(content, calls, prompt, completion, seconds, finish_reason or "stop", usage_estimated=True)
