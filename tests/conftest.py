"""Shared fixtures: tiny chat models saved in Hugging Face layout (with a real tokenizer and chat template) and a live
inference server on a real socket.

    def test_x(tiny_model, live_server):
        path = tiny_model("llama")                      # random weights, SmolLM2's chat template
        server = live_server(path)                      # TCP on 127.0.0.1; live_server(path, uds=True) for a socket
        openai.OpenAI(base_url=server.base_url, api_key="x").chat.completions.create(...)

A *scripted* tiny model (`tiny_model("llama", template="hermes", script=[...])`) is a real LlamaForCausalLM whose
weights are set so that greedy (and, with its near-one-hot logits, sampled) decoding emits the given tokens after a
chat prompt and then `<|im_end|>`: one-hot embeddings, attention and MLP outputs zeroed, and an LM head that maps each
token to its successor. It lets tests drive tool calls and reasoning through the real engine and server.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

# The deterministic probes (reviewer/persona/probes) add a minute or more to every smoke review of a Python project, and
# findings that tests of other features do not expect; tests/reviewer/persona/test_probes.py turns them on where they are the subject.
os.environ.setdefault("REVIEWER_PROBES", "false")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

# SmolLM2-135M-Instruct's own template (no tool support): the "injected" style.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
          "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

_TOOL_TURNS = """
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}"""

_SYSTEM_AND_USER = """
{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"""

# Qwen2.5/Qwen3-like: tools in the system prompt, Hermes JSON tool calls.
HERMES = """{%- if tools %}{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags.<|im_end|>\\n' }}""" + _SYSTEM_AND_USER + """
{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for tc in message.tool_calls or [] %}{%- set f = tc.function %}
{{- '\\n<tool_call>\\n{"name": "' + f.name + '", "arguments": ' + (f.arguments if f.arguments is string else f.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\\n' }}""" + _TOOL_TURNS + """
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# Qwen3.5/3.6-like: XML tool calls (<function=...><parameter=...>) and a generation prompt that opens <think>.
QWEN35 = """{%- if tools %}{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n<function>\\n<name>' + tool.function.name + '</name>' }}
{%- for name, spec in (tool.function.parameters.properties or {}) | dictsort %}
{{- '\\n<parameter>\\n<name>' + name + '</name>\\n<type>' + (spec.type | string) + '</type>\\n</parameter>' }}
{%- endfor %}{{- '\\n</function>' }}{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function reply:\\n<tool_call>\\n<function=example_function_name>\\n'
    '<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"""
QWEN35 += _SYSTEM_AND_USER + """
{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content or '' }}
{%- for tc in message.tool_calls or [] %}{{- '\\n<tool_call>\\n<function=' + tc.function.name + '>\\n' }}
{%- for k, v in tc.function.arguments | dictsort %}
{{- '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' }}
{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}""" + _TOOL_TURNS + """
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"""

TEMPLATES = {"chatml": CHATML, "hermes": HERMES, "qwen35": QWEN35}

_CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. Review this code for bugs, please.",
    "def first(xs):\n    return xs[1]\n\nimport os, sys, json\nclass Config:\n    pass\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}} {"type": "function"}',
    "system user assistant tool You are a helpful assistant. What is the weather in Paris today?",
    "café naïve résumé 東京 — emoji 🙂 ünïcödé",
]


def build_tokenizer(extra_tokens=()):
    """A small byte-level BPE (a few hundred ids) with ChatML special tokens and Qwen's tag tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS + list(extra_tokens)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _random_model(kind: str, vocab: int, eos: int):
    """Random weights; the LM-head rows of the special tokens are zeroed so that greedy decoding never ends a turn on
    its own (long generations run to max_tokens, which the cancellation and queue tests rely on)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=eos, initializer_range=0.2,
                  tie_word_embeddings=False)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    elif kind == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
            vocab_size=vocab, hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
            num_experts_per_tok=2, max_position_embeddings=2048, eos_token_id=eos, initializer_range=0.2,
            tie_word_embeddings=False))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        model.lm_head.weight[:len(SPECIAL)] = 0.0  # the special tokens are ids 0..2
    return model


def _scripted_model(tokenizer, template: str, script: list[str]):
    """Llama whose next token depends only on the current one: prompt's last token -> script[0] -> ... -> <|im_end|>."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, eos = len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>")
    hidden = -(-vocab // 64) * 64
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                                         tie_word_embeddings=False, eos_token_id=eos))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template,
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    chain = [prompt[-1]] + [tokenizer.convert_tokens_to_ids(t) for t in script]
    assert len(set(chain)) == len(chain) and eos not in chain, "script tokens must be distinct single tokens"
    successor = {t: eos for t in range(vocab)}
    successor.update(zip(chain, chain[1:] + [eos]))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        model.model.norm.weight.fill_(10.0)  # sharpens the logits so sampling follows the script too
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, hidden)
        for token, nxt in successor.items():
            head[nxt, token] = 1.0
        model.lm_head.weight.copy_(head)
    return model


def pytest_collection_modifyitems(session, config, items):
    """The kernel tests' Triton-interpreter scripts (tests/interpreter.py) start in the background now, at the lowest
    CPU priority, and their modules move to the end of the session, so that the interpreter's minutes overlap the
    rest of the suite instead of adding to it. Order within each group is kept; tests do not depend on order."""
    import importlib.util

    from tests import interpreter

    def uses_interpreter(module) -> bool:  # it imports tests/interpreter.py or test_fused_moe's helpers
        return getattr(module, "interpreter", None) is interpreter or hasattr(module, "interpreted_by_case")

    if config.option.collectonly or importlib.util.find_spec("triton") is None:
        return
    kernel_modules = []
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and uses_interpreter(module) and module not in kernel_modules:
            kernel_modules.append(module)
    for module in kernel_modules:  # every interpreter script a module holds: its module-level *SCRIPT strings
        for name, value in vars(module).items():
            if name.endswith("SCRIPT") and isinstance(value, str):
                interpreter.prestart(value)
    items.sort(key=lambda item: getattr(item, "module", None) in kernel_modules)  # stable: False first


def pytest_sessionfinish(session, exitstatus):
    from tests import interpreter

    interpreter.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory: tiny_model(kind="llama"|"qwen3"|"qwen3_5_moe", template="chatml"|"hermes"|"qwen35", script=None)
    -> folder with config.json, safetensors and a tokenizer. Built once per session per argument set."""
    built: dict[tuple, Path] = {}

    def make(kind: str = "llama", template: str | None = None, script: tuple[str, ...] | list[str] | None = None) -> Path:
        template = template or {"llama": "chatml", "qwen3": "hermes", "qwen3_5_moe": "qwen35"}[kind]
        key = (kind, template, tuple(script or ()))
        if key not in built:
            path = tmp_path_factory.mktemp(f"tiny-{kind}-{template}")
            tokenizer = build_tokenizer([t for t in script or () if t not in TAGS])
            tokenizer.chat_template = TEMPLATES[template]
            eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
            model = (_scripted_model(tokenizer, TEMPLATES[template], list(script)) if script
                     else _random_model(kind, len(tokenizer), eos))
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            built[key] = path
        return built[key]

    return make


class LiveServer:
    """create_app(...) served by uvicorn on a real socket, in a background thread of this process."""

    def __init__(self, app, uds: str | None):
        import uvicorn

        self.app, self.uds = app, uds
        port = None
        if uds is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.root = "http://127.0.0.1:%d" % port if port else "http://localhost"
        self.base_url = self.root + "/v1"
        config = uvicorn.Config(app, host="127.0.0.1", port=port or 0, uds=uds, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def http(self, library: str = "httpx", **kwargs):
        """An HTTP client aimed at this server (over the unix socket when there is one). The `openai` SDK takes an
        httpx.Client; the `anthropic` SDK takes an httpx2.Client (library="httpx2")."""
        import importlib

        lib = importlib.import_module(library)
        transport = lib.HTTPTransport(uds=self.uds) if self.uds else None
        kwargs.setdefault("timeout", 60)
        return lib.Client(base_url=self.root, transport=transport, **kwargs)

    def wait_ready(self, timeout: float = 120) -> "LiveServer":
        import httpx

        deadline = time.monotonic() + timeout
        with self.http() as client:
            while time.monotonic() < deadline:
                try:
                    response = client.get("/health")
                    if response.status_code == 200:
                        return self
                    if response.json().get("status") == "error":
                        raise RuntimeError(response.text)
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise TimeoutError("the server did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    """Factory: live_server(model_path_or_spec, uds=False, wait=True, **create_app_kwargs) -> LiveServer (stopped
    at the end of the test module, so a module can share one server between tests)."""
    from backend.server.app import create_app

    servers = []
    folder = tmp_path_factory.mktemp("sockets")

    def start(model, uds: bool = False, wait: bool = True, **kwargs) -> LiveServer:
        kwargs.setdefault("device", "cpu")
        server = LiveServer(create_app(str(model), **kwargs), str(folder / f"s{len(servers)}.sock") if uds else None)
        servers.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from a second thread, and on a shared CPU OpenMP barriers stall. Module-scoped, so a
    module's own data fixtures (built once) run with one thread too."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def engine_states(engine) -> list[tuple[str, torch.Tensor]]:
    """Every target cache tensor over the cached positions, as (kind, tensor) with kind "kv" or "linear", on either
    engine path: transformers' DynamicCache (HFTarget) or the fast model's static caches (FastTarget)."""
    if engine.fast:
        fm = engine.target.fast
        n, out = fm.length, []
        if fm.hybrid:
            out += [("linear", fm.model.linear.conv), ("linear", fm.model.linear.state)]
        if fm.model.kv is not None:
            out += [("kv", fm.model.kv.k[:, :, :n]), ("kv", fm.model.kv.v[:, :, :n])]
        return out
    out = []
    for layer in engine.cache.layers:
        if hasattr(layer, "recurrent_states"):
            conv, rec = layer.conv_states, layer.recurrent_states
            conv, rec = (conv[0], rec[0]) if isinstance(conv, dict) else (conv, rec)
            out += [("linear", conv), ("linear", rec)]
        else:
            out += [("kv", layer.keys), ("kv", layer.values)]
    return out
