"""A scripted model behind a real OpenAI- (and Anthropic-) compatible HTTP server, for tests.

The script is a list of turns; each turn is a `Reply` or a function of the incoming request body returning one, so a
test can look at what the agent sent (for example that the previous tool's real output is in the next request). The
server records every request. It answers `/v1/chat/completions` (streaming SSE or not, with `stream_options`
usage), `/v1/messages` (Anthropic, streaming or not), `/v1/models` and `/health`, on a real 127.0.0.1 port or a unix
socket, so the official SDKs are exercised end to end.

    def test_x(scripted_llm):
        server = scripted_llm([tool("bash", command="echo hi"), lambda req: tool("finish", summary="done")])
        ... use server.base_url ...
        assert "hi" in server.requests[1]["messages"][-1]["content"]

Run as a program (`python tests/scripted_llm.py --port N`) it serves a model that finishes at once; the options
`--health-delay` and `--exit-after` stand in for a backend that loads slowly or dies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

if __name__ == "__main__":
    # Run as a program, tests/ is sys.path[0], where tests/reviewer/ (the reviewer's tests) would shadow the package.
    sys.path[0] = __file__.rsplit("/tests/", 1)[0]

from reviewer.llm.serverinfo import TOOLS_PROBE_MESSAGES


@dataclass
class Reply:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # {"name": ..., "arguments": dict or raw str}
    status: int = 200  # anything else: an HTTP error carrying `error`
    error: str = ""
    headers: dict = field(default_factory=dict)
    delay: float = 0.0  # seconds to wait before answering
    chunk_delay: float = 0.0  # seconds between streamed content pieces (a slow model that keeps streaming)
    pieces: int = 3  # how many pieces the content streams in
    finish_reason: str | None = None


def tool(name: str, /, **arguments) -> Reply:
    return Reply(tool_calls=[{"name": name, "arguments": arguments}])


def raw_tool(name: str, raw_arguments: str) -> Reply:
    """A tool call whose arguments are sent verbatim (e.g. broken JSON)."""
    return Reply(tool_calls=[{"name": name, "arguments": raw_arguments}])


def text(content: str) -> Reply:
    return Reply(content=content)


def fail(status: int, message: str, headers: dict | None = None) -> Reply:
    return Reply(status=status, error=message, headers=headers or {})


Turn = Reply | Callable[[dict], Reply]


def count_tokens(value) -> int:
    """Deterministic stand-in for a tokenizer: 4 characters a token."""
    return max(1, len(value if isinstance(value, str) else json.dumps(value)) // 4)


def chunks_of(s: str, n: int = 3) -> list[str]:
    """Split into n pieces so streaming clients must reassemble."""
    step = max(1, -(-len(s) // n))
    return [s[i : i + step] for i in range(0, len(s), step)] or [""]


class ScriptedLLM:
    def __init__(self, turns: list[Turn], *, model: str = "scripted-model", max_context: int | None = 32768,
                 usage: bool = True, after: Turn | None = None, uds: str | None = None, health_delay: float = 0.0):
        self.turns, self.model, self.max_context, self.usage = list(turns), model, max_context, usage
        self.after = after if after is not None else fail(400, "the script has no more turns")
        self.requests: list[dict] = []  # chat/messages request bodies, in order
        self.paths: list[str] = []  # every request path, in order
        self.headers: list[dict] = []
        self.errors: list[str] = []  # turns that raised
        self.probes: list[dict] = []  # the client's tools probes (reviewer.llm.serverinfo): answered, never scripted
        self.uds, self.health_delay, self.started_at = uds, health_delay, time.monotonic()
        self.app = self._make_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        return f"unix://{self.uds}" if self.uds else f"http://127.0.0.1:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def next_reply(self, body: dict) -> Reply:
        """The scripted answer; a turn that raises (a failed assertion about the request) is remembered in `errors`
        and answered with a 400, which the client does not retry; the fixture re-raises it at teardown."""
        index = len(self.requests) - 1
        turn = self.turns[index] if index < len(self.turns) else self.after
        if not callable(turn):
            return turn
        try:
            return turn(body)
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"turn {index}: {type(e).__name__}: {e}")
            return fail(400, f"scripted turn {index} failed: {type(e).__name__}: {e}")

    # --- HTTP ---

    def _make_app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def record(request: Request, call_next):
            self.paths.append(request.url.path)
            self.headers.append(dict(request.headers))
            return await call_next(request)

        @app.get("/health")
        async def health():
            if time.monotonic() - self.started_at < self.health_delay:
                return JSONResponse({"status": "loading"}, status_code=503)
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            entry = {"id": self.model, "object": "model", "created": 0, "owned_by": "scripted"}
            if self.max_context:
                entry["max_context"] = self.max_context
            return {"object": "list", "data": [entry]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            if body.get("messages") == TOOLS_PROBE_MESSAGES:
                self.probes.append(body)
                return self._openai_response(body, text("OK"))
            self.requests.append(body)
            reply = self.next_reply(body)
            if reply.delay:
                await asyncio.sleep(reply.delay)
            if reply.status != 200:
                return JSONResponse({"error": {"message": reply.error, "type": "scripted"}}, status_code=reply.status,
                                    headers=reply.headers)
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage")) and self.usage
                return StreamingResponse(self._openai_stream(body, reply, include_usage),
                                         media_type="text/event-stream")
            return self._openai_response(body, reply)

        @app.post("/v1/messages")
        async def messages(request: Request):
            body = await request.json()
            self.requests.append(body)
            reply = self.next_reply(body)
            if reply.delay:
                await asyncio.sleep(reply.delay)
            if reply.status != 200:
                return JSONResponse({"type": "error", "error": {"type": "api_error", "message": reply.error}},
                                    status_code=reply.status, headers=reply.headers)
            if body.get("stream"):
                return StreamingResponse(self._anthropic_stream(body, reply), media_type="text/event-stream")
            return self._anthropic_message(body, reply)

        return app

    # --- OpenAI format ---

    @staticmethod
    def _calls(reply: Reply) -> list[tuple[str, str, str]]:
        out = []
        for i, c in enumerate(reply.tool_calls):
            args = c["arguments"] if isinstance(c["arguments"], str) else json.dumps(c["arguments"])
            out.append((f"call_{i}_{time.monotonic_ns() % 10**8}", c["name"], args))
        return out

    def _usage(self, body: dict, reply: Reply) -> dict:
        prompt = sum(count_tokens(body[key]) for key in ("messages", "system", "tools") if body.get(key))
        completion = count_tokens(reply.content + "".join(json.dumps(c) for c in reply.tool_calls))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _finish_reason(self, reply: Reply) -> str:
        return reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")

    def _openai_response(self, body: dict, reply: Reply) -> dict:
        message: dict = {"role": "assistant", "content": reply.content or None}
        calls = self._calls(reply)
        if calls:
            message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                     for i, n, a in calls]
        out = {"id": "chatcmpl-scripted", "object": "chat.completion", "created": int(time.time()),
               "model": self.model, "choices": [{"index": 0, "message": message,
                                                 "finish_reason": self._finish_reason(reply)}]}
        if self.usage:
            out["usage"] = self._usage(body, reply)
        return out

    async def _openai_stream(self, body: dict, reply: Reply, include_usage: bool):
        def chunk(delta: dict | None, finish: str | None = None, usage: dict | None = None) -> str:
            data = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": self.model,
                    "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if usage:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        yield chunk({"role": "assistant", "content": ""})
        if reply.content:
            for piece in chunks_of(reply.content, reply.pieces):
                if reply.chunk_delay:
                    await asyncio.sleep(reply.chunk_delay)
                yield chunk({"content": piece})
        for index, (call_id, name, args) in enumerate(self._calls(reply)):
            yield chunk({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                         "function": {"name": name, "arguments": ""}}]})
            for piece in chunks_of(args):
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        yield chunk({}, self._finish_reason(reply))
        if include_usage:
            yield chunk(None, usage=self._usage(body, reply))
        yield "data: [DONE]\n\n"

    # --- Anthropic format ---

    def _anthropic_blocks(self, reply: Reply) -> list[dict]:
        blocks = [{"type": "text", "text": reply.content}] if reply.content else []
        for call_id, name, args in self._calls(reply):
            blocks.append({"type": "tool_use", "id": call_id.replace("call", "toolu"), "name": name,
                           "input": json.loads(args)})
        return blocks

    def _anthropic_stop(self, reply: Reply) -> str:
        return {"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens"}[self._finish_reason(reply)]

    def _anthropic_message(self, body: dict, reply: Reply) -> dict:
        usage = self._usage(body, reply)
        return {"id": "msg_scripted", "type": "message", "role": "assistant", "model": self.model,
                "content": self._anthropic_blocks(reply), "stop_reason": self._anthropic_stop(reply),
                "stop_sequence": None,
                "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}

    async def _anthropic_stream(self, body: dict, reply: Reply):
        def event(name: str, data: dict) -> str:
            return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

        usage = self._usage(body, reply)
        start = self._anthropic_message(body, reply) | {"content": [], "stop_reason": None}
        start["usage"] = {"input_tokens": usage["prompt_tokens"], "output_tokens": 1}
        yield event("message_start", {"message": start})
        for index, block in enumerate(self._anthropic_blocks(reply)):
            if block["type"] == "text":
                yield event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                for piece in chunks_of(block["text"]):
                    yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": piece}})
            else:
                yield event("content_block_start", {"index": index, "content_block": block | {"input": {}}})
                for piece in chunks_of(json.dumps(block["input"])):
                    yield event("content_block_delta",
                                {"index": index, "delta": {"type": "input_json_delta", "partial_json": piece}})
            yield event("content_block_stop", {"index": index})
        yield event("message_delta", {"delta": {"stop_reason": self._anthropic_stop(reply), "stop_sequence": None},
                                      "usage": {"output_tokens": usage["completion_tokens"]}})
        yield event("message_stop", {})

    # --- lifecycle ---

    def start(self) -> ScriptedLLM:
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", uds=self.uds)
        self._server = uvicorn.Server(config)
        sockets = None
        if not self.uds:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
            sockets = [sock]
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": sockets}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the scripted LLM server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)

    def __enter__(self) -> ScriptedLLM:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture
def scripted_llm():
    """`scripted_llm(turns, **options) -> ScriptedLLM` (started; stopped after the test)."""
    servers: list[ScriptedLLM] = []

    def start(turns: list[Turn], **options) -> ScriptedLLM:
        server = ScriptedLLM(turns, **options).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
    errors = [e for server in servers for e in server.errors]
    if errors:
        pytest.fail("a scripted turn raised: " + "; ".join(errors), pytrace=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a scripted model that finishes at once.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--health-delay", type=float, default=0.0, help="answer /health 503 for this long")
    parser.add_argument("--exit-after", type=float, default=None, help="exit with code 3 after this many seconds")
    parser.add_argument("--max-context", type=int, default=4096)
    args = parser.parse_args(argv)
    print(f"scripted LLM on port {args.port}", flush=True)
    if args.exit_after is not None:
        time.sleep(args.exit_after)
        print("scripted LLM: failing on purpose", flush=True)
        sys.exit(3)
    server = ScriptedLLM([], after=tool("finish", summary="scripted finish"), health_delay=args.health_delay,
                         max_context=args.max_context)
    config = uvicorn.Config(server.app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="off")
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
