"""Peer backends as users run them (issue 30): the reviewer against a REAL llama-cpp-python OpenAI server
(`python -m llama_cpp.server`) on the embedded GGUF, through the official openai SDK on real sockets. Nothing about
the server is mocked: its empty answer to an overflowing stream, its silence about its context window, the `tools`
it drops and the usage it does not stream are what it really does. `make peer-server` builds llama-cpp-python into
the virtual environment (`make test-peer` does it once and runs this file; CI does); without it these tests skip and
say so. `make test` reviews through llama.cpp's own llama-server instead, which needs no compile
(test_llama_server_peer.py).

A few tests at the end use the scripted server instead, for what llama-cpp-python cannot show: the llama-server and
vLLM ways of telling the context window, a server whose model does see the tools, and an old database."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from typer.testing import CliRunner

from reviewer.store import db
from reviewer.persona.agent import run_agent
from reviewer.cli import app
from reviewer.config import Settings
from reviewer.llm.embedded import free_port, log_tail, stop_process
from reviewer.examples import make_example_repo
from reviewer.llm.endpoints import open_llm
from reviewer.llm.errors import ContextOverflow, ToolsUnsupported
from reviewer.persona.files import Persona
from reviewer.sandbox.command import sandbox_env
from reviewer.persona.tools import TOOLS
from reviewer.sandbox.workspace import Workspace
from tests.scripted_llm import scripted_llm, text, tool  # noqa: F401  (scripted_llm is a fixture)

N_CTX = 4096  # what the peer server is started with; the reviewer is not told
DEFAULT_N_CTX = 2048  # llama-cpp-python's own default, when started without --n_ctx
HELLO = [{"role": "user", "content": "Say hello in five words."}]
PROSE = [{"role": "user", "content": "Summarise: " + "The quick brown fox jumps over the lazy dog near the river. " * 30}]
# Digits cost SmolLM2's tokenizer about one token for two characters, the reviewer's estimate one for 3.5: a task that
# the estimate fits into the assumed 8192-token window but that is ~6000 real tokens, past the server's 4096.
DIGITS = "Background numbers: " + "1 2 3 4 5 6 7 8 9 0 " * 600
# A persona that keeps its replies short: SmolLM2 writes until max_tokens, and these tests are about the plumbing.
TERSE = {"max_tokens": 32, "temperature": 0.0}
# About 1.5 tokens per word for SmolLM2's tokenizer: well past N_CTX, far below the 8192 the reviewer assumes.
TOO_LONG = [{"role": "user", "content": "Please summarise the following notes. " + "alpha beta gamma delta " * 1500}]
runner = CliRunner()


class Peer:
    def __init__(self, url: str, log: Path):
        self.url, self.log = url, log


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    """llama-cpp-python's server on the embedded SmolLM2 GGUF, as a user starts it, with a 4096-token window."""
    yield from serve_peer(tmp_path_factory, ["--n_ctx", str(N_CTX)])


@pytest.fixture(scope="module")
def default_peer(tmp_path_factory):
    """The same server with its default window (2048): small prompts keep the slow tests short."""
    yield from serve_peer(tmp_path_factory, [])


def serve_peer(tmp_path_factory, options: list[str]):
    # The server module, not just the bindings: a llama_cpp installed without its [server] extra (as another
    # package's dependency) cannot serve, and `make test-peer` is what installs the extra.
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python[server] is not installed: `make test-peer` "
                                                       "builds it and runs these tests")
    from backend.loading import embedded_gguf_path

    port = free_port()
    log = tmp_path_factory.mktemp("peer") / "llama_cpp_server.log"
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(embedded_gguf_path()), *options,
               "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(min(2, os.cpu_count() or 1)),
               "--seed", "0"]
    # On a CPU shared with other jobs llama.cpp's OpenMP threads spin-wait for each other: measured here, 32 tokens
    # after an 815-token prompt took 126 s with 2 threads, 23 s with 1, 13.6 s with 2 and a passive wait policy.
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"llama_cpp.server exited with {proc.returncode}:\n{log_tail(log)}"
            try:
                if httpx.get(url + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"llama_cpp.server not ready after 180 s:\n{log_tail(log)}"
            time.sleep(0.3)
        yield Peer(url, log)
    finally:
        stop_process(proc)


def opened(peer: Peer, **settings):
    """The reviewer's client for the peer, and the notes it would print in the run's log."""
    return open_llm(Settings(llm=[peer.url], **settings))


# --- 1. a stream that ends without a word ---------------------------------------------------------------------------

def test_an_overflowing_stream_is_a_context_overflow_in_the_servers_words(peer):
    sdk = openai.OpenAI(base_url=peer.url, api_key="none", max_retries=0)
    model = sdk.models.list().data[0].id
    # What the server does: no answer to the stream (HTTP 200 and no chunk with older sse-starlette, a connection
    # reset with the 3.x here); the same request unstreamed is a clear 400.
    try:
        with sdk.chat.completions.create(model=model, messages=TOO_LONG, stream=True, max_tokens=8) as stream:
            got = list(stream)
    except openai.APIConnectionError:
        got = None
    assert got in (None, [])
    fresh = openai.OpenAI(base_url=peer.url, api_key="none", max_retries=0)  # that connection may be left broken
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {N_CTX} tokens"):
        fresh.chat.completions.create(model=model, messages=TOO_LONG, max_tokens=8)
    # What the reviewer makes of it: a ContextOverflow carrying those words, and the window it names.
    with opened(peer) as llm:
        notes = []
        llm.on_note = notes.append
        assert llm.context_window == 8192 and llm.context_source == "assumed"
        with pytest.raises(ContextOverflow) as caught:
            llm.chat(TOO_LONG, max_tokens=8)
        assert f"maximum context length is {N_CTX} tokens" in str(caught.value)
        assert ("its streamed answer had ended with no chunks" if got == [] else
                "its streamed answer had ended with a dropped connection after 0 chunks") in str(caught.value)
        assert caught.value.window == N_CTX and llm.context_window == N_CTX
        assert notes == [f"the LLM at {peer.url} says its context window is {N_CTX} tokens (not 8192): "
                         "conversations are trimmed to it from now on"]


def test_the_agent_trims_the_conversation_to_the_window_the_server_names(default_peer, tmp_path):
    # A task that fits the assumed 8192 tokens but not the server's default 2048: the first request overflows, the
    # agent learns the window from the server's 400 and trims the task to fit, and the persona goes on.
    peer = default_peer
    task = "Review the repository in your working directory.\n" + DIGITS
    persona = Persona(name="tester", description="test", system_prompt="You are a careful tester.", max_steps=1,
                      model_settings=dict(TERSE))
    saves, notes = [], []

    class Recorder:
        def record_finding(self, **kwargs):
            return 1

        def record_measurement(self, **kwargs):
            return 1

        def save_transcript(self, messages, **counts):
            saves.append({"messages": messages, **counts})

    with opened(peer) as llm:
        result = run_agent(persona, workspace(tmp_path), llm, Recorder(), max_steps=1, timeout=300, task=task,
                           on_note=notes.append)
        assert llm.context_window == DEFAULT_N_CTX
    assert result.status == "step_budget", result.error  # one reply came: the conversation was made to fit
    assert result.steps == 1 and result.completion_tokens > 0
    assert len(saves[-1]["messages"][1]["content"]) == len(task)  # the transcript keeps the whole task
    # The first reply (with `tools`) had no tool call, so the endpoint was probed: llama.cpp drops them.
    assert any("does not show the model the `tools`" in n for n in notes), notes
    assert "<tool_call>" in saves[-1]["messages"][0]["content"]  # the tools are now described in the system prompt


# --- 2. the context window ------------------------------------------------------------------------------------------

def test_a_server_that_does_not_say_its_window_gets_a_warning_and_the_flag_fixes_it(peer):
    with opened(peer) as llm:
        [note] = llm.notes
        assert (llm.context_window, llm.context_source) == (8192, "assumed")
        assert "does not say its context window" in note and "--context-window N" in note
        assert "context_window in reviewer.toml" in note
    with opened(peer, context_window=N_CTX) as llm:
        assert (llm.context_window, llm.context_source, llm.notes) == (N_CTX, "configured", [])


# --- 3. tools the server drops --------------------------------------------------------------------------------------

def test_tools_the_server_drops_are_found_by_the_probe(peer):
    with opened(peer) as llm:
        assert llm.tools == "untested"
        with pytest.raises(ToolsUnsupported) as caught:
            llm.chat(HELLO, TOOLS, max_tokens=16, temperature=0)
        message = str(caught.value)
        assert llm.tools == "dropped", llm.tools_evidence
        assert "does not show the model the `tools`" in message and "with the tool schemas and without them" in message
        assert "tool calls are written as text from now on" in message
        start = time.monotonic()
        with pytest.raises(ToolsUnsupported):  # known now: no request is sent
            llm.chat(HELLO, TOOLS, max_tokens=16)
        assert time.monotonic() - start < 0.5
        assert llm.chat(HELLO, None, max_tokens=16, temperature=0).content  # without tools it answers


# --- 4. estimated token counts --------------------------------------------------------------------------------------

def test_streamed_counts_are_estimates_and_unstreamed_ones_are_the_servers(peer):
    with opened(peer) as llm:
        streamed = llm.chat(PROSE, max_tokens=16, temperature=0)
        assert streamed.usage_estimated  # llama-cpp-python streams no usage, whatever stream_options say
        llm.stream = False
        counted = llm.chat(PROSE, max_tokens=16, temperature=0)
        assert not counted.usage_estimated and counted.prompt_tokens > 0 and counted.completion_tokens > 0
        # The estimate counts what the model reads (not the request's JSON): the right range for prose.
        assert 0.7 < streamed.prompt_tokens / counted.prompt_tokens < 1.5, (streamed.prompt_tokens,
                                                                            counted.prompt_tokens)


def test_a_review_through_the_peer_marks_its_counts_estimated_and_says_why(peer, tmp_path, monkeypatch):
    monkeypatch.setenv("REVIEWER_LOCK_FILE", str(tmp_path / "review.lock"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    repo = make_example_repo(tmp_path / "tinystats")
    reviews = tmp_path / "reviews.db"
    personas = tmp_path / "personas"
    personas.mkdir()
    docs = (Path(__file__).resolve().parents[3] / "personas" / "docs.md").read_text()
    # The built-in docs persona, with replies kept short.
    (personas / "docs.md").write_text(docs.replace("  temperature: 0.2\n", "  temperature: 0.0\n  max_tokens: 48\n"))
    result = runner.invoke(app, ["run", str(repo), "--db", str(reviews), "--persona", "docs", "--llm", peer.url,
                                 "--personas-dir", str(personas), "--max-steps", "2", "--timeout", "400"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "note: the LLM at " + peer.url + " does not say its context window" in out
    assert "docs note: the LLM at " + peer.url + " does not show the model the `tools`" in out
    assert "tok/s (estimated)" in out  # the step lines: tok/s from estimates is marked
    run = json.loads(runner.invoke(app, ["report", "--db", str(reviews), "--format", "json"]).output)["runs"][0]
    [docs] = run["personas"]
    assert docs["tokens_estimated"] is True and docs["status"] in ("step_budget", "completed")
    table = runner.invoke(app, ["report", "--db", str(reviews)]).output
    assert "(estimated)" in table


# --- what llama-cpp-python cannot show: other servers' ways, through the scripted server ----------------------------

def test_the_window_from_llama_servers_props_or_slots_and_vllms_max_model_len(scripted_llm):
    server = scripted_llm([], max_context=None)
    props = {"default_generation_settings": {"n_ctx": 3072}, "total_slots": 1}  # llama-server's /props
    server.app.get("/props")(lambda: props)
    with open_llm(Settings(llm=[server.base_url])) as llm:
        assert (llm.context_window, llm.context_source, llm.notes) == (3072, "/props n_ctx", [])
    props.clear()  # a llama-server without n_ctx in /props: /slots (one entry per slot) says it
    server.app.get("/slots")(lambda: [{"id": 0, "n_ctx": 1536}])
    with open_llm(Settings(llm=[server.base_url])) as llm:
        assert (llm.context_window, llm.context_source) == (1536, "/slots n_ctx")
    vllm = scripted_llm([], max_context=None)
    original = vllm.app.router.routes[:]
    vllm.app.router.routes[:] = [r for r in original if getattr(r, "path", "") != "/v1/models"]
    vllm.app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "Qwen/Qwen3-8B", "object": "model",
                                                                    "max_model_len": 40960}]})
    with open_llm(Settings(llm=[vllm.base_url])) as llm:
        assert (llm.model, llm.context_window, llm.context_source) == ("Qwen/Qwen3-8B", 40960, "max_model_len")


def test_a_server_whose_model_sees_the_tools_is_probed_once_and_left_alone(scripted_llm):
    server = scripted_llm([text("no call here"), text("nor here")])
    with open_llm(Settings(llm=[server.base_url])) as llm:
        assert llm.chat(HELLO, TOOLS).content == "no call here"
        assert llm.tools == "seen" and "the tool schemas added" in llm.tools_evidence
        assert llm.chat(HELLO, TOOLS).content == "nor here"
    assert len(server.probes) == 2  # one probe (with and without the schemas), for the first reply only
    assert "tools" not in server.probes[0] and server.probes[1]["tools"] == TOOLS


def test_a_stream_cut_before_its_finish_reason_is_asked_again_unstreamed(scripted_llm):
    # A stream with chunks but no finish reason (a server that died mid-reply): the same request unstreamed answers.
    server = scripted_llm([], after=text("the whole answer"))
    original = server._openai_stream

    async def cut(body, reply, include_usage):
        async for piece in original(body, reply, include_usage):
            if '"finish_reason": "stop"' in piece or '"finish_reason":"stop"' in piece:
                return
            yield piece

    server._openai_stream = cut
    with open_llm(Settings(llm=[server.base_url])) as llm:
        reply = llm.chat(HELLO)
    assert reply.content == "the whole answer" and not reply.usage_estimated
    assert [bool(r.get("stream")) for r in server.requests] == [True, False]


def test_an_old_database_gains_the_estimated_column_and_keeps_its_rows(tmp_path):
    path = tmp_path / "v3.db"
    with db.session(str(path)) as s:
        repo = db.get_or_create_repository(s, "file:///old")
        run = db.ReviewRun(repository_id=repo.id, status="completed")
        s.add(run)
        s.flush()
        s.add(db.PersonaRun(run_id=run.id, persona="docs", status="completed", prompt_tokens=10, completion_tokens=5,
                            llm_seconds=1.0))
        s.commit()
    db._engines.clear()
    con = sqlite3.connect(path)  # make it a v3 database: no tokens_estimated column
    con.execute("ALTER TABLE personarun DROP COLUMN tokens_estimated")
    con.execute("UPDATE meta SET value='3' WHERE key='schema_version'")
    con.commit()
    con.close()
    result = runner.invoke(app, ["report", "--db", str(path), "--format", "json"])
    assert result.exit_code == 0, result.output
    [persona] = json.loads(result.output)["runs"][0]["personas"]
    assert (persona["prompt_tokens"], persona["tokens_estimated"]) == (10, None)  # old rows did not say
    con = sqlite3.connect(path)
    assert "tokens_estimated" in {r[1] for r in con.execute("PRAGMA table_info(personarun)")}
    assert con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(db.SCHEMA_VERSION)
    db._engines.clear()


def test_a_bad_tool_format_is_one_line(tmp_path):
    (tmp_path / "odd.md").write_text("---\nname: odd\ndescription: x\nmodel:\n  tool_format: xml\n---\nbody\n")
    result = runner.invoke(app, ["personas", "--personas-dir", str(tmp_path)])
    assert result.exit_code == 2 and "model.tool_format must be native or text, got 'xml'" in result.output
    assert "Traceback" not in result.output


# --- 5. `reviewer bench` says which numerics it ran ------------------------------------------------------------------

def test_bench_names_its_numerics_and_the_cpu():
    torch = pytest.importorskip("torch")
    from backend.bench.report import cpu_model, format_table, numerics
    from backend.loading import cpu_has_bf16_matmul

    amx = cpu_has_bf16_matmul()
    assert numerics("cpu", torch.float32) == f"fp32, CPU {'with' if amx else 'without'} AMX"
    assert numerics("cpu", torch.bfloat16) == ("bf16 with AMX" if amx else
                                               "bf16 without AMX (slow bf16 matmuls on this CPU)")
    assert numerics("cuda", torch.bfloat16) == "bf16 on CUDA"
    if Path("/proc/cpuinfo").exists():
        assert cpu_model() and cpu_model() != "x86_64"
    record = {"date": "2026-12-01", "machine": {"device": "cpu", "cpu": cpu_model(), "torch_threads": 2},
              "model": {"name": "m", "class": "C", "layers": 1, "params_m": 1.0, "dtype": "float32"},
              "drafter": {"source": "none"}, "numerics": numerics("cpu", torch.float32), "prompts": 1,
              "max_tokens": 4, "runs": {}, "L_target_ms": 1.0}
    assert f"numerics {numerics('cpu', torch.float32)}" in format_table(record).splitlines()


def workspace(tmp_path: Path) -> Workspace:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "README.md").write_text("# demo\n\nA tiny project.\n")
    for folder in ("home", "tmp"):
        (tmp_path / folder).mkdir()
    return Workspace(root=root, venv=tmp_path / "venv", env=sandbox_env(home=tmp_path / "home", tmp=tmp_path / "tmp"),
                     commit="0" * 40, command_timeout=60)
