"""The LLM client: one `chat` call over OpenAI-format messages and tools, whatever server is behind it.

`LLMClient` is the base every endpoint speaks through (openai_chat.py, anthropic_chat.py) and `FailoverClient` the
list of several; endpoints.py opens them from `--llm`. Retries with backoff live here, so the agent loop only ever sees
a `ChatResponse` or one `LLMError` (errors.py) whose message is a single line for the user.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from reviewer.llm.errors import CallTimedOut, ContextOverflow, EndpointDown, LLMError, classify

DEFAULT_OPENAI_MODEL = "gpt-4o-mini"
DEFAULT_ANTHROPIC_MODEL = "claude-sonnet-4-5"
# Context windows when neither the server nor the config says: hosted APIs are large, unknown local servers are not.
DEFAULT_CONTEXT = {"openai": 128_000, "anthropic": 200_000, "local": 8192}
CHARS_PER_TOKEN = 3.5  # rough, for estimates when a server reports no usage


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


# --- retries ----------------------------------------------------------------------------------------------------------

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
        (temperature, top_p, max_tokens, ...). `request_timeout` is a wall-clock limit for the whole call, retries
        included: past it the call is cut under way (CallTimedOut), however steadily the server streams. Raises
        LLMError (or a subclass) with a one-line message."""
        deadline = None if request_timeout is None else time.monotonic() + request_timeout
        attempt = 0
        while True:
            try:
                return self._chat_until(deadline, messages, tools, on_delta, params)
            except CallTimedOut:
                raise
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
                pause = self.retry.delay(attempt - 1, requested)
                if deadline is not None and time.monotonic() + pause >= deadline:
                    raise error from None  # no time left for another try
                time.sleep(pause)

    def _chat_until(self, deadline: float | None, messages, tools, on_delta, params) -> ChatResponse:
        """_chat_once, cut at `deadline`. An SDK's timeout is per read, so a server that keeps streaming (or a slow
        model that sends a token every few seconds) never trips it: the call runs on a helper thread, and at the
        deadline the caller gets CallTimedOut while the helper's next streamed piece ends the stream (closing the
        connection, which a server like `reviewer serve` takes as a cancel)."""
        if deadline is None:
            return self._chat_once(messages, tools, on_delta, None, params)
        left = deadline - time.monotonic()
        if left <= 0:
            raise CallTimedOut(f"the time limit ran out before the call to the LLM at {self.name}")
        abandoned = threading.Event()
        outcome: dict = {}

        def deliver(piece: str) -> None:
            if abandoned.is_set():
                raise CallTimedOut("abandoned at the deadline")  # ends the SDK's stream on the helper thread
            if on_delta is not None:
                on_delta(piece)

        def work() -> None:
            try:
                outcome["reply"] = self._chat_once(messages, tools, deliver, left, params)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                outcome["error"] = e

        helper = threading.Thread(target=work, name="llm-call", daemon=True)
        helper.start()
        helper.join(left)
        if helper.is_alive():
            abandoned.set()
            raise CallTimedOut(f"the time limit cut the call to the LLM at {self.name} after {left:.0f} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["reply"]

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
