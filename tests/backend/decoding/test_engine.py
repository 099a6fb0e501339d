"""The plain decoding engine: token-identical to transformers' generate, exact prefix reuse (attention KV cropping and
the hybrid linear-attention prompt checkpoint), stop/cancel/close semantics, bad input."""

import pytest
import torch

from backend.bench.run import tiny_model
from backend.decoding import hf_cache
from backend.decoding.engine import Engine, SamplingParams, warm_prefill_lengths
from tests.conftest import engine_states

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=[dict(fast=False), dict(fast=True, exact=False), dict(fast=True, exact=True)],
                ids=["hf", "fast", "fast_exact"])
def fast(request):
    """Every test runs on transformers (HFTarget), on the fast path (FastTarget) and on it in exact mode."""
    return request.param


@pytest.fixture(scope="module")
def llama():
    return tiny_model("tiny-llama")


@pytest.fixture(scope="module")
def hybrid():
    return tiny_model("tiny-hybrid")


def _prompt(n, seed=0, vocab=128):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine, prompt, **kw):
    return [t for block in engine.generate(prompt, SamplingParams(**kw)) for t in block]


def _assert_states_close(a, b):
    """a, b: engines on the same path."""
    for (_, x), (_, y) in zip(engine_states(a), engine_states(b), strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "hybrid"])
def test_greedy_matches_transformers_generate(fast, name, request):
    model = request.getfixturevalue(name)
    prompt = _prompt(30, seed=1)
    x = torch.tensor([prompt])
    ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=25, min_new_tokens=25,
                         do_sample=False, eos_token_id=None, pad_token_id=0)[0, 30:].tolist()
    engine = Engine(model, **fast)
    assert _run(engine, prompt, max_tokens=25) == ref
    stats = engine.last_stats
    assert (stats.prompt_tokens, stats.generated_tokens, stats.finish_reason) == (30, 25, "length")
    assert stats.cycles == 0 and stats.prefill_seconds > 0 and stats.decode_seconds > 0


def test_multi_token_cached_forward_starts_from_the_cached_state(fast, hybrid):
    """transformers 5.23 continues a chunked Gated DeltaNet forward from the cached conv/recurrent state (older 5.x
    releases restarted it from zero): chunked prefill must equal one full prefill."""
    prompt = _prompt(45, seed=2)
    full, chunked = Engine(hybrid, **fast), Engine(hybrid, **fast, prefill_chunk=7)
    assert _run(full, prompt, max_tokens=12) == _run(chunked, prompt, max_tokens=12)
    _assert_states_close(full, chunked)
    with torch.no_grad():  # and the raw model: logits of chunked cached forwards == one forward
        one = hybrid(torch.tensor([prompt])).logits
        cache = hf_cache.new_cache(hybrid)
        parts = [hybrid(torch.tensor([prompt[i:i + 10]]), past_key_values=cache, use_cache=True).logits
                 for i in range(0, 45, 10)]
    torch.testing.assert_close(torch.cat(parts, dim=1), one, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "hybrid"])
def test_prefix_reuse_is_exact(fast, name, request):
    model = request.getfixturevalue(name)
    engine = Engine(model, **fast)
    first_prompt = _prompt(40, seed=3)
    first = _run(engine, first_prompt, max_tokens=10)

    def check(prompt, expect_cached, **kw):
        got = _run(engine, prompt, max_tokens=10, **kw)
        fresh = Engine(model, **fast)
        assert got == _run(fresh, prompt, max_tokens=10, **kw)
        assert engine.last_stats.cached_tokens == expect_cached
        assert engine.cache_ids == fresh.cache_ids
        _assert_states_close(engine, fresh)
        return got

    # the next turn of a conversation: previous prompt + answer + new message (the live cache continues)
    turn2 = first_prompt + first + _prompt(5, seed=4)
    out2 = check(turn2, len(first_prompt) + len(first) - 1)
    # the template re-rendered the previous answer differently: only the previous prompt is reusable
    turn3 = turn2 + out2[:3] + [7, 7] + _prompt(4, seed=5)
    check(turn3[:len(turn2)] + [9, 9, 9], len(turn2), temperature=0.8, seed=11)
    # the same prompt again (a retry)
    check(turn3[:len(turn2)] + [9, 9, 9], len(turn2) + 3 if name == "hybrid" else len(turn2) + 2)
    # a prompt that diverges inside the previous prompt
    diverging = first_prompt[:20] + _prompt(10, seed=6)
    check(diverging, 0 if name == "hybrid" else 20)


def test_hybrid_checkpoint_is_only_the_prompt_end(fast, hybrid):
    """For Gated DeltaNet layers the reusable points are the live state and the previous prompt's end, nothing
    in between: a prompt branching off inside the previous answer reuses exactly the previous prompt."""
    engine = Engine(hybrid, **fast)
    prompt = _prompt(30, seed=7)
    out = _run(engine, prompt, max_tokens=12)
    branch = prompt + out[:5] + [1, 2, 3]
    assert _run(engine, branch, max_tokens=6) == _run(Engine(hybrid, **fast), branch, max_tokens=6)
    assert engine.last_stats.cached_tokens == 30


def test_stop_tokens_end_generation_without_being_emitted(fast, llama):
    prompt = _prompt(20, seed=8)
    ref = _run(Engine(llama, **fast), prompt, max_tokens=30)
    stop = ref[10]
    engine = Engine(llama, **fast)
    out = _run(engine, prompt, max_tokens=30, stop_token_ids=(stop, 99999))
    assert out == ref[:ref.index(stop)]
    assert engine.last_stats.finish_reason == "stop"


def test_cancel_and_close_leave_the_engine_usable(fast, hybrid):
    prompt = _prompt(25, seed=9)
    ref = _run(Engine(hybrid, **fast), prompt, max_tokens=20)
    engine = Engine(hybrid, **fast)
    out = []
    for block in engine.generate(prompt, SamplingParams(max_tokens=20), cancelled=lambda: len(out) >= 4):
        out += block
    assert out == ref[:4] and engine.last_stats.finish_reason == "cancelled"
    gen = engine.generate(prompt, SamplingParams(max_tokens=20))
    assert [next(gen)[0] for _ in range(6)] == ref[:6]
    gen.close()  # e.g. the server found a stop string
    assert _run(engine, prompt, max_tokens=20) == ref
    assert engine.last_stats.cached_tokens == 25  # the prompt checkpoint survived both


def test_error_mid_generation_resets_the_cache(fast, llama):
    prompt = _prompt(20, seed=10)
    engine = Engine(llama, **fast)
    _run(engine, prompt, max_tokens=5)

    def boom():
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError):
        list(engine.generate(prompt, SamplingParams(max_tokens=5), cancelled=boom))
    assert engine.cache_ids == []
    assert _run(engine, prompt, max_tokens=5) == _run(Engine(llama, **fast), prompt, max_tokens=5)


def test_sampling_is_seeded_and_top_p_narrows(fast, llama):
    prompt = _prompt(15, seed=12)
    engine = Engine(llama, **fast)
    a = _run(engine, prompt, max_tokens=20, temperature=1.0, seed=5)
    assert a == _run(engine, prompt, max_tokens=20, temperature=1.0, seed=5)
    assert a != _run(engine, prompt, max_tokens=20, temperature=1.0, seed=6)
    greedy = _run(engine, prompt, max_tokens=20)
    assert _run(engine, prompt, max_tokens=20, temperature=1.0, top_p=1e-6, seed=1) == greedy


def test_bad_input_and_context_limit(fast, llama):
    engine = Engine(llama, **fast, max_context=32)
    for prompt, params in [([], SamplingParams()), ([5, 128], SamplingParams()), ([-1], SamplingParams()),
                           (list(range(32)), SamplingParams()), ([1, 2], SamplingParams(temperature=-1)),
                           ([1, 2], SamplingParams(top_p=0)), ([1, 2], SamplingParams(max_tokens=-1))]:
        with pytest.raises(ValueError):
            list(engine.generate(prompt, params))
    out = _run(engine, list(range(1, 29)), max_tokens=100)
    assert len(out) == 4 and engine.last_stats.finish_reason == "length"  # stops when the context is full
    assert _run(engine, [1, 2, 3], max_tokens=0) == []


def test_warm_up_prefills_every_block_size_both_sides_of_16_and_prompts_past_a_chunk():
    lengths = warm_prefill_lengths(2048, 32768)
    assert lengths[:16] == list(range(1, 17)) and lengths == sorted(set(lengths))
    assert {n % 16 == 0 for n in lengths if 16 < n <= 2048} == {True, False}
    past_a_chunk = [n for n in lengths if n > 2048]  # a second chunk after a past of 2048: its own specialisation
    assert past_a_chunk and {n % 16 == 0 for n in past_a_chunk} == {True, False} and min(past_a_chunk) - 2048 < 16
    # a small window: nothing that would not fit in it
    assert max(warm_prefill_lengths(2048, 1000)) <= 1000 - 8 and max(warm_prefill_lengths(2048, 2060)) <= 2048
