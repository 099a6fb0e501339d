"""The LLM client against the scripted model through the official openai and anthropic SDKs on real sockets, and the
embedded-backend launcher against real subprocesses."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from reviewer.config import Settings
from reviewer.llm.anthropic_chat import to_anthropic_messages
from reviewer.llm.client import FailoverClient
from reviewer.llm.endpoints import open_llm
from reviewer.llm.errors import CallTimedOut, ContextOverflow, EndpointDown, LLMError, ToolsUnsupported
from reviewer.persona.tools import TOOLS
from tests.scripted_llm import (Reply, ScriptedLLM, fail, scripted_llm, text,  # noqa: F401  (scripted_llm: a fixture)
                                tool)

ROOT = Path(__file__).resolve().parents[3]
SCRIPTED_SERVER = [sys.executable, str(ROOT / "tests" / "scripted_llm.py"), "--port", "{port}"]
HELLO = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def dead_url() -> str:
    """A port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def fast(llm):
    llm.retry.base_delay = 0.01
    return llm


@pytest.mark.parametrize("stream", [True, False])
def test_chat_assembles_tool_calls_and_reports_usage(scripted_llm, stream):
    server = scripted_llm([tool("bash", command="pytest -q --maxfail=1"), text("plain words here")])
    pieces = []
    with open_llm(Settings(llm=[server.base_url])) as llm:
        llm.stream = stream
        assert (llm.name, llm.model, llm.context_window) == (server.base_url, "scripted-model", 32768)
        r = llm.chat(HELLO, TOOLS, on_delta=pieces.append, temperature=0.2, max_tokens=64, top_k=5)
        [call] = r.tool_calls
        assert (call.name, call.arguments) == ("bash", {"command": "pytest -q --maxfail=1"})
        assert r.finish_reason == "tool_calls" and not r.usage_estimated
        assert r.prompt_tokens == len(json.dumps(HELLO)) // 4 + len(json.dumps(TOOLS)) // 4
        r2 = llm.chat(HELLO, None, on_delta=pieces.append)
        assert r2.content == "plain words here" and r2.tool_calls == [] and r2.finish_reason == "stop"
    if stream:  # the arguments arrived in several pieces and were seen live
        assert len(pieces) > 3 and "".join(pieces) == call.raw_arguments + "plain words here"
        assert server.requests[0]["stream_options"] == {"include_usage": True}
    first = server.requests[0]
    assert first["temperature"] == 0.2 and first["max_tokens"] == 64 and first["top_k"] == 5  # extras in the body
    assert first["model"] == "scripted-model" and first["tools"] == TOOLS and first["messages"] == HELLO


def test_usage_is_estimated_when_the_server_sends_none(scripted_llm):
    server = scripted_llm([text("a reply of some length")], usage=False)
    with open_llm(Settings(llm=[server.base_url])) as llm:
        r = llm.chat(HELLO)
    assert r.usage_estimated and r.prompt_tokens > 0 and r.completion_tokens > 0


def test_model_and_context_window_from_settings_or_defaults(scripted_llm):
    server = scripted_llm([], max_context=None)
    with open_llm(Settings(llm=[server.base_url], model="other-model")) as llm:
        assert llm.model == "other-model" and llm.context_window == 8192  # unknown local server: the default


def test_base_url_without_v1_and_the_bearer_key(scripted_llm, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-must-not-leak")
    server = scripted_llm([text("ok")])
    with open_llm(Settings(llm=[server.root_url], api_key="our-backend-key")) as llm:
        assert llm.chat(HELLO).content == "ok"
    assert server.paths == ["/v1/models", "/v1/chat/completions"]
    assert {h["authorization"] for h in server.headers} == {"Bearer our-backend-key"}


def test_unreachable_url_is_one_clear_line():
    url = dead_url()
    with pytest.raises(EndpointDown) as e:
        with open_llm(Settings(llm=[url])):
            pass
    assert str(e.value).startswith(f"cannot reach the LLM at {url}") and "\n" not in str(e.value)


def test_a_time_limit_cuts_a_call_that_keeps_streaming(scripted_llm):
    """An SDK's timeout is per read: a model that streams a piece every 0.2 s never trips it. The wall-clock limit
    does, under way: 60 pieces (12 s of stream) cut at 1.5 s, the pieces seen so far delivered, the next request
    served at once."""
    server = scripted_llm([Reply(content="abc" * 60, chunk_delay=0.2, pieces=60), text("next one")])
    pieces = []
    with open_llm(Settings(llm=[server.base_url])) as llm:
        with pytest.raises(CallTimedOut, match="time limit cut the call"):
            llm.chat(HELLO, on_delta=pieces.append, request_timeout=1.5)
        seen = len(pieces)
        assert 0 < seen < 30
        assert llm.chat(HELLO, request_timeout=30).content == "next one"
    assert len(pieces) == seen  # the abandoned stream delivers nothing after the cut


def test_cli_run_with_an_unreachable_llm_exits_non_zero_with_one_line(tmp_path):
    from reviewer.examples import make_example_repo

    repo = make_example_repo(tmp_path / "tinystats")
    proc = subprocess.run([sys.executable, "-m", "reviewer.cli", "run", str(repo), "--persona", "correctness",
                           "--llm", dead_url(), "--db", str(tmp_path / "r.db")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "cannot reach the LLM" in proc.stderr + proc.stdout and "Traceback" not in proc.stderr
    assert len((proc.stderr + proc.stdout).strip().splitlines()) == 1


def test_transient_errors_are_retried_with_backoff(scripted_llm):
    server = scripted_llm([fail(500, "overloaded"), fail(429, "slow down", {"retry-after": "0"}),
                           fail(503, "warming up"), text("finally")])
    with open_llm(Settings(llm=[server.base_url])) as llm:
        assert fast(llm).chat(HELLO).content == "finally"
    assert len(server.requests) == 4


def test_retries_give_up_with_one_line(scripted_llm):
    server = scripted_llm([], after=fail(500, "still broken"))
    with open_llm(Settings(llm=[server.base_url])) as llm:
        with pytest.raises(LLMError, match="kept failing \\(HTTP 500\\): still broken"):
            fast(llm).chat(HELLO)
    assert len(server.requests) == llm.retry.attempts


def test_auth_errors_are_not_retried(scripted_llm):
    server = scripted_llm([fail(401, "invalid api key")])
    with open_llm(Settings(llm=[server.base_url])) as llm:
        with pytest.raises(LLMError, match="refused the API key \\(HTTP 401\\): invalid api key"):
            llm.chat(HELLO)
    assert len(server.requests) == 1


def test_context_overflow_and_tools_unsupported_are_told_apart(scripted_llm):
    server = scripted_llm([fail(400, "This model's maximum context length is 8192 tokens"),
                           fail(400, "tools param requires --jinja flag"), fail(400, "bad temperature")])
    with open_llm(Settings(llm=[server.base_url])) as llm:
        with pytest.raises(ContextOverflow):
            llm.chat(HELLO, TOOLS)
        with pytest.raises(ToolsUnsupported):
            llm.chat(HELLO, TOOLS)
        with pytest.raises(LLMError, match="rejected the request \\(HTTP 400\\): bad temperature"):
            llm.chat(HELLO, TOOLS)


def test_unix_socket(tmp_path):
    sock = str(tmp_path / "llm.sock")
    with ScriptedLLM([tool("finish", summary="over a socket")], uds=sock) as server:
        with open_llm(Settings(llm=[server.base_url])) as llm:
            assert llm.model == "scripted-model" and llm.context_window == 32768
            assert llm.chat(HELLO, TOOLS).tool_calls[0].arguments == {"summary": "over a socket"}
    with pytest.raises(LLMError, match="no socket at"):
        with open_llm(Settings(llm=[f"unix://{tmp_path}/missing.sock"])):
            pass


def test_failover_skips_dead_endpoints_and_moves_on_when_one_dies(scripted_llm):
    first = scripted_llm([], after=text("from first"))
    second = scripted_llm([], after=text("from second"))
    with open_llm(Settings(llm=[dead_url(), first.base_url, second.base_url])) as llm:
        assert isinstance(llm, FailoverClient) and len(llm.clients) == 2
        assert llm.chat(HELLO).content == "from first"
        first.stop()
        fast(llm.clients[0])
        assert llm.chat(HELLO).content == "from second" and llm.name == second.base_url
    with pytest.raises(LLMError, match="no LLM endpoint could be used"):
        with open_llm(Settings(llm=[dead_url(), dead_url()])):
            pass


def test_each_persona_run_is_routed_to_one_endpoint_in_turn_and_fails_over_when_it_stops(scripted_llm):
    a = scripted_llm([], after=text("from a"))
    b = scripted_llm([], after=text("from b"))
    answer = {a.base_url: "from a", b.base_url: "from b"}
    with open_llm(Settings(llm=[a.base_url, b.base_url])) as pool:
        runs = [pool.route() for _ in range(4)]  # four persona runs
        assert runs[0].name != runs[1].name and [r.name for r in runs[2:]] == [r.name for r in runs[:2]]
        for run in runs:
            for _ in range(3):  # every request of a run goes to the run's endpoint
                assert run.chat(HELLO).content == answer[run.name]
        assert len(a.requests) == len(b.requests) == 6
        a.stop()
        for c in pool.clients:
            fast(c)
        on_a = next(r for r in runs if r.name == a.base_url)
        assert on_a.chat(HELLO).content == "from b" and on_a.name == b.base_url  # moved on in the middle of its run
        later = [pool.route() for _ in range(3)]  # the stopped endpoint is not routed to while it is down
        assert {r.name for r in later} == {b.base_url}
        assert all(r.chat(HELLO).content == "from b" for r in later)
        assert len(a.requests) == 6  # nothing reached the stopped server


def test_unknown_llm_and_missing_keys(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    for spec, message in [("bogus", "unknown --llm 'bogus'"), ("openai", "needs OPENAI_API_KEY"),
                          ("anthropic", "needs ANTHROPIC_API_KEY")]:
        with pytest.raises(LLMError, match=message):
            with open_llm(Settings(llm=[spec])):
                pass


def test_openai_kind_uses_the_environment_and_new_parameter_names(scripted_llm, monkeypatch):
    server = scripted_llm([text("hosted")])
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
    with open_llm(Settings(llm=["openai"])) as llm:
        assert (llm.name, llm.model, llm.context_window) == ("openai", "gpt-4o-mini", 128_000)
        assert llm.chat(HELLO, max_tokens=100).content == "hosted"
    assert server.requests[0]["max_completion_tokens"] == 100 and "max_tokens" not in server.requests[0]
    assert server.headers[-1]["authorization"] == "Bearer sk-test"


@pytest.mark.parametrize("stream", [True, False])
def test_anthropic_through_the_official_sdk(scripted_llm, monkeypatch, stream):
    def after_bash(req):
        assert req["system"] == "be brief" and req["max_tokens"] == 4096
        assert req["tools"][0] == {"name": "bash", "description": TOOLS[0]["function"]["description"],
                                   "input_schema": TOOLS[0]["function"]["parameters"]}
        user = req["messages"][-1]
        assert user["role"] == "user" and user["content"][0]["type"] == "tool_result"
        assert user["content"][0]["content"] == "exit code: 0\nhi"
        return tool("finish", summary="anthropic ok")

    server = scripted_llm([text_then_call(), after_bash])
    monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.root_url)
    pieces = []
    with open_llm(Settings(llm=["anthropic"], model="claude-test")) as llm:
        llm.stream = stream
        r = llm.chat(HELLO, TOOLS, on_delta=pieces.append)
        assert r.content == "Let me check." and r.finish_reason == "tool_calls"
        [call] = r.tool_calls
        assert (call.name, call.arguments) == ("bash", {"command": "echo hi"})
        assert r.prompt_tokens > 0 and r.completion_tokens > 0 and not r.usage_estimated
        history = HELLO + [
            {"role": "assistant", "content": r.content, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "bash", "arguments": call.raw_arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "exit code: 0\nhi"}]
        r2 = llm.chat(history, TOOLS)
        assert r2.tool_calls[0].arguments == {"summary": "anthropic ok"}
    assert server.paths == ["/v1/messages", "/v1/messages"] and "".join(pieces).startswith("Let me check.")
    sent_key = server.headers[0].get("x-api-key") or server.headers[0].get("authorization", "").removeprefix("Bearer ")
    assert sent_key == "test-key" and server.requests[0]["model"] == "claude-test"


def text_then_call():
    """A reply with both words and a tool call."""
    reply = tool("bash", command="echo hi")
    reply.content = "Let me check."
    return reply


def test_anthropic_message_conversion_merges_tool_results():
    messages = [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "task"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
            {"id": "b", "type": "function", "function": {"name": "bash", "arguments": "{broken"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "x"}, {"role": "tool", "tool_call_id": "b", "content": ""},
        {"role": "user", "content": "and now?"},
    ]
    system, out = to_anthropic_messages(messages)
    assert system == "sys"
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[1]["content"] == [{"type": "tool_use", "id": "a", "name": "bash", "input": {"command": "ls"}},
                                 {"type": "tool_use", "id": "b", "name": "bash", "input": {}}]
    assert [b["type"] for b in out[2]["content"]] == ["tool_result", "tool_result", "text"]


# --- the embedded backend launcher, against real subprocesses ---

def test_embedded_launcher_waits_for_health_and_stops_the_backend(tmp_path):
    log = tmp_path / "serve.log"
    command = SCRIPTED_SERVER + ["--health-delay", "1.5", "--max-context", "4096"]
    settings = Settings(llm=["embedded"], workdir=tmp_path)
    with open_llm(settings, command=command, log_path=log) as llm:
        assert llm.name == "embedded" and llm.context_window == 4096
        assert llm.chat(HELLO, TOOLS).tool_calls[0].arguments == {"summary": "scripted finish"}
        port = int(llm.sdk.base_url.port)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    with pytest.raises(httpx.TransportError):  # stopped with the `with` block
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    assert "scripted LLM on port" in log.read_text()


def test_embedded_launcher_reports_a_backend_that_dies(tmp_path):
    command = [sys.executable, "-c", "import sys; print('loading weights'); print('boom: no such model', flush=True);"
               " sys.exit(3)"]
    with pytest.raises(LLMError) as e:
        with open_llm(Settings(llm=["embedded"], workdir=tmp_path), command=command):
            pass
    message = str(e.value)
    assert message.startswith("the embedded LLM backend exited with code 3 before it was ready")
    assert "boom: no such model" in message and str(tmp_path) in message


def test_embedded_launcher_gives_up_on_a_backend_that_never_gets_healthy(tmp_path):
    marker = tmp_path / "still-running"
    command = [sys.executable, "-c", f"import time, pathlib; p = pathlib.Path({str(marker)!r}); p.write_text('x');"
               " time.sleep(60); p.unlink()"]
    with pytest.raises(LLMError, match="not ready after 1 s"):
        with open_llm(Settings(llm=["embedded"], workdir=tmp_path), command=command, ready_timeout=1.0):
            pass
    assert marker.exists()  # it started, and was killed before it could clean up
    out = subprocess.run(["pgrep", "-f", str(marker)], capture_output=True, text=True)
    assert out.stdout.strip() == ""
