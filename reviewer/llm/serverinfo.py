"""What an OpenAI-compatible server says about itself: its context window, and whether its model sees `tools`.

Peers differ (docs/backends.md): vLLM puts `max_model_len` in each /v1/models entry, our `reviewer serve` puts
`max_context` there, llama.cpp's llama-server says `n_ctx` in /props and /slots (outside /v1), and llama-cpp-python's
server says nothing until a prompt overflows (its 400 then names the window). Some servers drop `tools` without an
error when the model's chat template has no place for them; the only sign is a prompt that is no longer for them.
Everything here goes through the endpoint's own openai SDK client, so unix sockets and API keys work unchanged.
"""

from __future__ import annotations

import contextlib
import json
import re

import openai

# Keys an OpenAI-compatible /v1/models entry may use for the context window (ours, LM Studio, vLLM, others).
CONTEXT_KEYS = ("max_context", "context_length", "max_model_len", "context_window", "max_context_length")
# How servers name the window in a context-overflow error: vLLM and llama-cpp-python ("This model's maximum context
# length is 2048 tokens"), llama-cpp-python's raw error ("exceed context window of 2048"), llama-server (`n_ctx`).
WINDOW_IN_ERROR = re.compile(r"(?:maximum context length is|context window of|context size of|n_ctx\W+)\s*(\d+)", re.I)
# The two one-token requests of the tools probe; a test server may recognise them by these messages.
TOOLS_PROBE_MESSAGES = [{"role": "user", "content": "Reply with the word OK."}]


def positive_int(value) -> int | None:
    with contextlib.suppress(TypeError, ValueError):
        value = int(value)
        return value if value > 0 else None
    return None


def context_from(entry: dict) -> tuple[int, str] | None:
    """(window, key) from one /v1/models entry."""
    for key in CONTEXT_KEYS:
        value = positive_int(entry.get(key))
        if value:
            return value, key
    return None


def root_url(sdk: openai.OpenAI) -> str:
    """The server's root: llama-server's /props and /slots live beside /v1, not under it."""
    base = str(sdk.base_url).rstrip("/")
    return base.removesuffix("/v1")


def get_json(sdk: openai.OpenAI, url: str, timeout: float = 5.0):
    """GET an absolute URL through the SDK's own client (its transport, its key); None on any failure: these routes
    are optional and most servers do not have them."""
    try:
        return json.loads(sdk.with_options(timeout=timeout, max_retries=0).get(url, cast_to=str))
    except Exception:  # noqa: BLE001 - 404, 501 (llama-server --no-slots), not JSON, refused: the server does not say
        return None


def llama_server_context(sdk: openai.OpenAI) -> tuple[int, str] | None:
    """llama-server's n_ctx per slot (the window one request gets): /props, else /slots."""
    root = root_url(sdk)
    props = get_json(sdk, root + "/props")
    if isinstance(props, dict):
        for holder in (props.get("default_generation_settings") or {}, props):
            value = positive_int(holder.get("n_ctx")) if isinstance(holder, dict) else None
            if value:
                return value, "/props n_ctx"
    slots = get_json(sdk, root + "/slots")
    if isinstance(slots, list) and slots and isinstance(slots[0], dict):
        value = positive_int(slots[0].get("n_ctx"))
        if value:
            return value, "/slots n_ctx"
    return None


def discover_context(sdk: openai.OpenAI, entry: dict, *, local: bool) -> tuple[int, str] | None:
    """(window, where it came from) from everything the server offers; None when it says nothing. Hosted APIs are
    not asked for llama-server's routes."""
    return context_from(entry) or (llama_server_context(sdk) if local else None)


def window_in_error(message: str, body=None) -> int | None:
    """The context window a context-overflow error names, if it does."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        value = positive_int(inner.get("n_ctx")) if isinstance(inner, dict) else None
        if value:
            return value
    match = WINDOW_IN_ERROR.search(message or "")
    return positive_int(match.group(1)) if match else None


def tools_reach_model(sdk: openai.OpenAI, model: str, tools: list[dict], timeout: float = 120.0) -> tuple[bool | None, str]:
    """Does the model see `tools`? Two one-token requests, without and with the schemas: a server that renders them
    into the prompt counts more prompt tokens; one that drops them counts the same. (True/False/None for 'cannot
    tell', and the evidence in words.)"""
    client = sdk.with_options(timeout=timeout, max_retries=0)
    args = dict(model=model, messages=TOOLS_PROBE_MESSAGES, max_tokens=1, temperature=0.0)
    try:
        plain = client.chat.completions.create(**args)
        with_tools = client.chat.completions.create(**args, tools=tools)
    except openai.APIStatusError as e:
        words = str(getattr(e, "message", e))
        if "tool" in words.lower():
            return False, f"the server refused the tools probe: {' '.join(words.split())[:200]}"
        return None, f"the tools probe failed (HTTP {e.status_code})"
    except Exception as e:  # noqa: BLE001 - refused, timed out: the real request will say so
        return None, f"the tools probe failed ({type(e).__name__})"
    a = plain.usage.prompt_tokens if plain.usage else 0
    b = with_tools.usage.prompt_tokens if with_tools.usage else 0
    if not a or not b:
        return None, "the server reports no prompt token counts"
    if b == a:
        return False, f"the prompt had {a} tokens with the tool schemas and without them"
    return True, f"the tool schemas added {b - a} prompt tokens"
