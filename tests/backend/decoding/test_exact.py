"""Exact (batch-invariant) mode on the real embedded model in bf16: a position's logits are bitwise the same whether
it was decoded alone (a padded step) or inside any verified block, across the 512-column attention span boundary;
and greedy speculative decoding with the shipped drafter emits exactly the plain tokens."""

import pytest
import torch

from backend.dflash.checkpoint import find_shipped_drafter, load_drafter
from backend.decoding.engine import Engine, SamplingParams
from backend.loading import ModelLoadError, load_model
from backend.models import Numerics, load_fast
from backend.decoding.target import FastTarget

EXACT = Numerics("exact", "tests: exact mode")  # the record a CPU engine with a drafter resolves to

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def embedded_bf16():
    try:
        return load_model("embedded", device="cpu", dtype="bfloat16")
    except ModelLoadError as exc:
        pytest.skip(f"embedded model unavailable: {exc}")


def _no_cancel():
    return False


def test_padded_steps_and_verified_blocks_give_bitwise_equal_logits(embedded_bf16):
    hf = embedded_bf16.model
    target = FastTarget(load_fast(hf, max_context=1024 + 16, numerics=EXACT))
    prompt = torch.randint(100, 40000, (480,), generator=torch.Generator().manual_seed(0)).tolist()
    logits, _ = target.prefill(prompt, False, _no_cancel)
    tokens, stepped = [], []
    for _ in range(32):  # positions 480..511: the padded steps from 497 on attend over 1024 columns
        tokens.append(int(logits.argmax()))
        logits = target.step(tokens[-1])
        stepped.append(logits.clone())
    target.reset()
    target.prefill(prompt, False, _no_cancel)
    verified = []
    for start, size in [(0, 10), (10, 16), (26, 6)]:  # uneven blocks; (10, 16) ends at 506: a 512-column span
        block_logits, _ = target.verify(tokens[start:start + size], False)
        target.accept(size)
        verified += list(block_logits)
    for i, (a, b) in enumerate(zip(stepped, verified, strict=True)):
        assert torch.equal(a, b), f"position {480 + i}: max diff {float((a.float() - b.float()).abs().max())}"


def test_prefill_is_independent_of_where_its_chunks_start(embedded_bf16):
    """Prefix reuse cuts a prompt at any point; in exact mode the logits after it are bitwise the same."""
    target = FastTarget(load_fast(embedded_bf16.model, max_context=1024 + 16, numerics=EXACT))
    prompt = torch.randint(100, 40000, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    whole, _ = target.prefill(prompt, False, _no_cancel)
    for cut in (37, 64, 250):
        target.reset()
        target.prefill(prompt[:cut], False, _no_cancel)
        split, _ = target.prefill(prompt[cut:], False, _no_cancel)
        assert torch.equal(whole, split), f"cut at {cut}"


def test_output_does_not_depend_on_what_the_cache_held_before(embedded_bf16):
    """A token decoded in one request and reused as a prompt token in the next gives the same cache entries as the
    same token prefilled from scratch (here: the first prompt's answer begins the second prompt)."""
    hf = embedded_bf16.model
    prompt = torch.randint(100, 40000, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    warm = Engine(hf, exact=True)
    answer = [t for b in warm.generate(prompt[:20], SamplingParams(max_tokens=6)) for t in b]
    follow = prompt[:20] + answer + prompt[20:]
    got = [t for b in warm.generate(follow, SamplingParams(max_tokens=24)) for t in b]
    assert warm.last_stats.cached_tokens >= 20 + len(answer) - 1  # the answer's cache entries were reused
    assert got == [t for b in Engine(hf, exact=True).generate(follow, SamplingParams(max_tokens=24)) for t in b]


def test_shipped_drafter_fits_the_repository_limit():
    """The committed drafter (weights, config, provenance) stays within the 32 MB a shipped drafter may take."""
    path = find_shipped_drafter("SmolLM2-135M-Instruct")
    assert path is not None
    assert sum(f.stat().st_size for f in path.iterdir()) <= 32_000_000
    assert load_drafter(path).cfg.num_hidden_layers >= 1  # and it loads


def test_shipped_drafter_output_is_identical_to_plain_decoding_in_bf16(embedded_bf16):
    path = find_shipped_drafter(embedded_bf16.name)
    assert path is not None, "the embedded model's drafter is shipped in backend/drafters/"
    hf, tok = embedded_bf16.model, embedded_bf16.tokenizer
    plain = Engine(hf, exact=True)  # the reference: what a CPU engine with a drafter runs by default
    spec = Engine(hf, drafter=load_drafter(path))
    assert plain.fast and plain.target.exact and spec.target.exact
    for question in ["How do I install this package from source?", "Review: def first(xs): return xs[1]"]:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        params = SamplingParams(max_tokens=48)
        want = [t for b in plain.generate(ids, params) for t in b]
        got = [t for b in spec.generate(ids, params) for t in b]
        assert got == want
        assert spec.last_stats.cycles > 0 and spec.last_stats.accepted_tokens > 0  # it really drafted


def test_shipped_drafter_past_its_context_window_is_identical_to_plain_decoding(embedded_bf16):
    """The shipped drafter sees only the last 1,024 positions in its sliding layers (config.json; docs/training.md,
    "The drafter's context window"): on a conversation longer than that, as an agent's are, it still drafts tokens the
    target accepts, and the output is the plain engine's."""
    import inspect

    path = find_shipped_drafter(embedded_bf16.name)
    drafter = load_drafter(path)
    window = drafter.cfg.sliding_window
    assert window and [layer.sliding_window for layer in drafter.layers][:-1] == [window] * (len(drafter.layers) - 1)
    hf, tok = embedded_bf16.model, embedded_bf16.tokenizer
    source = inspect.getsource(Engine)  # real code as a tool result, as the personas read files
    messages = [{"role": "user", "content": "Review this class for bugs:\n\n" + source[:6000]}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert len(ids) > window + 64
    params = SamplingParams(max_tokens=40)
    want = [t for b in Engine(hf, exact=True).generate(ids, params) for t in b]
    spec = Engine(hf, drafter=drafter)
    assert [t for b in spec.generate(ids, params) for t in b] == want
    assert spec.last_stats.cycles > 0 and spec.last_stats.accepted_tokens > 0
