"""The llama.cpp CPU engine (backend/decoding/llamacpp.py) on the real embedded GGUF: what the server relies on of an
engine (token ids in and out, greedy determinism, prefix reuse, stop ids, the budget, early close, bad input), and
the thread choice. The server over it is tested in tests/backend/server/test_server.py."""
import pytest

pytest.importorskip("xllamacpp", reason="llama.cpp's runtime (the xllamacpp wheel) is not installed")

from backend.decoding.engine import SamplingParams  # noqa: E402
from backend.decoding.llamacpp import LlamaCppEngine, ThreadChoice, choose_threads  # noqa: E402
from backend.loading import embedded_gguf_path  # noqa: E402

# "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n" in SmolLM2's vocabulary
PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
IM_END = 2


@pytest.fixture(scope="module")
def engine():
    return LlamaCppEngine(embedded_gguf_path(), max_context=512, vocab_size=49152,
                          threads=ThreadChoice(1, 0, "test"))


def tokens(engine, prompt, **params) -> list[int]:
    return [t for chunk in engine.generate(prompt, SamplingParams(**params)) for t in chunk]


def test_greedy_is_deterministic_and_reuses_the_prompt(engine):
    first = tokens(engine, PROMPT, max_tokens=5)  # the answer is longer than 5 tokens
    assert len(first) == 5 and engine.last_stats.finish_reason == "length"
    assert engine.last_stats.generated_tokens == 5 and engine.last_stats.decode_seconds > 0
    again = tokens(engine, PROMPT, max_tokens=5)
    assert again == first
    assert engine.last_stats.cached_tokens >= len(PROMPT) - 1  # llama.cpp's prompt cache: only the last one again


def test_stop_ids_end_the_reply_without_the_stop_token(engine):
    reply = tokens(engine, PROMPT, max_tokens=64, stop_token_ids=(IM_END,))
    assert IM_END not in reply and 0 < len(reply) < 64
    assert engine.last_stats.finish_reason == "stop"


def test_closing_early_leaves_the_engine_serving(engine):
    generator = engine.generate(PROMPT, SamplingParams(max_tokens=50))
    assert len(next(generator)) == 1
    generator.close()
    assert len(tokens(engine, PROMPT, max_tokens=5)) == 5


def test_cancelled_between_tokens(engine):
    seen = []
    generator = engine.generate(PROMPT, SamplingParams(max_tokens=50), cancelled=lambda: len(seen) >= 3)
    for chunk in generator:
        seen.extend(chunk)
    assert 3 <= len(seen) < 50 and engine.last_stats.finish_reason == "cancelled"


def test_sampling_with_a_seed_repeats(engine):
    a = tokens(engine, PROMPT, max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    b = tokens(engine, PROMPT, max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    assert a == b and a


@pytest.mark.parametrize("prompt, params, message", [
    ([], {}, "the prompt is empty"),
    ([49152], {}, "prompt token ids must lie in"),
    ([1] * 512, {}, "the context holds 512"),
    (PROMPT, {"top_p": 0}, "top_p"),
])
def test_bad_input_is_a_value_error(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        tokens(engine, prompt, **params)


def test_the_thread_choice_follows_the_cpus_and_the_load():
    assert choose_threads(cpus=2, load=0.1) == ThreadChoice(2, 0, "2 usable CPUs, idle", 2)
    busy = choose_threads(cpus=2, load=4.0)
    assert (busy.threads, busy.batch_threads) == (1, 2)  # decode leaves the busy processes a core; prefill takes both
    assert busy.describe() == "1 thread decoding, 2 prefilling, passive wait (2 usable CPUs, load 4.0)"
    assert choose_threads(cpus=8, load=2.0).threads == 6
    assert choose_threads(threads=3).describe() == "3 threads, passive wait (asked for)"
    assert all(choose_threads(cpus=c, load=l).poll == 0 for c in (1, 2, 16) for l in (0.0, 9.0))
