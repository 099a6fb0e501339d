"""`--llm` as clients: `open_llm(settings)` turns each entry into one: `embedded` (starts `reviewer serve` as a
subprocess and stops it afterwards; embedded.py), `openai`, `anthropic` (anthropic_chat.py), an OpenAI-compatible base
URL, or `unix:///path.sock`. Several entries make a failover list of those that answered."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai

from reviewer.llm.anthropic_chat import AnthropicChat
from reviewer.llm.client import (DEFAULT_ANTHROPIC_MODEL, DEFAULT_CONTEXT, DEFAULT_OPENAI_MODEL, FailoverClient,
                                 LLMClient, RetryPolicy)
from reviewer.llm.embedded import start_embedded
from reviewer.llm.errors import LLMError, classify, sdk_httpx
from reviewer.llm.openai_chat import OpenAIChat
from reviewer.llm.serverinfo import discover_context


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
        import anthropic  # seconds to import: only for --llm anthropic

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
    from rich.markup import escape  # rich only where there is a console to print to

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
