"""LLM clients: one `chat` call over OpenAI-format messages and tools, whatever server is behind it.

`open_llm(settings)` turns each `--llm` entry into a client: `embedded` (starts `reviewer serve` as a subprocess and
stops it afterwards; see embedded.py), `openai`, `anthropic` (the official SDK; messages and tools are converted both ways), an
OpenAI-compatible base URL, or `unix:///path.sock`. Several entries make a failover list. Retries with backoff live
here, so the agent loop only ever sees a `ChatResponse` or one `LLMError` whose message is a single line for the user.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from reviewer.llm.serverinfo import discover_context, tools_reach_model, window_in_error

try:  # the openai SDK's own HTTP library: httpx2 in recent releases, httpx before
    import httpx2 as sdk_httpx
except ImportError:  # pragma: no cover - older SDKs
    sdk_httpx = httpx

DEFAULT_OPENAI_MODEL = "gpt-4o-mini"
DEFAULT_ANTHROPIC_MODEL = "claude-sonnet-4-5"
# Context windows when neither the server nor the config says: hosted APIs are large, unknown local servers are not.
DEFAULT_CONTEXT = {"openai": 128_000, "anthropic": 200_000, "local": 8192}
CHARS_PER_TOKEN = 3.5  # rough, for estimates when a server reports no usage


class LLMError(Exception):
    """The LLM cannot be used; the message is one line for the user."""


class EndpointDown(LLMError):
    """The endpoint did not answer (connection refused, reset, timed out): another endpoint may."""


class ContextOverflow(LLMError):
    """The server says the prompt does not fit its context window; `window` is the size it names, if it does."""

    def __init__(self, message: str, window: int | None = None):
        super().__init__(message)
        self.window = window or window_in_error(message)


class ToolsUnsupported(LLMError):
    """The server rejects the `tools` parameter, or drops it before the model: the agent falls back to tool calls
    written in text."""


class StreamEnded(Exception):
    """A streamed reply ended with no chunks or no finish reason (llama-cpp-python answers an overflowing streamed
    request with HTTP 200 and nothing). `cause` is what the same request gave unstreamed: the server's own words."""

    def __init__(self, what: str, cause: Exception):
        super().__init__(what)
        self.what, self.cause = what, cause


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict | None  # None when the model's arguments were not a JSON object
    raw_arguments: str


@dataclass
class ChatResponse:
    content: str
    tool_calls: list[ToolCall]
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    finish_reason: str
    usage_estimated: bool = False  # True when the server sent no usage and the counts are estimates


def estimate_tokens(text: str) -> int:
    return int(len(text) / CHARS_PER_TOKEN) + 1


def estimate_prompt_tokens(messages: list[dict], tools: list[dict] | None) -> int:
    """What the model reads: the messages' text and tool calls, a few tokens of chat-template framing each, and the
    tool schemas when sent (the request's JSON keys and escapes are not prompt tokens). Rough: a server's template
    adds its own words, and tokenizers differ; the counts it gives are marked estimated."""
    chars = sum(len(m.get("content") or "") + (len(json.dumps(m["tool_calls"])) if m.get("tool_calls") else 0)
                for m in messages)
    return int(chars / CHARS_PER_TOKEN) + 4 * len(messages) + (estimate_tokens(json.dumps(tools)) if tools else 0)


def parse_arguments(raw: str | None) -> dict | None:
    if not raw or not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- errors and retries ---------------------------------------------------------------------------------------------

def sdk_errors() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(HTTP status errors, connection errors) of the SDKs in use. The connection errors include the SDKs' timeouts;
    a connection dropped in the middle of a stream surfaces as the HTTP library's own TransportError. The anthropic
    SDK is imported only for `--llm anthropic` (it takes seconds to import), so its classes count only once loaded."""
    status: list[type] = [openai.APIStatusError]
    connection: list[type] = [openai.APIConnectionError, sdk_httpx.TransportError, httpx.TransportError]
    if "anthropic" in sys.modules:
        import anthropic

        status.append(anthropic.APIStatusError)
        connection.append(anthropic.APIConnectionError)
    return tuple(status), tuple(connection)


def error_message(e: Exception) -> str:
    """The server's own words: the JSON error message when there is one."""
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        msg = inner.get("message") if isinstance(inner, dict) else inner
        if msg:
            return one_line(msg)
    return one_line(getattr(e, "message", None) or str(e))


def classify(e: Exception, where: str, sent_tools: bool) -> tuple[LLMError, bool, float | None]:
    """(error to raise, retryable?, server-requested delay) for an SDK exception."""
    if isinstance(e, StreamEnded):
        error, retryable, delay = classify(e.cause, where, sent_tools)
        window = getattr(error, "window", None)
        note = f"{error} (its streamed answer had ended with {e.what})"
        return (type(error)(note, window) if window else type(error)(note)), retryable, delay
    if isinstance(e, LLMError):
        return e, False, None
    status_errors, connection_errors = sdk_errors()
    if isinstance(e, connection_errors):
        cause = e.__cause__ or e.__context__ or e
        what = "timed out" if "timeout" in type(e).__name__.lower() else one_line(str(cause) or type(cause).__name__)
        return EndpointDown(f"cannot reach the LLM at {where}: {what}"), True, None
    if not isinstance(e, status_errors):
        return LLMError(f"LLM call to {where} failed: {type(e).__name__}: {one_line(str(e))}"), False, None
    status, msg = e.status_code, error_message(e)
    if status in (401, 403):
        return LLMError(f"the LLM at {where} refused the API key (HTTP {status}): {msg}"), False, None
    if status == 404:
        return LLMError(f"the LLM at {where} answered 404 (unknown model or path?): {msg}"), False, None
    if status in (408, 409, 429) or status >= 500:
        retry_after = None
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            retry_after = min(float(e.response.headers.get("retry-after")), 60.0)
        return LLMError(f"the LLM at {where} kept failing (HTTP {status}): {msg}"), True, retry_after
    lowered = msg.lower()
    if "context" in lowered or ("token" in lowered and ("maximum" in lowered or "too long" in lowered)):
        return (ContextOverflow(f"the prompt does not fit the LLM's context at {where}: {msg}",
                                window_in_error(msg, getattr(e, "body", None))), False, None)
    if sent_tools and "tool" in lowered:
        return ToolsUnsupported(f"the LLM at {where} does not take tools: {msg}"), False, None
    return LLMError(f"the LLM at {where} rejected the request (HTTP {status}): {msg}"), False, None


@dataclass
class RetryPolicy:
    attempts: int = 5  # for 429 / 5xx / timeouts
    connect_attempts: int = 3  # for refused connections: a restarting server gets a moment, a dead one fails fast
    base_delay: float = 1.0
    max_delay: float = 30.0

    def delay(self, attempt: int, requested: float | None) -> float:
        if requested is not None:
            return requested
        return min(self.max_delay, self.base_delay * 2**attempt) * random.uniform(0.5, 1.0)


# --- clients --------------------------------------------------------------------------------------------------------

class LLMClient:
    """Base: retries around one `_chat_once`; subclasses speak one API."""

    name: str
    model: str
    context_window: int
    kind: str = "local"  # "openai", "anthropic" or "local": decides defaults and parameter names
    context_source: str = "default"  # where context_window came from: configured, a server field, assumed

    def __init__(self, name: str, model: str, context_window: int, retry: RetryPolicy | None = None):
        self.name, self.model, self.context_window = name, model, context_window
        self.retry = retry or RetryPolicy()
        self.notes: list[str] = []
        self.on_note: Callable[[str], None] | None = None

    def chat(self, messages: list[dict], tools: list[dict] | None = None, *,
             on_delta: Callable[[str], None] | None = None, request_timeout: float | None = None,
             **params) -> ChatResponse:
        """One completion. `on_delta` sees the generated text as it streams; `params` are sampling settings
        (temperature, top_p, max_tokens, ...). Raises LLMError (or a subclass) with a one-line message."""
        attempt = 0
        while True:
            try:
                return self._chat_once(messages, tools, on_delta, request_timeout, params)
            except Exception as e:  # noqa: BLE001 - every SDK error is classified below
                error, retryable, requested = classify(e, self.name, bool(tools))
                if isinstance(error, ContextOverflow) and error.window and error.window < self.context_window:
                    self.note(f"the LLM at {self.name} says its context window is {error.window} tokens "
                              f"(not {self.context_window}): conversations are trimmed to it from now on")
                    self.context_window = error.window
                limit = self.retry.connect_attempts if isinstance(error, EndpointDown) else self.retry.attempts
                attempt += 1
                if not retryable or attempt >= limit:
                    raise error from None
                time.sleep(self.retry.delay(attempt - 1, requested))

    def _chat_once(self, messages, tools, on_delta, request_timeout, params) -> ChatResponse:
        raise NotImplementedError

    def note(self, message: str) -> None:
        """Something the run's log must say (a guessed context window, tools the server drops)."""
        self.notes.append(message)
        if self.on_note is not None:
            self.on_note(message)

    def route(self) -> LLMClient:
        """The client for one persona run: itself for one endpoint; FailoverClient picks a healthy endpoint."""
        return self

    def close(self) -> None:
        pass


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


class FailoverClient(LLMClient):
    """Several endpoints (inference boxes) behind one client. `route()` gives each persona run its own view, pinned to
    one healthy endpoint, taken in turn from a per-process random start (so the worker boxes spread over the inference
    boxes) and kept for the whole run (so that server's prefix cache stays warm for the conversation). A request
    that finds its endpoint down (connection refused, reset, timed out) moves the run to the next healthy endpoint and
    the dead one is skipped by later routes for `cooldown` seconds; the conversation is all in the messages, so any
    endpoint can carry it on."""

    def __init__(self, clients: list[LLMClient], *, cooldown: float = 30.0, _shared: dict | None = None):
        self.clients = clients
        # Health and turn-taking are shared by every routed view of this pool.
        self.shared = _shared or {"down_until": [0.0] * len(clients), "turn": random.randrange(len(clients)),
                                  "cooldown": cooldown}
        self.current = 0  # used directly (not routed), the list order is the order of preference

    @property
    def active(self) -> LLMClient:
        return self.clients[self.current]

    name = property(lambda self: self.active.name)
    model = property(lambda self: self.active.model)
    context_window = property(lambda self: min(c.context_window for c in self.clients))
    kind = property(lambda self: self.active.kind)

    @property
    def retry(self) -> RetryPolicy:
        return self.active.retry

    def healthy(self, index: int) -> bool:
        return self.shared["down_until"][index] <= time.monotonic()

    def order(self, start: int) -> list[int]:
        """Endpoint indices from `start` round, healthy ones first."""
        ring = [(start + i) % len(self.clients) for i in range(len(self.clients))]
        return [i for i in ring if self.healthy(i)] + [i for i in ring if not self.healthy(i)]

    def mark_down(self, index: int) -> None:
        self.shared["down_until"][index] = time.monotonic() + self.shared["cooldown"]

    def route(self) -> FailoverClient:
        """A view for one persona run, pinned to the next healthy endpoint in turn (one that answers a quick
        /v1/models where the endpoint can be asked)."""
        start = self.shared["turn"]
        for index in self.order(start):
            probe = getattr(self.clients[index], "probe", None)
            if self.healthy(index) and (probe is None or probe()):
                break
            self.mark_down(index)
        else:
            index = self.order(start)[0]  # none answers: the chat will say so, naming every endpoint
        self.shared["turn"] = index + 1
        view = FailoverClient(self.clients, _shared=self.shared)
        view.current = index
        return view

    def chat(self, messages, tools=None, **kwargs) -> ChatResponse:
        failures = []
        for index in self.order(self.current):
            self.current = index
            try:
                return self.active.chat(messages, tools, **kwargs)
            except EndpointDown as e:
                failures.append(str(e))
                self.mark_down(index)
        raise LLMError("no LLM endpoint answered: " + "; ".join(failures))

    def close(self) -> None:
        for c in self.clients:
            c.close()


# --- opening endpoints ----------------------------------------------------------------------------------------------

def server_models(sdk: openai.OpenAI, where: str) -> list[dict]:
    """The entries of GET /v1/models, with any extra fields the server adds; [] when the server has no such route."""
    try:
        return [m.model_dump() for m in sdk.models.list().data]
    except openai.APIStatusError as e:
        if e.status_code in (401, 403):
            raise classify(e, where, False)[0] from None
        return []
    except openai.APIConnectionError as e:
        raise classify(e, where, False)[0] from None


def openai_endpoint(name: str, base_url: str, api_key: str, settings, *, kind: str = "local",
                    http_client=None, stream: bool = True, retry: RetryPolicy | None = None) -> OpenAIChat:
    """An OpenAI-compatible client, after asking the server which model it serves and how large its context is."""
    sdk = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600.0, http_client=http_client)
    models = server_models(sdk, name)
    wanted = settings.model
    entry = next((m for m in models if m.get("id") == wanted), None) or (models[0] if models and kind == "local" else {})
    model = wanted or entry.get("id") or (DEFAULT_OPENAI_MODEL if kind == "openai" else "default")
    configured = getattr(settings, "context_window", None)
    found = None if configured else discover_context(sdk, entry, local=kind == "local")
    window = configured or (found[0] if found else DEFAULT_CONTEXT[kind])
    client = OpenAIChat(name, sdk, model, window, kind=kind, stream=stream, retry=retry)
    client.context_source = "configured" if configured else (found[1] if found else "assumed")
    if client.context_source == "assumed" and kind == "local":
        client.notes.append(f"the LLM at {name} does not say its context window (not in /v1/models, /props or "
                            f"/slots): assuming {window} tokens until an overflow error names it; set "
                            "--context-window N or context_window in reviewer.toml")
    return client


def normalize_base_url(url: str) -> str:
    """`http://host:8000` -> `http://host:8000/v1` (the SDK appends /chat/completions to whatever it is given)."""
    parsed = httpx.URL(url)
    return url.rstrip("/") + "/v1" if parsed.path in ("", "/") else url.rstrip("/")


@contextlib.contextmanager
def open_endpoint(spec: str, settings, console=None, **launcher) -> Iterator[LLMClient]:
    """One `--llm` entry as a client; the embedded backend lives as long as the `with` block."""
    local_key = settings.api_key or "not-needed"  # never send a hosted API key to a server we do not know
    if spec == "embedded":
        from reviewer.llm.embedded import start_embedded

        with start_embedded(settings, console, **launcher) as base_url:
            client = openai_endpoint("embedded", base_url, local_key, settings)
            try:
                yield client
            finally:
                client.close()
        return
    if spec == "openai":
        key = os.environ.get("OPENAI_API_KEY")
        if not key:
            raise LLMError("--llm openai needs OPENAI_API_KEY in the environment")
        client = openai_endpoint("openai", os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1", key,
                                 settings, kind="openai")
    elif spec == "anthropic":
        key = os.environ.get("ANTHROPIC_API_KEY")
        if not key:
            raise LLMError("--llm anthropic needs ANTHROPIC_API_KEY in the environment")
        import anthropic

        sdk = anthropic.Anthropic(api_key=key, max_retries=0, timeout=600.0)  # honours ANTHROPIC_BASE_URL
        window = getattr(settings, "context_window", None) or DEFAULT_CONTEXT["anthropic"]
        client = AnthropicChat("anthropic", sdk, settings.model or DEFAULT_ANTHROPIC_MODEL, window)
    elif spec.startswith("unix://"):
        path = spec.removeprefix("unix://")
        if not Path(path).exists():
            raise LLMError(f"cannot reach the LLM at {spec}: no socket at {path}")
        http_client = openai.DefaultHttpxClient(transport=sdk_httpx.HTTPTransport(uds=path))
        client = openai_endpoint(spec, "http://localhost/v1", local_key, settings, http_client=http_client)
    elif spec.startswith(("http://", "https://")):
        client = openai_endpoint(spec, normalize_base_url(spec), local_key, settings)
    else:
        raise LLMError(f"unknown --llm '{spec}': use embedded, openai, anthropic, http(s)://host:port/v1 "
                       "or unix:///path.sock")
    try:
        yield client
    finally:
        client.close()


def log_notes(client: LLMClient, console) -> None:
    """The client's notes go to the run's log: those it has now, and those it makes later."""
    if console is None:
        return
    from rich.markup import escape

    def say(message: str) -> None:
        console.print(f"[yellow]note:[/yellow] {escape(message)}", markup=True, highlight=False, soft_wrap=True)

    for message in client.notes:
        say(message)
    client.on_note = say


@contextlib.contextmanager
def open_llm(settings, console=None, **launcher) -> Iterator[LLMClient]:
    """The client for `settings.llm`: one endpoint, or a failover list of those that answered. Raises LLMError with
    one line when none can be used. `launcher` goes to `start_embedded` (tests pass a command there)."""
    specs = list(settings.llm) or ["embedded"]
    with contextlib.ExitStack() as stack:
        clients, failures = [], []
        for spec in specs:
            try:
                clients.append(stack.enter_context(open_endpoint(spec, settings, console, **launcher)))
                log_notes(clients[-1], console)
            except LLMError as e:
                if len(specs) == 1:
                    raise
                failures.append(str(e))
                if console is not None:
                    console.print(f"[yellow]skipping LLM endpoint[/yellow] {spec}: {e}", markup=True, highlight=False)
        if not clients:
            raise LLMError("no LLM endpoint could be used: " + "; ".join(failures))
        yield clients[0] if len(clients) == 1 else FailoverClient(clients)
