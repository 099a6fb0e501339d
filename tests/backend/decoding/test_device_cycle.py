"""The speculative cycle on the device (backend/decoding/device_cycle.py + backend/dflash/fast.py): the drafter
over static caches, the acceptance test on the device, one host sync per cycle.

CPU tests (CI) run the same cycle without CUDA graphs on tiny fp32 targets, where any two ways of computing a
position agree far below argmax margins: output identical to plain decoding with every accept length (forced
acceptance), stops, prefix reuse, the FastDrafter against the eager drafter. CUDA tests (skipped without a GPU; run
on the H200) add what only a GPU shows: the drafter's CUDA graph against its eager forward, bitwise logits of a
position in a decode step and inside verify blocks of every size (the batch invariance that makes bf16 speculation
lossless), and speculative == plain greedy on the embedded model's real weights in the default configuration.
"""

from __future__ import annotations

import time

import pytest
import torch

from backend.bench.run import tiny_model
from backend.dflash.checkpoint import random_drafter
from backend.decoding.engine import Engine, SamplingParams
from backend.dflash.fast import FastDrafter
from backend.decoding.device_cycle import ForcedAcceptance

pytestmark = pytest.mark.usefixtures("one_torch_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def generate(engine, prompt, **kw):
    return [t for block in engine.generate(prompt, SamplingParams(**kw)) for t in block]


def prompts(n, length=30, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length + 5 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("kind", ["tiny-llama", "tiny-hybrid"])
def test_device_cycle_equals_plain_decoding_at_every_accept_length(kind):
    """Forced acceptance feeds the cycle plain decoding's own tokens up to a random accept length: every length
    1..15 occurs, and the output is still exactly plain decoding's (a wrong commit, cache or drafter length would
    change it)."""
    model = tiny_model(kind)
    plain = Engine(model, max_context=512, fast=True, exact=False)
    engine = Engine(model, drafter=random_drafter(model, block_size=16), max_context=512, fast=True, exact=False,
                    device_cycle=True)
    assert engine.fast_drafter is not None
    seen = set()
    for i, prompt in enumerate(prompts(3)):
        ref = generate(plain, prompt, max_tokens=90)
        for tau in (3.0, 12.0):
            engine.forced_acceptance = ForcedAcceptance(ref, tau, 128, engine.device, seed=i)
            assert generate(engine, prompt, max_tokens=90) == ref
            stats = engine.last_stats
            assert stats.generated_tokens == len(ref) and engine.draft_context.length == len(engine.target.ids)
            assert stats.first_draft_seconds > 0 and stats.draft_seconds > 0  # the first draft timed apart
            seen |= {k for k, n in enumerate(stats.accepted_per_position) if n}
    assert stats.tau > 4 and len(seen) >= 12, (stats.tau, seen)


def test_forced_acceptance_proposes_the_reference_then_misses_at_a_geometric_length():
    """The forcing's proposal: the plain continuation up to the drawn accept length, then tokens that cannot match;
    accept lengths follow the geometric law (mean tau - 1 drafts when the block does not cut them short)."""
    ref = list(range(10, 70))
    forced = ForcedAcceptance(ref, 4.0, vocab=64, device="cpu", seed=3)
    block = torch.full((16,), -1, dtype=torch.long)
    lengths = []
    for produced in (1, 20, 40):
        for _ in range(50):
            block[0] = ref[produced - 1]
            state = forced.rng.getstate()
            a = forced.draw(15)  # the length propose() will draw, from the same state
            forced.rng.setstate(state)
            forced.propose(block, produced, 15)
            assert block[1:a + 1].tolist() == ref[produced:produced + a]
            assert block[a + 1:].tolist() == [(t + 1) % 64 for t in ref[produced + a:produced + 15]]
            assert block[0] == ref[produced - 1]
            lengths.append(a)
    assert {0, 1, 2, 3} <= set(lengths)
    draws = [forced.draw(1000) for _ in range(4000)]
    assert abs(sum(draws) / len(draws) - 3.0) < 0.2  # tau 4: 3 accepted drafts on average


def test_forced_acceptance_shows_the_adaptive_length_its_laws_confidences():
    """With forcing, the adaptive verify length reads the law's confidences (1 - 1/tau per draft), not the random
    drafter's near-zero ones: it verifies long blocks where the law accepts long prefixes, and the output is still
    plain decoding's."""
    model = tiny_model("tiny-hybrid")
    plain = Engine(model, max_context=512, fast=True, exact=False)
    engine = Engine(model, drafter=random_drafter(model, block_size=16), max_context=512, fast=True, exact=False,
                    device_cycle=True, adaptive_verify=True)
    prompt = prompts(1)[0]
    ref = generate(plain, prompt, max_tokens=80)
    engine.forced_acceptance = ForcedAcceptance(ref, 8.0, 128, engine.device, seed=0)
    assert engine.forced_acceptance.confidence(3) == [1 - 1 / 8.0] * 3
    generate(engine, prompt, max_tokens=8)  # a context to measure against
    engine.measure_verify_costs(reps=1)
    engine.forced_acceptance = ForcedAcceptance(ref, 8.0, 128, engine.device, seed=0)
    assert generate(engine, prompt, max_tokens=80) == ref
    sizes = engine.last_stats.verify_sizes
    long_blocks = sum(c for n, c in sizes.items() if n >= 8)
    assert long_blocks >= sum(sizes.values()) / 2 and engine.last_stats.tau > 3, sizes


def test_device_cycle_without_forcing_stops_and_reuses_like_plain():
    model = tiny_model("tiny-hybrid")
    plain = Engine(model, max_context=512, fast=True, exact=False)
    engine = Engine(model, drafter=random_drafter(model, block_size=8, num_layers=2), max_context=512, fast=True,
                    exact=False, device_cycle=True, adaptive_verify=True)
    first, second = prompts(2)
    ref = generate(plain, first, max_tokens=40)
    assert generate(engine, first, max_tokens=40) == ref
    stop = ref[7]
    cut = generate(plain, first, max_tokens=40, stop_token_ids=(stop,))
    assert generate(engine, first, max_tokens=40, stop_token_ids=(stop,)) == cut
    assert engine.last_stats.finish_reason == "stop" and engine.draft_context.length == len(engine.target.ids)
    follow = first + ref + [5, 6]
    assert generate(engine, follow, max_tokens=20) == generate(plain, follow, max_tokens=20)
    assert engine.last_stats.cached_tokens > 0
    sampled = generate(engine, second, max_tokens=30, temperature=0.9, seed=4)
    assert len(sampled) == 30 and all(0 <= t < 128 for t in sampled)


def test_the_commit_is_timed_as_rollback_not_left_to_the_host(monkeypatch):
    """The commit after each sync (target.accept: a hybrid target replays its Gated DeltaNet states to the kept
    prefix there) is timed with the acceptance test as rollback_seconds, so the bench's host share (what a cycle
    spends outside draft, verify and rollback) does not carry it. A commit made 20 ms slower must show up there in
    every cycle but the last (whose commit no later sync waits for)."""
    from backend.decoding.target import FastTarget

    model = tiny_model("tiny-hybrid")
    engine = Engine(model, drafter=random_drafter(model, block_size=8, num_layers=2), max_context=512, fast=True,
                    exact=False, device_cycle=True)
    prompt = prompts(1)[0]
    ref = generate(engine, prompt, max_tokens=24)
    accept = FastTarget.accept

    def slow_accept(self, keep, ids=None):
        time.sleep(0.02)
        accept(self, keep, ids)

    monkeypatch.setattr(FastTarget, "accept", slow_accept)
    assert generate(engine, prompt, max_tokens=24) == ref
    stats = engine.last_stats
    assert stats.cycles >= 3 and stats.rollback_seconds >= 0.02 * (stats.cycles - 1), stats


@pytest.mark.parametrize("kind", ["tiny-llama", "tiny-hybrid"])
def test_a_consumer_that_stops_at_a_yield_drops_the_queued_verify(kind):
    """The cycle queues its next verify before it yields, so a consumer that closes the generator or cancels at a
    yield leaves one tentative verify behind: it must be dropped, the caches and the drafter's context covering
    exactly what was yielded (all but the last token, which the next block starts with), and the next request must decode exactly as plain decoding does."""
    model = tiny_model(kind)
    plain = Engine(model, max_context=512, fast=True, exact=False)
    engine = Engine(model, drafter=random_drafter(model, block_size=16), max_context=512, fast=True, exact=False,
                    device_cycle=True)
    first, second = prompts(2)
    ref = generate(plain, first, max_tokens=60)
    fast = engine.target.fast

    def consistent():
        return fast.length == len(engine.target.ids) == engine.draft_context.length and not fast._pending

    # closed at the third yield, with forced acceptance so that blocks are long
    engine.forced_acceptance = ForcedAcceptance(ref, 6.0, 128, engine.device, seed=1)
    gen = engine.generate(first, SamplingParams(max_tokens=60))
    got = [t for _, block in zip(range(3), gen) for t in block]
    assert fast._pending  # a verify is queued behind the third yield
    gen.close()
    assert got == ref[:len(got)] and engine.cache_ids == first + got[:-1] and consistent()
    # cancelled while the consumer holds the second block
    blocks = []
    out = engine.generate(first, SamplingParams(max_tokens=60), cancelled=lambda: len(blocks) >= 2)
    for block in out:
        blocks.append(block)
    got = [t for b in blocks for t in b]
    assert engine.last_stats.finish_reason == "cancelled" and len(blocks) == 2
    assert got == ref[:len(got)] and engine.cache_ids == first + got[:-1] and consistent()
    engine.forced_acceptance = None
    assert generate(engine, second, max_tokens=40) == generate(plain, second, max_tokens=40)
    follow = first + got + [3, 4]  # reuses the cut-back cache
    assert generate(engine, follow, max_tokens=30) == generate(plain, follow, max_tokens=30)
    assert consistent()


def test_fast_drafter_drafts_what_the_eager_drafter_drafts():
    """FastDrafter (static caches, device masks, no graphs on the CPU) against DFlashDrafter.draft on the same
    context, with sliding and causal layers: same tokens, same confidences (fp32)."""
    model = tiny_model("tiny-llama")
    drafter = random_drafter(model, block_size=8, num_layers=3, block_attention="mixed")
    drafter.cfg.sliding_window = 24
    for layer, kind in zip(drafter.layers, ["sliding_attention", "full_attention", "sliding_attention"]):
        layer.sliding_window = 24 if kind == "sliding_attention" else None
        layer.causal = kind == "sliding_attention"
    drafter.check_target(model)
    feats = torch.randn(1, 40, len(drafter.target_layer_ids) * drafter.cfg.hidden_size) * 3
    ctx = drafter.new_context()
    ctx.add_pending(feats)
    eager = drafter.draft(ctx, 17, 0.0, 1.0, torch.Generator())
    fast = FastDrafter(drafter, max_context=128)
    fast.add_pending(feats)
    fast.launch(token=17)
    assert fast.block_tokens.tolist() == [17] + eager.tokens
    torch.testing.assert_close(fast.confidence, torch.tensor(eager.confidence), rtol=1e-4, atol=1e-5)


def test_engine_says_whether_speculation_is_lossless():
    """What `reviewer serve` prints in its ready line: plain, or speculative and lossless (exact mode, or batch-
    invariant kernels), or speculative and not guaranteed identical (the transformers path)."""
    model = tiny_model("tiny-llama")
    drafter = random_drafter(model)
    assert Engine(model).lossless and "plain decoding" in Engine(model).describe_decoding()
    exact = Engine(model, drafter=drafter)  # a CPU engine with a drafter runs in exact mode
    assert exact.lossless and "lossless" in exact.describe_decoding() and "exact mode" in exact.describe_decoding()
    hf = Engine(model, drafter=drafter, fast=False)
    assert not hf.lossless and "NOT lossless" in hf.describe_decoding()


# ---- on the GPU -----------------------------------------------------------------------------------------------------


@cuda
def test_cuda_drafter_graph_equals_its_eager_forward():
    """The CUDA graph computes the eager forward's function: same drafts, same context length, confidences equal
    to rounding (on the H200 cuBLAS and SDPA may pick other kernels under capture: last-bit differences were seen;
    drafts never reach the output unverified, so bitwise equality is not what losslessness needs)."""
    model = tiny_model("tiny-llama").cuda()
    drafter = random_drafter(model, block_size=16, num_layers=2)
    drafter.check_target(model)
    feats = torch.randn(1, 50, len(drafter.target_layer_ids) * drafter.cfg.hidden_size, device="cuda")
    block = torch.randn(16, feats.shape[-1], device="cuda")
    results = []
    for graphs in (True, False):
        fd = FastDrafter(drafter, max_context=256, cuda_graphs=graphs)
        fd.add_pending(feats)
        fd.launch(token=5)
        first = fd.block_tokens.clone(), fd.confidence.clone()
        keep = torch.tensor([9], device="cuda")
        fd.launch(features=block, rows=12, keep=keep, token=torch.tensor([7], device="cuda"))
        fd.launch(features=block, rows=12, keep=keep, token=torch.tensor([8], device="cuda"))  # a replay
        torch.cuda.synchronize()
        results.append((first, fd.block_tokens.clone(), fd.confidence.clone(), int(fd.length_dev)))
    (f1, t1, c1, n1), (f2, t2, c2, n2) = results
    assert n1 == n2 == 50 + 18
    assert torch.equal(f1[0], f2[0]) and torch.equal(t1, t2), (f1, f2, t1, t2)
    torch.testing.assert_close(f1[1], f2[1], rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(c1, c2, rtol=1e-2, atol=1e-4)


@cuda
def test_cuda_drafter_block_kernel_drafts_what_the_eager_drafter_drafts():
    """FastDrafter on the GPU attends through reviewer_kernels/block_attention.py (causal and bidirectional layers, no
    mask) and gathers RoPE from its tables: the same drafts as DFlashDrafter.draft's SDPA over a concatenated context,
    and confidences to rounding (fp32), for a first draft and for drafts after absorbing verify features."""
    model = tiny_model("tiny-llama").cuda()
    drafter = random_drafter(model, block_size=8, num_layers=3, block_attention="mixed")
    for layer, causal in zip(drafter.layers, [True, False, True]):
        layer.sliding_window, layer.causal = None, causal
    drafter.check_target(model)
    feats = torch.randn(1, 40, len(drafter.target_layer_ids) * drafter.cfg.hidden_size, device="cuda") * 3
    more = torch.randn(1, 5, feats.shape[-1], device="cuda") * 3
    fast = FastDrafter(drafter, max_context=128)
    assert fast.block_kernel
    fast.add_pending(feats)
    ctx = drafter.new_context()
    ctx.add_pending(feats)
    for token, absorbed in ((17, None), (23, more)):
        if absorbed is not None:  # a verify's features, all kept
            ctx.add_pending(absorbed)
            fast.launch(token=token, features=absorbed[0], rows=5, keep=torch.tensor([5], device="cuda"))
        else:
            fast.launch(token=token)
        eager = drafter.draft(ctx, token, 0.0, 1.0, torch.Generator(device="cuda"))
        torch.cuda.synchronize()
        assert fast.block_tokens.tolist() == [token] + eager.tokens
        torch.testing.assert_close(fast.confidence, torch.tensor(eager.confidence, device="cuda"), rtol=1e-3,
                                   atol=1e-4)


def _embedded():
    from backend.loading import ModelLoadError, load_model

    try:
        return load_model("embedded", device="cuda", dtype="bfloat16")
    except ModelLoadError as exc:
        pytest.skip(f"the embedded model is not installed here: {exc}")


@cuda
@pytest.mark.parametrize("step_path", ["rows", "glue", "mma"])
def test_cuda_embedded_position_logits_are_batch_invariant(step_path):
    """A position's logits in bf16 are bitwise the same from a plain decode step and from inside a verify block of
    every size 2..16 (CUDA graphs, compiled glue), also after a prefix-reuse cut of the cache: on the row kernels
    (the one-token numerics, Engine(invariant_verify=False)), on the glue over cuBLAS (the invariant numerics with
    llama_invariant_path "glue", where cuBLAS passes its check) and on the tensor-core row kernels (the invariant
    numerics' default, "mma")."""
    from backend.models import Numerics, invariant_numerics, load_fast

    loaded = _embedded()
    numerics = Numerics() if step_path == "rows" else invariant_numerics("test", step_path)
    fm = load_fast(loaded.model, max_context=2048, compile=True, numerics=numerics)
    if step_path == "mma":
        assert fm.model.step_path == "rows" and fm.model.numerics.llama.mma_projections and fm.model.batch_invariant
    if step_path == "glue" and not fm.model.glue_steps:
        pytest.skip("cuBLAS is not row-invariant on this device: speculative engines keep the row kernels")
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Explain pytest fixtures."}],
                                                  add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    for reuse in (False, True):
        fm.reset()
        if reuse:  # a longer prompt first, then cut back: stale columns past the length must not matter
            fm.prefill(prompt + list(range(100, 160)))
            fm.truncate(len(prompt) - 1)
            logits, _ = fm.prefill(prompt[-1:])
        else:
            logits, _ = fm.prefill(prompt)
        tokens, steps = [], []
        for _ in range(16):
            tokens.append(int(logits.argmax()))
            logits, _ = fm.decode(tokens[-1])
            steps.append(logits)
        fm.truncate(len(prompt))
        for size in range(2, 17):
            block_logits, _ = fm.verify(tokens[:size])
            fm.accept(1)
            fm.truncate(len(prompt))
            for j in range(size):
                assert torch.equal(block_logits[j], steps[j]), (reuse, size, j)


@cuda
@pytest.mark.parametrize("invariant_path", ["glue", "mma"])
def test_cuda_embedded_speculative_equals_plain_greedy(invariant_path):
    """The shipped drafter on the embedded model's real weights, bf16, the engine's GPU defaults (and each of
    Llama's invariant paths): speculative output is token-identical to plain decoding on every prompt."""
    from backend.bench.run import PROMPTS, make_prompts
    from backend.chat import stop_token_ids
    from backend.dflash.checkpoint import find_shipped_drafter, load_drafter
    loaded = _embedded()
    drafter = load_drafter(find_shipped_drafter(loaded.name))
    # `--drafter none`: the same numerics by default
    plain = Engine(loaded.model, max_context=4096, llama_invariant_path=invariant_path)
    engine = Engine(loaded.model, drafter=drafter, max_context=4096, llama_invariant_path=invariant_path)
    assert engine.fast_drafter is not None and not engine.target.exact and engine.lossless
    assert plain.numerics.kind == engine.numerics.kind == "invariant" and plain.numerics.llama == engine.numerics.llama
    assert engine.invariant_verify and "lossless" in engine.describe_decoding()
    stops = stop_token_ids(loaded.tokenizer, loaded.model.generation_config)
    for prompt in make_prompts(loaded.tokenizer, len(PROMPTS), 0):
        ref = generate(plain, prompt, max_tokens=128, stop_token_ids=stops)
        assert generate(engine, prompt, max_tokens=128, stop_token_ids=stops) == ref
    assert engine.last_stats.tau > 1.5
