"""backend/models/numerics.py: the one decoding-numerics record. resolve_numerics turns an engine's arguments and its
device into a Numerics for every configuration the arguments allow (the table below), with the same ValueErrors for
the invalid ones; the engine builds its fast model with the record and the model reads it (no class attribute, no
switch afterwards); under Triton's CPU interpreter a Llama built with the invariant record takes the tensor-core row
kernels for every projection."""

import dataclasses
import itertools
import textwrap

import pytest

from backend.bench.run import tiny_model
from backend.decoding.engine import Engine
from backend.dflash.checkpoint import random_drafter
from backend.models import Numerics, invariant_numerics
from backend.models.llama import Llama
from backend.models.numerics import (
    EXACT_SPAN,
    LLAMA_INVARIANT_PATH,
    LLAMA_INVARIANT_PATHS,
    MMA_PROJECTIONS,
    LlamaNumerics,
    QwenNumerics,
    llama_invariant,
    resolve_numerics,
)
from backend.models.qwen3_5_moe import Qwen35Moe
from tests import interpreter

INVARIANT_LLAMA = LlamaNumerics("rows", MMA_PROJECTIONS)  # LLAMA_INVARIANT_PATH "mma"
PLAIN_LLAMA, PLAIN_QWEN, PADDED_QWEN = LlamaNumerics(), QwenNumerics(), QwenNumerics(padded_rows=True)

# (device, drafter, arguments) -> (kind, llama, qwen, invariant_steps, compile, device_cycle)
TABLE = [
    # the defaults
    ("cpu", False, {}, ("one_token", PLAIN_LLAMA, PLAIN_QWEN, False, False, False)),
    ("cpu", True, {}, ("exact", PLAIN_LLAMA, PLAIN_QWEN, False, False, False)),
    ("cuda", False, {}, ("invariant", INVARIANT_LLAMA, PADDED_QWEN, True, True, False)),
    ("cuda", True, {}, ("invariant", INVARIANT_LLAMA, PADDED_QWEN, True, True, True)),
    # benchmarks' one-token kernels, the transformers path
    ("cuda", False, {"invariant_verify": False}, ("one_token", PLAIN_LLAMA, PLAIN_QWEN, False, True, False)),
    ("cuda", True, {"invariant_verify": False}, ("one_token", PLAIN_LLAMA, PLAIN_QWEN, False, True, True)),
    ("cpu", True, {"fast": False}, ("transformers", PLAIN_LLAMA, PLAIN_QWEN, False, False, False)),
    ("cuda", True, {"fast": False}, ("transformers", PLAIN_LLAMA, PLAIN_QWEN, False, False, False)),
    # explicit choices
    ("cpu", False, {"exact": True}, ("exact", PLAIN_LLAMA, PLAIN_QWEN, False, False, False)),
    ("cpu", True, {"exact": False}, ("one_token", PLAIN_LLAMA, PLAIN_QWEN, False, False, False)),
    ("cpu", True, {"exact": False, "device_cycle": True}, ("one_token", PLAIN_LLAMA, PLAIN_QWEN, False, False, True)),
    ("cpu", False, {"device_cycle": True}, ("one_token", PLAIN_LLAMA, PLAIN_QWEN, False, False, False)),
    ("cuda", True, {"exact": True}, ("exact", PLAIN_LLAMA, PLAIN_QWEN, False, True, False)),
    ("cuda", True, {"device_cycle": False}, ("invariant", INVARIANT_LLAMA, PADDED_QWEN, True, True, False)),
    ("cuda", True, {"compile": False}, ("invariant", INVARIANT_LLAMA, PADDED_QWEN, True, False, True)),
    ("cuda", True, {"llama_invariant_path": "glue"},
     ("invariant", LlamaNumerics("glue"), PADDED_QWEN, True, True, True)),
    ("cpu", True, {"exact": False, "invariant_verify": True},
     ("invariant", INVARIANT_LLAMA, PADDED_QWEN, True, False, False)),
    # invariant_verify=True with exact mode: both asked for, exact mode's padding decides the kind
    ("cuda", True, {"exact": True, "invariant_verify": True},
     ("exact", INVARIANT_LLAMA, PADDED_QWEN, True, True, False)),
    ("cpu", True, {"invariant_verify": True}, ("exact", INVARIANT_LLAMA, PADDED_QWEN, True, False, False)),
    # another device: neither CUDA's defaults nor the CPU's exact mode
    ("mps", True, {}, ("one_token", PLAIN_LLAMA, PLAIN_QWEN, False, False, False)),
]


@pytest.mark.parametrize("device, drafter, args, expected", TABLE)
def test_resolution_table(device, drafter, args, expected):
    n = resolve_numerics(device, drafter=drafter, fast_path=True, **args)
    assert (n.kind, n.llama, n.qwen, n.invariant_steps, n.compile, n.device_cycle) == expected
    assert n.fast == (n.kind != "transformers") and n.exact == (n.kind == "exact")
    assert n.why and "\n" not in n.why and n.kind in n.describe()


def previous_engine_flags(device, drafter, fast_path, fast, exact, compile, device_cycle, invariant_verify):
    """Engine.__init__'s flag order before the record (commit 63c7094, transcribed): compile, the target (fast path or
    not, exact), invariant_verify, device_cycle. Returns (fast path, exact, invariant model settings, compile, device
    cycle with a drafter) or raises its ValueErrors."""
    compile = device == "cuda" if compile is None else compile
    if fast is not False and not fast_path and fast:
        raise ValueError("no fast path for this architecture (fast=True)")
    is_fast = fast is not False and fast_path
    ex = ((device == "cpu" and drafter) if exact is None else exact) if is_fast else None
    iv = (device == "cuda" and is_fast and not ex) if invariant_verify is None else invariant_verify
    iv = bool(iv) and is_fast
    dc = (device == "cuda" and is_fast and not ex) if device_cycle is None else device_cycle
    if dc and not (is_fast and not ex):
        raise ValueError("the device cycle needs the fast path outside exact mode")
    return is_fast, bool(ex) if is_fast else False, iv, compile if is_fast else False, bool(drafter and dc)


def test_every_argument_combination_resolves_as_the_flags_did():
    """All 5,832 combinations of the tri-state arguments, three devices, drafter or not, fast path or not and both
    Llama paths: the record gives the kernels the flags gave (or the same ValueError), and its model records are
    the invariant ones exactly where the flags turned the model's invariant verify on."""
    tri = (None, True, False)
    for device, drafter, fast_path, fast, exact, compile, cycle, invariant, path in itertools.product(
            ("cpu", "cuda", "mps"), (False, True), (False, True), tri, tri, tri, tri, tri, LLAMA_INVARIANT_PATHS):
        try:
            want = previous_engine_flags(device, drafter, fast_path, fast, exact, compile, cycle, invariant)
        except ValueError as exc:
            want = str(exc)
        try:
            n = resolve_numerics(device, drafter=drafter, fast_path=fast_path, fast=fast, exact=exact, compile=compile,
                                 device_cycle=cycle, invariant_verify=invariant, llama_invariant_path=path)
        except ValueError as exc:
            got = str(exc)
        else:
            got = (n.fast, n.exact, n.invariant_steps, n.compile, n.device_cycle)
            models = (llama_invariant(path), PADDED_QWEN) if n.invariant_steps else (PLAIN_LLAMA, PLAIN_QWEN)
            assert (n.llama, n.qwen) == models, n
        assert got == want, (device, drafter, fast_path, fast, exact, compile, cycle, invariant, path)


def test_without_a_fast_path_everything_is_transformers():
    for device, drafter in (("cpu", False), ("cpu", True), ("cuda", True)):
        n = resolve_numerics(device, drafter=drafter, fast_path=False)
        assert n.kind == "transformers" and not n.device_cycle and not n.invariant_steps
        assert "no fast path" in n.why
    # an explicit exact or invariant_verify has nothing to act on there (the engine ignored them before too)
    assert resolve_numerics("cpu", drafter=True, fast_path=False, exact=True, invariant_verify=True).kind == \
        "transformers"


@pytest.mark.parametrize("device, args, message", [
    ("cpu", {"fast": True}, "no fast path for this architecture (fast=True)"),
    ("cuda", {"fast": True, "device_cycle": True}, "no fast path for this architecture (fast=True)"),
    ("cpu", {"fast": False, "device_cycle": True}, "the device cycle needs the fast path outside exact mode"),
    ("cpu", {"device_cycle": True}, "the device cycle needs the fast path outside exact mode"),  # CPU + drafter: exact
    ("cuda", {"exact": True, "device_cycle": True}, "the device cycle needs the fast path outside exact mode"),
    ("cuda", {"llama_invariant_path": "fast"}, "llama_invariant must be 'glue' or 'mma', got 'fast'"),
])
def test_invalid_combinations_are_value_errors(device, args, message):
    fast_path = not args.get("fast")  # fast=True cases: the architecture has no fast path
    with pytest.raises(ValueError) as err:
        resolve_numerics(device, drafter=True, fast_path=fast_path, **args)
    assert str(err.value) == message


def test_the_record_is_frozen_and_checked():
    n = resolve_numerics("cuda", drafter=True, fast_path=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.kind = "exact"
    with pytest.raises(ValueError, match="kind"):
        Numerics("fastest", "no")
    with pytest.raises(ValueError, match="step_path"):
        LlamaNumerics("mma")
    with pytest.raises(ValueError, match="mma_projections"):
        LlamaNumerics("rows", {"qkv", "attention"})
    with pytest.raises(ValueError, match="wide_projections"):
        QwenNumerics(True, {"router"})
    assert llama_invariant(LLAMA_INVARIANT_PATH) == INVARIANT_LLAMA
    assert invariant_numerics("x").llama == INVARIANT_LLAMA and invariant_numerics("x", "glue").llama.step_path == "glue"


def test_no_class_attribute_chooses_kernels():
    """The per-model choices live in the record only: nothing on the classes for a benchmark to flip."""
    for name in ("mma_projections", "invariant_path", "step_path", "set_step_path", "use_invariant_verify"):
        assert not hasattr(Llama, name), name
    for name in ("invariant_steps", "wide_projections", "use_invariant_verify"):
        assert not hasattr(Qwen35Moe, name), name


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid"])
def test_the_engine_builds_its_fast_model_with_the_record(name):
    """Engine.numerics is the resolved record and the fast model holds that very record, for the CPU's defaults and
    for the invariant numerics asked for explicitly (on this CPU without Triton the model falls back as on a GPU
    without it: Llama's tensor-core rows to the checked glue, which is not verified here; Qwen's padded rows need
    Triton, so neither path is batch-invariant and a speculative engine says it is not lossless)."""
    model = tiny_model(name)
    plain = Engine(model)
    assert plain.numerics.kind == "one_token" and plain.target.fast.model.numerics is plain.numerics
    assert plain.target.fast.numerics is plain.numerics and not plain.invariant_verify
    spec = Engine(model, drafter=random_drafter(model))
    assert spec.numerics.kind == "exact" and spec.target.exact and spec.target.fast.model.numerics is spec.numerics
    assert spec.target.fast.span_multiple == EXACT_SPAN and plain.target.fast.span_multiple == 0  # FastModel reads it
    asked = Engine(model, drafter=random_drafter(model), exact=False, invariant_verify=True)
    fast_model = asked.target.fast.model
    assert asked.numerics.kind == "invariant" and asked.invariant_verify and fast_model.numerics is asked.numerics
    if name == "tiny-llama":
        assert fast_model.step_path == "glue" and not fast_model.glue_steps
    else:
        assert fast_model.numerics.qwen.padded_rows and not fast_model.batch_invariant
    assert not asked.lossless and "NOT lossless" in asked.describe_decoding()
    hf = Engine(model, drafter=random_drafter(model), fast=False)
    assert hf.numerics.kind == "transformers" and not hf.fast and "fast=False" in hf.numerics.why


def test_the_engine_keeps_the_ready_line_and_its_errors():
    model = tiny_model("tiny-llama")
    exact = Engine(model, drafter=random_drafter(model))
    assert "token-identical to --drafter none (exact mode)" in exact.describe_decoding()
    with pytest.raises(ValueError, match="the device cycle needs the fast path outside exact mode"):
        Engine(model, drafter=random_drafter(model), device_cycle=True)
    with pytest.raises(ValueError, match="the device cycle needs the fast path outside exact mode"):
        Engine(model, fast=False, device_cycle=True)
    from transformers import Qwen2Config, Qwen2ForCausalLM
    qwen2 = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"no fast path for this architecture \(fast=True\)"):
        Engine(qwen2, fast=True)
    other = Engine(qwen2)  # fast=None: transformers, said why
    assert other.numerics.kind == "transformers" and "no fast path" in other.numerics.why


LLAMA_MMA_SCRIPT = textwrap.dedent("""
    import importlib
    import torch
    from transformers import DynamicCache
    from backend.models import invariant_numerics, load_fast
    from tests.backend.models.test_fast_models import TOL, count_calls, hf_step, seeded, tiny_llama
    calls = count_calls(importlib.import_module("backend.models.llama"), ["rows_linear", "norm_gemv", "gemv"])
    seeded()
    hf = tiny_llama(tie=False)
    for numerics in (invariant_numerics("test", "mma"), None):  # the invariant record, then a bare model's
        for name in calls:
            calls[name] = 0
        fast = load_fast(hf, max_context=64, numerics=numerics)
        prompt = torch.randint(0, 320, (9,))
        cache = DynamicCache(config=hf.config)
        fast.prefill(prompt)
        token = int(hf_step(hf, prompt, cache).logits[0, -1].argmax())
        for _ in range(2):
            logits, _ = fast.decode(token)
            ref = hf_step(hf, [token], cache)
            torch.testing.assert_close(logits, ref.logits[0, -1], **TOL)
            token = int(ref.logits[0, -1].argmax())
        if numerics is not None:  # 3 layers x 4 projections + the LM head on tensor-core rows, 2 steps
            assert calls == {"rows_linear": 2 * (3 * 4 + 1), "norm_gemv": 0, "gemv": 0}, calls
        else:  # the one-token kernels
            assert calls == {"rows_linear": 0, "norm_gemv": 2 * (3 * 2 + 1), "gemv": 2 * 3 * 2}, calls
    print("ok")
""")


def test_llama_reads_the_invariant_record_under_interpreter():
    """A Llama built with the invariant record ("mma") runs every projection of a decode step through
    reviewer_kernels/rows_linear.py; one built without takes the one-token kernels; both give transformers' logits
    (fp32, every kernel interpreted)."""
    pytest.importorskip("triton")
    done = interpreter.run(LLAMA_MMA_SCRIPT, timeout=600)  # usually computed in the background already
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
