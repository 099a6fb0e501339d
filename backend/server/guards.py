"""What a request passes before it reaches the engine, and how its refusals read: the request-body cap and read
timeout (BodyGuard, an ASGI middleware), validation errors in plain words naming the field, the text checks (lone
surrogates, prompts too long to tokenize), the one-at-a-time prompt slot, and the API-style error bodies (APIError).

Split from the server and its routes (issue 29), which import from here; nothing here imports them (it reads the
ServerState of state.py, which imports nothing of the server).
"""
from __future__ import annotations

import asyncio
import contextlib
import re

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.server.state import ServerState, release_freed_memory


# A request body larger than its prompt could ever be is refused before it is read (413). A token of the prompt is at
# most a few dozen bytes of JSON (a long token, or a few characters as \uXXXX escapes), so 64 bytes per token of the
# window, at least 1 MiB (tools and JSON around a short prompt), never turns away a prompt that fits the window.
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 1 << 20
LOADING_CONTEXT = 1 << 18  # the window assumed until the model has loaded (its real one is known then)
DEFAULT_BODY_TIMEOUT = 60.0  # seconds a request body may take to arrive in full
DRAIN_BYTES = 64 << 20  # an oversize body up to this size is read and dropped before the 413 (see BodyGuard)


def body_cap(state: ServerState) -> int:
    """The request body cap: --max-body-mb, else sized to the window (the assumed one while the model loads)."""
    if state.max_body_arg:
        return state.max_body_arg
    return body_bytes_cap(state.loaded.max_context if state.loaded else (state.max_context_arg or LOADING_CONTEXT))


def body_bytes_cap(window: int) -> int:
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * window)


SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """An error with an HTTP status, rendered OpenAI- or Anthropic-style depending on the route."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


_OPENAI_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error",
                 500: "server_error", 503: "server_overloaded"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_response(request: Request, status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    if request.url.path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "invalid_request_error"), "message": message}}
    else:
        body = {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "invalid_request_error"),
                          "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# ---- request bodies --------------------------------------------------------------------------------------------------

class BodyGuard:
    """Request bodies: over the cap (body_cap, read per request because the window is known only
    once the model has loaded) -> 413, from the Content-Length alone before a byte is read, or as soon as a chunked
    body passes it; not complete within body_timeout -> 408 (a body shorter than its Content-Length held the
    connection forever: uvicorn times out idle keep-alive connections, not a body in progress). Both are raised from
    `receive` as HTTPExceptions, which FastAPI passes on to our handler (route-style error body), and both close the
    connection. The rest of an oversize body is read and dropped chunk by chunk first (up to DRAIN_BYTES, within the
    timeout: memory stays flat), because a client still uploading (httpx, the SDKs) sees a connection reset instead
    of an early answer; one that sent `Expect: 100-continue` gets the 413 before it uploads.
    (Starlette's RequestBodyLimitMiddleware has a fixed limit and replaces every response to an oversize request with
    its own plain-text one.)"""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cap, timeout = body_cap(self.state), self.state.body_timeout
        headers = dict(scope["headers"])
        declared, expect = headers.get(b"content-length", b""), headers.get(b"expect", b"").lower()
        loop = asyncio.get_running_loop()
        deadline, received, complete = loop.time() + timeout, 0, False

        async def next_message():
            try:
                return await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.001))
            except asyncio.TimeoutError:
                raise StarletteHTTPException(408, f"the request body did not arrive within {timeout:g} s (shorter "
                                                  "than its Content-Length?)", headers={"Connection": "close"}) from None

        async def refuse(size: int, more: bool):
            # Read the rest and drop it (bounded), so that a client still uploading reads the 413, then refuse.
            with contextlib.suppress(StarletteHTTPException):  # a body that stops short is refused anyway
                while more and size <= DRAIN_BYTES and expect != b"100-continue":
                    message = await next_message()
                    size += len(message.get("body", b""))
                    more = message["type"] == "http.request" and message.get("more_body", False)
            raise StarletteHTTPException(413, headers={"Connection": "close"})

        async def guarded_receive():
            nonlocal received, complete
            if complete:  # later calls wait for a disconnect (queue, stream): no deadline for those
                return await receive()
            if declared.isdigit() and int(declared) > cap:
                await refuse(0, int(declared) <= DRAIN_BYTES)
            message = await next_message()
            more = message["type"] == "http.request" and message.get("more_body", False)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    await refuse(received, more)
            complete = not more
            return message

        await self.app(scope, guarded_receive, send)


def body_too_large_message(state: ServerState) -> str:
    cap = body_cap(state)
    why = ("--max-body-mb" if state.max_body_arg else
           f"sized to the {state.loaded.max_context}-token context window: no longer prompt could be served; "
           "--max-body-mb changes it" if state.loaded else "the model is still loading")
    return f"the request body is larger than {cap} bytes ({cap / 2**20:.1f} MiB), the most this server accepts ({why})"


def unparsable_body_message(cause: BaseException | None) -> str:
    """FastAPI answers a body that json cannot even decode with "There was an error parsing the body"; the cause it
    chains says which: bytes that are not UTF-8 (nor UTF-16/32), or arrays and objects nested past the recursion
    limit."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not UTF-8 text (byte 0x{cause.object[cause.start]:02x} at position "
                f"{cause.start}); send JSON encoded in UTF-8")
    if isinstance(cause, RecursionError):
        return "the request body's JSON nests arrays or objects too deeply to be read (about 1,000 levels at most)"
    if cause is not None:
        return f"the request body could not be read as JSON ({type(cause).__name__}: {cause})"
    return "the request body could not be read as JSON"


# Pydantic tries each member of a union (`stop: str | list[str]`) and reports every failure: "stop.str: Input should
# be a valid string (and 1 more problems)" for 17 stop strings. These error types only say "not this member"; the
# member names (str, list[str], TextPart, function-after[...]) are dropped from the location.
MISMATCH = {"string_type", "list_type", "int_type", "int_parsing", "float_type", "float_parsing", "bool_type",
            "bool_parsing", "dict_type", "model_type", "model_attributes_type", "none_required", "is_instance_of",
            "literal_error", "union_tag_invalid", "union_tag_not_found"}


def _is_member_tag(part) -> bool:
    return isinstance(part, str) and (not part[:1].islower() or "[" in part or "-" in part or
                                      part in {"str", "int", "float", "bool", "dict", "list", "none"})


def field_path(loc) -> str:
    """("body", "messages", 0, "content", "list[TextPart]", 0, "text") -> "messages[0].content[0].text"."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_member_tag(part):
            out += f".{part}" if out else str(part)
    return out


def describe_error(error: dict, where: str) -> str:
    kind, ctx = error.get("type", ""), error.get("ctx") or {}
    if kind == "missing" and not where:  # the body itself: FastAPI's error for an empty body
        return "the request body is empty: send a JSON object (Content-Type: application/json)"
    if kind == "missing":
        return f"{where} is required"
    if kind == "finite_number":
        return f"{where} must be a finite number (NaN and Infinity are not JSON numbers)"
    if kind == "too_long" and "max_length" in ctx:
        return f"{where} has {ctx.get('actual_length', 'too many')} items; at most {ctx['max_length']} are allowed"
    if kind == "too_short" and "min_length" in ctx:
        return f"{where} needs at least {ctx['min_length']} item(s)"
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """FastAPI's validation errors -> (one message in plain words, the field it is about)."""
    if errors and errors[0].get("type") == "json_invalid":
        pos = errors[0]["loc"][-1] if errors[0].get("loc") else "?"
        what = (errors[0].get("ctx") or {}).get("error", "decode error")
        # json's messages for an unterminated string or a bad escape end in "starting at": no second "at"
        return f"the request body is not valid JSON ({what.removesuffix(' at')} at character {pos})", None
    located = [(field_path(e.get("loc", ())), e) for e in errors] or [("", {"msg": "invalid request"})]
    # A "not this member" error is noise when another error says what is wrong inside the same field.
    kept = [(w, e) for w, e in located if e.get("type") not in MISMATCH or not any(
        o.get("type") not in MISMATCH and ow.startswith(w) for ow, o in located)]
    where, first = kept[0]
    message = describe_error(first, where)
    others = len({w for w, _ in kept} - {where})
    if others:
        message += f" (and {others} more problem{'s' if others > 1 else ''})"
    return message, where or None


# ---- request text ----------------------------------------------------------------------------------------------------

def check_text(body: BaseModel) -> None:
    """A lone UTF-16 surrogate ("\\ud800" in JSON without its pair) parses into a Python string no tokenizer can
    encode: name the field and say so, instead of the tokenizer's "TextEncodeInput must be Union[...]"."""
    def find(value, where: str) -> str | None:
        if isinstance(value, str):
            return where if SURROGATE.search(value) else None
        if isinstance(value, BaseModel):
            items = ((f"{where}.{k}" if where else k, getattr(value, k)) for k in type(value).model_fields)
        elif isinstance(value, dict):
            if any(SURROGATE.search(str(k)) for k in value):  # in a key (a tool schema's property name)
                return where
            items = ((f"{where}.{k}", v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
        else:
            return None
        return next((found for key, item in items if (found := find(item, key))), None)

    where = find(body, "")
    if where:
        raise APIError(400, f"{where} is not valid Unicode text: it holds a lone surrogate (a \\ud800-\\udfff "
                            "escape without its pair)", code="invalid_value", param=where)


PRECOUNT_ABOVE_CHARS_PER_TOKEN = 8  # a prompt of more characters than window x this is counted in pieces first
PRECOUNT_PIECE_CHARS = 16384
PIECE_SLACK_TOKENS = 2  # tokens a cut between pieces (or a message's edge in the template) may add to a count


async def check_prompt_length(state: ServerState, texts, field: str) -> None:
    """Refuse a prompt that cannot fit the window, without tokenizing all of it.

    First by characters alone: a token covers at most max_token_chars characters of text (a byte-level token's
    string has one character per byte it stands for, and a character is at least a byte), so more characters than
    window x that are more tokens than the window. Tokenizing such a prompt is what took gigabytes and seconds (a
    20 MB prompt: 6 GB, 38 s). That bound is loose (81 characters a token for SmolLM2: a 660 KB prompt passed it,
    was tokenized whole into 150,000 tokens, and each one left RSS ~65 MB higher), so a prompt above window x
    PRECOUNT_ABOVE_CHARS_PER_TOKEN characters is then counted piece by piece off the loop, stopping as soon as the
    count is past the window: at most a window's worth of tokens is ever made for a prompt that is refused."""
    texts = [t for t in texts if t]
    chars, window = sum(map(len, texts)), state.loaded.max_context
    if state.max_token_chars and chars > window * state.max_token_chars:
        raise APIError(400, f"the prompt has {chars} characters, more than the {window} tokens of the context window "
                            f"can hold (a token is at most {state.max_token_chars} characters); shorten it",
                       code="context_length_exceeded", param=field)
    if chars > window * PRECOUNT_ABOVE_CHARS_PER_TOKEN:
        at_least = await off_loop(state, count_past, state.loaded.tokenizer, texts, window)
        if at_least:
            raise APIError(400, f"the prompt has at least {at_least} tokens but the context window holds {window}; "
                                "shorten it", code="context_length_exceeded", param=field)


def pieces(text: str, size: int = PRECOUNT_PIECE_CHARS):
    """`text` in pieces of about `size` characters, each cut where a run of whitespace starts: byte-level BPE
    pre-tokenizers never join a word with the whitespace after it, so the pieces' tokens are the text's tokens."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            cut = next((i for i in range(end, min(end + 256, len(text))) if text[i].isspace() and
                        not text[i - 1].isspace()), end)
            end = cut if cut > start else end
        yield text[start:end]
        start = end


def count_past(tokenizer, texts: list[str], window: int) -> int:
    """Tokens of `texts`, counted piece by piece until the count, less a slack per piece, reaches the window; that
    lower bound if it did (the prompt cannot fit), else 0. Freed memory is given back to the system when it did."""
    counted = cuts = 0
    for text in texts:
        for piece in pieces(text):
            counted += len(tokenizer.encode(piece, add_special_tokens=False))
            cuts += 1
            if counted - PIECE_SLACK_TOKENS * cuts >= window:
                release_freed_memory()
                return counted - PIECE_SLACK_TOKENS * cuts
    return 0


async def off_loop(state: ServerState, fn, *args):
    """Prompt rendering and tokenization: on a worker thread, so the event loop (and /health) keeps answering while a
    big prompt is tokenized, and one at a time, so that several big requests at once do not multiply the memory."""
    async with state.prompt_slot or contextlib.nullcontext():
        return await asyncio.to_thread(fn, *args)
