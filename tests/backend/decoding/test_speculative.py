"""The speculative cycle: lossless greedy decoding with every accept length, cache states equal to plain decoding's
after every cycle (KV, conv, recurrent), and speculative sampling that keeps the target's distribution."""

import json

import pytest
import torch

from backend.bench.run import tiny_model
from backend.decoding import hf_cache
from backend.decoding import speculative as spec
from backend.decoding.engine import Engine, SamplingParams
from backend.decoding.target import FastTarget
from backend.dflash.checkpoint import random_drafter
from backend.dflash.model import Draft
from backend.sampling import sampling_probs
from tests.conftest import engine_states

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_qwen35_moe():
    return tiny_model("tiny-hybrid")


def tiny_llama(**kw):
    return tiny_model("tiny-llama", **kw)


class ScriptedContext:
    """Tracks only how many positions the drafter's context covers."""

    def __init__(self):
        self.covered = 0

    def add_pending(self, features):
        self.covered += features.shape[1]

    def crop(self, n):
        self.covered = min(self.covered, n)


class ScriptedDrafter:
    """Proposes the target's own greedy continuation (`reference`: prompt + continuation, by absolute position),
    with a wrong token at draft index errors[cycle % len(errors)] (== block_size - 1: no error), so each cycle's
    accept length is chosen by the test."""

    target_layer_ids = (0,)  # the features only count positions here

    def __init__(self, reference, block_size, errors, vocab):
        self.reference, self.block_size, self.errors, self.vocab = reference, block_size, errors, vocab
        self.cycle = 0
        self.expected_accepts = []

    def check_target(self, model):
        pass

    def new_context(self):
        return ScriptedContext()

    def draft(self, ctx, token, temperature, top_p, rng):
        start = ctx.covered  # the block's known token sits at this position
        assert self.reference[start] == token
        tokens = list(self.reference[start + 1 : start + self.block_size])
        tokens += [0] * (self.block_size - 1 - len(tokens))
        error = self.errors[self.cycle % len(self.errors)]
        if error < self.block_size - 1:
            tokens[error] = (tokens[error] + 1) % self.vocab
        self.expected_accepts.append(error)
        self.cycle += 1
        return Draft(tokens=tokens, confidence=[0.5] * len(tokens), probs=None)


def _assert_same_states(a, b):
    """a, b: engines on the same path."""
    sa, sb = engine_states(a), engine_states(b)
    assert [s[0] for s in sa] == [s[0] for s in sb]
    for i, ((kind, x), (_, y)) in enumerate(zip(sa, sb)):
        assert x.shape == y.shape, (i, kind, x.shape, y.shape)
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4, msg=f"state {i} ({kind})")


def _run_lockstep(model, block, n_new, fast):
    """Speculative decoding with a scripted drafter, checked after every cycle against plain decoding of the same
    tokens. Returns (output, reference, committed block lengths, drafter, stats)."""
    prompt = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = Engine(model, **fast)
    reference = [t for b in plain.generate(prompt, SamplingParams(max_tokens=n_new)) for t in b]

    # error positions cycle through 0..block-1 (block-1: the whole draft is right), twice
    drafter = ScriptedDrafter(prompt + reference, block, errors=list(range(block)) * 2, vocab=model.config.vocab_size)
    engine = Engine(model, drafter=drafter, **fast)
    lockstep = Engine(model, **fast)
    lock_gen = lockstep.generate(prompt, SamplingParams(max_tokens=n_new))
    lock_out = []
    out, blocks = [], []
    for chunk in engine.generate(prompt, SamplingParams(max_tokens=n_new)):
        out += chunk
        blocks.append(len(chunk))
        while len(lock_out) < len(out):  # advance plain decoding to the same committed tokens
            lock_out += next(lock_gen)
        assert engine.cache_ids == lockstep.cache_ids
        _assert_same_states(engine, lockstep)
    lock_gen.close()
    return out, reference, blocks, drafter, engine.last_stats


PATHS = [dict(fast=False), dict(fast=True, exact=False), dict(fast=True, exact=True)]
PATH_IDS = ["hf", "fast", "fast_exact"]


@pytest.mark.parametrize("fast", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("make_model", [tiny_qwen35_moe, tiny_llama], ids=["qwen35_moe_hybrid", "llama"])
def test_every_accept_length_matches_plain_decoding(make_model, fast):
    block, n_new = 5, 40
    out, reference, blocks, drafter, stats = _run_lockstep(make_model(), block, n_new, fast)
    assert out == reference
    # the first block is the prefill's token; then each cycle commits accepted + 1
    accepts = [n - 1 for n in blocks[1:]]
    expected = drafter.expected_accepts[: len(accepts)]
    expected[-1] = min(expected[-1], accepts[-1])  # the last cycle may be shortened by max_tokens
    assert accepts == expected
    assert set(range(block)) <= set(accepts)  # every accept length 0..block-1 happened
    assert stats.cycles == len(accepts) and stats.accepted_tokens == sum(accepts)
    assert stats.accepted_per_position[0] == sum(a >= 1 for a in accepts)
    assert stats.generated_tokens == n_new and stats.finish_reason == "length"


@pytest.mark.parametrize("fast", PATHS, ids=PATH_IDS)
def test_state_check_catches_a_missing_rollback(monkeypatch, fast):
    """Negative control: without the Gated DeltaNet rollback the per-cycle state comparison must fail."""
    if fast["fast"]:  # speculative accepts keep their bookkeeping but skip the copy of the accepted position's states
        original = FastTarget.accept

        def accept_without_rollback(self, keep):
            linear = self.fast.model.linear
            linear.accept = lambda keep: None  # shadows LinearStateCache.accept on this instance only
            try:
                original(self, keep)
            finally:
                del linear.accept

        monkeypatch.setattr(FastTarget, "accept", accept_without_rollback)
    else:
        monkeypatch.setattr(hf_cache.ReplayRollback, "finish", lambda self, *a, **k: None)
    with pytest.raises(AssertionError, match="linear"):
        _run_lockstep(tiny_qwen35_moe(), 5, 20, fast)


@pytest.mark.parametrize("fast", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("make_model", [tiny_qwen35_moe, tiny_llama], ids=["qwen35_moe_hybrid", "llama"])
def test_random_drafter_is_lossless_and_reuses_prefix(make_model, fast):
    model = make_model()
    prompt = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    plain, specd = Engine(model, **fast), Engine(model, drafter=random_drafter(model, block_size=4), **fast)
    first = [t for b in specd.generate(prompt, SamplingParams(max_tokens=16)) for t in b]
    assert first == [t for b in plain.generate(prompt, SamplingParams(max_tokens=16)) for t in b]
    follow = prompt + first + [3, 4, 5]  # the next turn extends the conversation
    second = [t for b in specd.generate(follow, SamplingParams(max_tokens=12)) for t in b]
    assert specd.last_stats.cached_tokens == len(prompt) + len(first) - 1
    assert second == [t for b in Engine(model, **fast).generate(follow, SamplingParams(max_tokens=12)) for t in b]


@pytest.mark.parametrize("fast", PATHS, ids=PATH_IDS)
def test_adaptive_verify_length_is_lossless(fast):
    model = tiny_qwen35_moe()
    prompt = list(range(1, 20))
    ref = [t for b in Engine(model, **fast).generate(prompt, SamplingParams(max_tokens=20)) for t in b]
    engine = Engine(model, drafter=random_drafter(model, block_size=6), adaptive_verify=True, **fast)
    out = [t for b in engine.generate(prompt, SamplingParams(max_tokens=20)) for t in b]
    assert out == ref
    assert len(engine.last_stats.verify_sizes) >= 2  # it probed more than one verify length


@pytest.mark.parametrize("fast", PATHS[1:], ids=PATH_IDS[1:])
def test_verify_costs_measured_up_front_seed_the_curve_and_leave_the_engine_as_it_was(fast):
    """Engine.measure_verify_costs times a verify of every size 1..block (the adaptive verify length's curve from the
    start), leaves the cache exactly as it was (each verify abandoned), and the next generation equals one from an
    engine that never measured."""
    model = tiny_qwen35_moe()
    prompt, follow = list(range(1, 20)), list(range(1, 20)) + [7, 8]
    drafter = random_drafter(model, block_size=6)
    engine = Engine(model, drafter=drafter, adaptive_verify=True, **fast)
    assert engine.measure_verify_costs() == {}  # no context yet: nothing to verify against
    list(engine.generate(prompt, SamplingParams(max_tokens=6)))
    ids, cost = list(engine.cache_ids), engine.verify_length.cost
    cost.mean.clear()
    costs = engine.measure_verify_costs(reps=2)
    assert sorted(costs) == list(range(1, 7)) and all(t > 0 for t in costs.values())
    assert cost.mean == costs and cost.probe(6) is None  # every size measured: no probing cycles
    assert engine.cache_ids == ids
    other = Engine(model, drafter=drafter, adaptive_verify=True, **fast)
    list(other.generate(prompt, SamplingParams(max_tokens=6)))
    expect = [t for b in other.generate(follow, SamplingParams(max_tokens=12)) for t in b]
    assert [t for b in engine.generate(follow, SamplingParams(max_tokens=12)) for t in b] == expect
    assert engine.last_stats.cached_tokens == other.last_stats.cached_tokens  # the prefix reuse saw the same cache
    assert Engine(model, **fast).measure_verify_costs() == {}  # a plain engine has no verify length


def test_adaptive_length_verifies_the_whole_draft_now_and_then():
    """Acceptance is only observed where a cycle verifies: with confidences that make one token look best, every
    explore_every-th choice still verifies the whole draft, and a whole-draft choice restarts the count."""
    length = spec.VerifyLength(adaptive=True)
    length.cost.seed({n: 1.0 + 0.01 * n for n in range(1, 17)})
    low = [0.01] * 15
    chosen = [length.choose(15, low, 0.01) for _ in range(2 * length.explore_every)]
    assert chosen.count(15) == 2 and max(c for c in chosen if c != 15) <= 1
    assert chosen.index(15) == length.explore_every - 1
    assert length.choose(15, [0.99] * 15, 0.01) == 15 and length.since_whole == 0  # chosen on its merits
    assert spec.VerifyLength(adaptive=False).choose(15, low, 0.01) == 15


def test_verify_cost_curve_and_the_length_it_chooses():
    """T_t(n): measured sizes as measured, the others on the least-squares line through them (never sloping
    down); the choice maximizes expected committed tokens per second over that curve."""
    cost = spec.VerifyCostModel()
    cost.observe(16, 1.0)
    assert cost.estimates(4) == [1.0] * 4  # one size measured: the same cost everywhere
    cost.observe(8, 0.6)
    curve = cost.estimates(16)
    assert curve[15] == 1.0 and curve[7] == 0.6  # measured
    assert curve[11] == pytest.approx(0.8) and curve[0] == pytest.approx(0.25)  # on the line 0.2 + 0.05 n
    cost.observe(4, 0.9)  # a noisy point: the line may flatten but never slope down
    assert all(b >= a - 1e-12 for a, b in zip(cost.estimates(3), cost.estimates(3)[1:]))
    flat = spec.VerifyCostModel()
    for n in (16, 8):
        flat.observe(n, 1.0)
    # equal costs: verify every draft whose prefix can still be accepted
    assert spec.choose_verify_length([0.9] * 15, flat, draft_seconds=0.1) == 15
    steep = spec.VerifyCostModel()
    steep.observe(16, 16.0)
    steep.observe(8, 8.0)  # cost proportional to length: long blocks of unlikely drafts do not pay
    conf = [0.9, 0.9, 0.1] + [0.1] * 12
    expected = max(range(16), key=lambda k: sum(torch.tensor(conf[:j]).prod().item() for j in range(k + 1)) /
                   (0.1 + (k + 1)))
    assert spec.choose_verify_length(conf, steep, draft_seconds=0.1) == expected


@pytest.mark.parametrize("fast", PATHS, ids=PATH_IDS)
def test_stop_token_inside_an_accepted_block(fast):
    model = tiny_llama()
    prompt = list(range(3, 23))
    ref = [t for b in Engine(model, **fast).generate(prompt, SamplingParams(max_tokens=30)) for t in b]
    stop = ref[7]
    first = ref.index(stop)
    drafter = ScriptedDrafter(prompt + ref, 6, errors=[5], vocab=model.config.vocab_size)  # accept everything
    engine = Engine(model, drafter=drafter, **fast)
    out = [t for b in engine.generate(prompt, SamplingParams(max_tokens=30, stop_token_ids=(stop,))) for t in b]
    assert out == ref[:first] and engine.last_stats.finish_reason == "stop"
    assert engine.cache_ids == prompt + ref[:first]  # nothing past the stop token stays in the cache


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_rejection_sampling_keeps_target_distribution(top_p):
    """Synthetic target/draft distributions with context-independent rows: the committed tokens of one cycle must be
    independent draws from the target's rows, whatever the draft distribution."""
    gen = torch.Generator().manual_seed(0)
    vocab, k = 4, 2
    p = sampling_probs(torch.randn(k + 1, vocab, generator=gen) * 1.5, 1.0, top_p)
    q = sampling_probs(torch.randn(k, vocab, generator=gen) * 1.5, 1.0, top_p)
    counts = torch.zeros(vocab, vocab)
    n = 8000
    for _ in range(n):
        draft = torch.multinomial(q, 1, generator=gen)[:, 0]
        out = spec.Acceptance.empty(k + 1, "cpu")
        spec.rejection_accept(p, draft, k, q, gen, out)
        accepted, committed = spec.read_acceptance(out.result)
        assert committed[:accepted] == draft[:accepted].tolist() and out.keep.item() == accepted + 1
        assert out.token.item() == committed[accepted]
        if len(committed) >= 2:
            counts[committed[0], committed[1]] += 1
        else:  # rejected at position 0: the second token would come from the next cycle; draw it from p[1]
            counts[committed[0], int(torch.multinomial(p[1], 1, generator=gen))] += 1
    joint = p[0][:, None] * p[1][None, :]
    assert _chi_square_pvalue(counts.flatten(), joint.flatten()) > 1e-3


@pytest.mark.parametrize("fast", [dict(fast=False), dict(fast=True)], ids=["hf", "fast"])
def test_speculative_sampling_end_to_end_matches_target_distribution(fast):
    """A tiny target with 4 tokens and an untrained drafter: the distribution of the first three generated tokens
    (which span the prefill's token and a speculative cycle's positions 0 and 1) equals the target's."""
    model = tiny_llama(vocab=4, hidden=32, layers=1, seed=3)
    prompt = [1, 2, 3, 0, 1]
    drafter = random_drafter(model, block_size=3, seed=5)
    with torch.no_grad():  # an overconfident, wrong drafter makes rejections (and residual draws) common
        drafter.fc.weight.mul_(50)
    engine = Engine(model, drafter=drafter, **fast)
    n = 1500
    counts = torch.zeros(4, 4, 4)
    for seed in range(n):
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=seed)  # one cycle verifies 2 drafts
        out = [t for b in engine.generate(prompt, params) for t in b]
        counts[out[0], out[1], out[2]] += 1
    # exact target probabilities of every 3-token continuation
    with torch.no_grad():
        probs = torch.zeros(4, 4, 4)
        for a in range(4):
            for b in range(4):
                logits = model(torch.tensor([prompt + [a, b]])).logits[0].float()
                pr = torch.softmax(logits, -1)
                probs[a, b] = pr[-3, a] * pr[-2, b] * pr[-1]
    assert torch.allclose(probs.sum(), torch.tensor(1.0), atol=1e-5)
    assert engine.last_stats.cycles >= 1
    assert _chi_square_pvalue(counts.flatten(), probs.flatten()) > 1e-3


def test_bench_reports_the_seed_table(tmp_path, capsys):
    from backend.bench.run import main

    out = tmp_path / "spec.json"
    assert main(model="tiny-moe", drafter="random", device="cpu", prompts=2, max_tokens=10, json_out=out,
                block_size=4, threads=1) == 0
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert runs["plain"]["identical_to_hf_generate"] and runs["speculative"]["identical_to_plain"]
    assert runs["speculative_adaptive"]["identical_to_plain"]
    # the adaptive run's cost curve, measured before it: every verify size of the 4-token block
    assert sorted(runs["speculative_adaptive"]["verify_cost_ms_at_load"]) == ["1", "2", "3", "4"]
    spec_run = runs["speculative"]
    assert spec_run["cycles"] > 0 and spec_run["tau"] >= 1.0 and len(spec_run["acceptance_per_position"]) == 3
    assert spec_run["eta_predicted"] > 0 and spec_run["eta_measured"] > 0
    assert spec_run["experts_per_layer"]["of"] == 16 and spec_run["experts_per_layer"]["decode_step"] == 2
    assert {"command", "date", "machine"} <= set(res)
    assert "eta predicted" in capsys.readouterr().out
    assert main(model="no-such-model", drafter="none", device="cpu", prompts=1, max_tokens=2) == 2


def test_bench_routing_trace_routes_by_position_among_the_hot_experts(tmp_path, capsys):
    """--routing-trace: every fast-path engine routes each layer's tokens among HOT experts, by position, so a
    verify block wakes at most HOT experts per layer and speculative output still equals plain decoding."""
    from backend.bench.run import main
    from backend.bench.routing import PERIOD, install_routing_trace, trace_distinct_experts
    from backend.models import load_fast

    out = tmp_path / "trace.json"
    assert main(model="tiny-moe", drafter="random", device="cpu", prompts=2, max_tokens=12, json_out=out,
                block_size=8, threads=1, compare_hf=False, routing_trace=4) == 0
    res = json.loads(out.read_text())
    spec_run = res["runs"]["speculative"]
    assert spec_run["identical_to_plain"] and spec_run["cycles"] > 0
    assert spec_run["experts_per_layer"]["verify_block"] <= 4 and spec_run["experts_per_layer"]["decode_step"] == 2
    assert res["routing_trace"]["hot_experts"] == 4 and 2 < res["routing_trace"]["distinct_experts_per_16_positions"] <= 4
    # a position routes alike in a decode step and inside a verify block
    fast = load_fast(tiny_qwen35_moe(), max_context=64)
    tables = install_routing_trace(fast, hot=6)
    assert all(t.shape == (PERIOD, 2) and t.unique().numel() == 6 for t in tables)  # each layer: its 6 hot experts
    seen = []
    moe = [m for m in fast.model.modules() if type(m).__name__ == "SparseMoE"][0]
    traced = moe.route

    def recording(h, **kw):
        weights, ids = traced(h, **kw)
        seen.append(ids)
        return weights, ids
    moe.route = recording
    fast.prefill(list(range(1, 10)))
    fast.decode(3)  # position 9
    fast.verify([3, 4, 5, 6])  # positions 10..13
    fast.accept(1)  # keeps position 10
    fast.decode(4)  # position 11 again, now as a decode step
    assert torch.equal(seen[-1][0], seen[-2][1]) and torch.equal(seen[-1][0], tables[0][11])
    assert not torch.equal(seen[-2][0], seen[-2][1]) or not torch.equal(seen[-2][1], seen[-2][2])
    assert trace_distinct_experts(tables, 1) == 2
    capsys.readouterr()
    # user mistakes: one line, exit code 2
    assert main(model="tiny-moe", drafter="random", device="cpu", prompts=1, max_tokens=4, routing_trace=4) == 2
    assert "--no-hf" in capsys.readouterr().err
    assert main(model="tiny-moe", drafter="random", device="cpu", prompts=1, max_tokens=4, compare_hf=False,
                routing_trace=1) == 2
    assert "hot set" in capsys.readouterr().err
    assert main(model="tiny-llama", drafter="random", device="cpu", prompts=1, max_tokens=4, compare_hf=False,
                routing_trace=4) == 2
    assert "MoE" in capsys.readouterr().err


def test_bench_llama_invariant_path_is_recorded(tmp_path, capsys):
    """--llama-invariant reaches every engine of the run (Engine(llama_invariant_path=...): no class attribute is
    set) and the record says which path it asked for; a bad value is a one-line error. On the CPU the reference
    engine runs in exact mode whatever the path (the invariant numerics are CUDA's default), so the record shows the
    rows step path with no tensor-core set."""
    import json

    from backend.bench.run import cli
    from backend.models.numerics import LLAMA_INVARIANT_PATH

    other = "glue" if LLAMA_INVARIANT_PATH == "mma" else "mma"
    out = tmp_path / "b.json"
    assert cli(["--model", "tiny-llama", "--prompts", "1", "--max-tokens", "4", "--no-hf", "--adaptive", "off",
                "--llama-invariant", other, "--json", str(out)]) == 0
    engine = json.loads(out.read_text())["engine"]
    assert engine["llama_invariant_path"] == other and engine["numerics"] == "exact"
    assert engine["llama_step_path"] == "rows" and engine["llama_mma_projections"] == []
    capsys.readouterr()
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        cli(["--model", "tiny-llama", "--llama-invariant", "fast"])
    assert "invalid choice" in capsys.readouterr().err
    from backend.bench.run import main
    assert main(model="tiny-llama", prompts=1, max_tokens=4, compare_hf=False, llama_invariant="fast") == 2
    assert "--llama-invariant must be glue or mma" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("exact", [False, True], ids=["graphs", "graphs_exact"])
@pytest.mark.parametrize("make_model", [tiny_qwen35_moe, tiny_llama], ids=["qwen35_moe_hybrid", "llama"])
def test_cuda_engine_fast_path_is_lossless(make_model, exact):
    """The engine on the GPU: FastTarget with CUDA graphs (fp32 tiny targets: rounding far below argmax margins),
    speculative output identical to plain decoding, prefix reuse included."""
    model = make_model().cuda()
    prompt = list(range(3, 40))
    plain = Engine(model, fast=True, exact=exact)
    specd = Engine(model, drafter=random_drafter(model, block_size=6), fast=True, exact=exact)
    assert plain.fast and plain.target.fast.cuda_graphs
    ref = [t for b in plain.generate(prompt, SamplingParams(max_tokens=40)) for t in b]
    assert [t for b in specd.generate(prompt, SamplingParams(max_tokens=40)) for t in b] == ref
    follow = prompt + ref + [5, 6]
    again = [t for b in specd.generate(follow, SamplingParams(max_tokens=20)) for t in b]
    assert again == [t for b in Engine(model, fast=True, exact=exact).generate(follow, SamplingParams(max_tokens=20))
                     for t in b]
    assert specd.last_stats.cached_tokens > len(prompt)


@pytest.mark.parametrize("loop", ["plain", "host_cycle", "device_cycle"])
def test_no_step_or_cycle_begins_after_the_cancel_flag_is_seen(loop):
    """Issue 42: the server sets the cancel flag the moment a client goes away; every decoding loop (plain steps, the
    host's speculative cycle that the CPU serves with, the device cycle that the GPU serves with, run here on the
    CPU) must check it before it begins the next step or cycle, so the engine is free within the one in flight. The
    flag turns on as the consumer takes the second block: nothing more may be yielded, and no cycle may be counted
    after it (the device cycle's verify queued before that yield is dropped, not run to completion)."""
    model = tiny_llama()
    prompt = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    drafter = None if loop == "plain" else random_drafter(model, block_size=4)
    engine = Engine(model, drafter=drafter, fast=True, exact=False, device_cycle=loop == "device_cycle")
    blocks, at_flag = [], {}

    def cancelled() -> bool:
        if len(blocks) >= 2 and not at_flag:
            at_flag.update(cycles=engine.last_stats.cycles, tokens=engine.last_stats.generated_tokens)
        return len(blocks) >= 2

    for block in engine.generate(prompt, SamplingParams(max_tokens=60), cancelled=cancelled):
        blocks.append(block)
    stats = engine.last_stats
    assert len(blocks) == 2 and stats.finish_reason == "cancelled", (blocks, stats.finish_reason)
    assert at_flag and stats.cycles == at_flag["cycles"], (stats.cycles, at_flag)
    if loop == "plain":
        assert stats.generated_tokens == at_flag["tokens"] == 2
    # the engine is left consistent: the next request decodes as a fresh plain engine does
    follow = prompt + [3, 4]
    expect = [t for b in Engine(model, fast=True, exact=False).generate(follow, SamplingParams(max_tokens=12)) for t in b]
    assert [t for b in engine.generate(follow, SamplingParams(max_tokens=12)) for t in b] == expect
