"""What can go wrong talking to an LLM, as one line for the user: the error classes, and `classify`, which turns an
SDK's exception into one of them and says whether a retry may help."""

from __future__ import annotations

import contextlib
import sys

import httpx
import openai

from reviewer.llm.serverinfo import window_in_error
from reviewer.text import squeeze

try:  # the openai SDK's own HTTP library: httpx2 in recent releases, httpx before
    import httpx2 as sdk_httpx
except ImportError:  # pragma: no cover - older SDKs
    sdk_httpx = httpx


class LLMError(Exception):
    """The LLM cannot be used; the message is one line for the user."""


class EndpointDown(LLMError):
    """The endpoint did not answer (connection refused, reset, timed out): another endpoint may."""


class CallTimedOut(LLMError):
    """A wall-clock limit (a persona's --timeout) ended the call under way."""


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
            return squeeze(msg)
    return squeeze(getattr(e, "message", None) or str(e))


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
        what = "timed out" if "timeout" in type(e).__name__.lower() else squeeze(str(cause) or type(cause).__name__)
        return EndpointDown(f"cannot reach the LLM at {where}: {what}"), True, None
    if not isinstance(e, status_errors):
        return LLMError(f"LLM call to {where} failed: {type(e).__name__}: {squeeze(str(e))}"), False, None
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
