"""The reviewer against a REAL llama.cpp server (llama-server, as the xllamacpp wheel from PyPI runs it: no compile)
on the embedded GGUF, through the official openai SDK on real sockets (issue 43: `make test` reviews through a peer
without the 20-minute llama-cpp-python build). Nothing about the server is mocked: the window it reports in /props,
its 400 for a prompt past that window, the `tools` SmolLM2's template drops and the usage it streams are what it
really does. llama-cpp-python's own server, which behaves differently on each of these, is
test_peer_backends.py's (`make test-peer`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from typer.testing import CliRunner

from reviewer.cli import app
from reviewer.config import Settings
from reviewer.examples import make_example_repo
from reviewer.llm.embedded import free_port, log_tail, stop_process
from reviewer.llm.endpoints import open_llm
from reviewer.llm.errors import ContextOverflow, ToolsUnsupported
from reviewer.persona.tools import TOOLS

N_CTX = 4096
HELLO = [{"role": "user", "content": "Say hello in five words."}]
PROSE = [{"role": "user", "content": "Summarise: " + "The quick brown fox jumps over the lazy dog near the river. " * 30}]
# About 1.5 tokens per word for SmolLM2's tokenizer: well past N_CTX.
TOO_LONG = [{"role": "user", "content": "Please summarise the following notes. " + "alpha beta gamma delta " * 1500}]
# llama-server in a process of its own, as `llama-server -m GGUF -c N_CTX --port PORT -t THREADS` starts it.
SERVER = ("import sys, time, xllamacpp as x; p = x.CommonParams(); p.model.path = sys.argv[1]; p.n_ctx = int(sys.argv[2]);"
          " p.port = int(sys.argv[3]); p.cpuparams.n_threads = int(sys.argv[4]); s = x.Server(p);"
          " print('listening', s.listening_address, flush=True)\n"
          "while True: time.sleep(3600)")
runner = CliRunner()


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    pytest.importorskip("xllamacpp", reason="xllamacpp is not installed (`make setup` installs it: .[backend])")
    from backend.loading import embedded_gguf_path

    port = free_port()
    log = tmp_path_factory.mktemp("llama_server") / "llama_server.log"
    command = [sys.executable, "-c", SERVER, str(embedded_gguf_path()), str(N_CTX), str(port),
               str(min(2, os.cpu_count() or 1))]
    # Spinning OpenMP threads on a shared CPU cost 5-10x (test_peer_backends.py measured it for llama.cpp too).
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"llama-server exited with {proc.returncode}:\n{log_tail(log)}"
            try:
                if httpx.get(url + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"llama-server not ready after 180 s:\n{log_tail(log)}"
            time.sleep(0.3)
        yield url
    finally:
        stop_process(proc)


def test_the_window_comes_from_props_and_an_overflow_names_it(llama_server):
    sdk = openai.OpenAI(base_url=llama_server, api_key="none", max_retries=0)
    model = sdk.models.list().data[0].id
    # What the server does: a 400 that names the window, streamed or not.
    with pytest.raises(openai.BadRequestError, match=f"exceeds the available context size \\({N_CTX} tokens\\)"):
        sdk.chat.completions.create(model=model, messages=TOO_LONG, max_tokens=8)
    # What the reviewer makes of it: the window from /props, no warning, and a ContextOverflow in the server's words.
    with open_llm(Settings(llm=[llama_server])) as llm:
        assert (llm.context_window, llm.context_source, llm.notes) == (N_CTX, "/props n_ctx", [])
        with pytest.raises(ContextOverflow) as caught:
            llm.chat(TOO_LONG, max_tokens=8)
        assert f"exceeds the available context size ({N_CTX} tokens)" in str(caught.value)
        assert caught.value.window == N_CTX


def test_tools_the_template_drops_are_found_and_usage_is_the_servers(llama_server):
    with open_llm(Settings(llm=[llama_server])) as llm:
        with pytest.raises(ToolsUnsupported, match="does not show the model the `tools`"):
            llm.chat(HELLO, TOOLS, max_tokens=16, temperature=0)
        assert llm.tools == "dropped", llm.tools_evidence
        streamed = llm.chat(PROSE, max_tokens=16, temperature=0)
        assert streamed.content and not streamed.usage_estimated  # llama-server streams its usage when asked
        llm.stream = False
        counted = llm.chat(PROSE, max_tokens=16, temperature=0)
        assert counted.prompt_tokens == streamed.prompt_tokens and counted.completion_tokens > 0


def test_a_review_through_llama_server_end_to_end(llama_server, tmp_path, monkeypatch):
    monkeypatch.setenv("REVIEWER_LOCK_FILE", str(tmp_path / "review.lock"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    repo = make_example_repo(tmp_path / "tinystats")
    reviews = tmp_path / "reviews.db"
    personas = tmp_path / "personas"
    personas.mkdir()
    docs = (Path(__file__).resolve().parents[3] / "personas" / "docs.md").read_text()
    # The built-in docs persona, with replies kept short: these tests are about the plumbing, not a 135M model's review.
    (personas / "docs.md").write_text(docs.replace("  temperature: 0.2\n", "  temperature: 0.0\n  max_tokens: 48\n"))
    result = runner.invoke(app, ["run", str(repo), "--db", str(reviews), "--persona", "docs", "--llm", llama_server,
                                 "--personas-dir", str(personas), "--max-steps", "2", "--timeout", "400"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "does not say its context window" not in out
    assert "docs note: the LLM at " + llama_server + " does not show the model the `tools`" in out
    assert "docs step 1:" in out and "tok/s (estimated)" not in out
    run = json.loads(runner.invoke(app, ["report", "--db", str(reviews), "--format", "json"]).output)["runs"][0]
    [persona] = run["personas"]
    assert persona["tokens_estimated"] is False and persona["status"] in ("step_budget", "completed")
    assert persona["prompt_tokens"] > 0 and persona["completion_tokens"] > 0
