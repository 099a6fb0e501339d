"""What a served engine replays on the GPU: CUDA graphs that do not depend on the context length, all captured before
the ready line, and one numerics, so `--drafter none` and a speculative engine give the same text.

CUDA tests (skipped without a GPU): a graph captured at one length replays bitwise the logits an eager forward gives
at other lengths (target decode step, verify, drafter cycle); after Engine.warm_up() a conversation whose context grows
turn by turn captures nothing; on the embedded model's real weights a plain engine with the defaults and the
speculative engine give identical text over a multi-turn conversation with prefix reuse. The CPU test: the capture
counters' bookkeeping and their export on /metrics' names.
"""

from __future__ import annotations

import pytest
import torch

from backend.bench.run import tiny_model
from backend.decoding.engine import Engine, SamplingParams
from backend.dflash.checkpoint import random_drafter
from backend.dflash.fast import FastDrafter
from backend.models import captures, load_fast

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_captures_after_the_ready_line_are_counted_apart(monkeypatch):
    counts = captures.CaptureCounts()
    monkeypatch.setattr(captures, "COUNTS", counts)
    captures.note_capture("target", (1,))
    captures.note_compilation("kernel")
    assert (counts.captures, counts.captures_after_ready, counts.compilations_after_ready) == (1, 0, 0)
    captures.mark_ready()
    captures.note_capture("drafter", (3,))
    captures.note_capture("target", (2,))
    captures.note_compilation("kernel")
    assert (counts.captures, counts.captures_after_ready) == (3, 2)
    assert (counts.compilations, counts.compilations_after_ready) == (2, 1)
    assert counts.after_ready == ["graph drafter (3,)", "graph target (2,)", "kernel"]  # named, for the records


def test_metrics_export_the_capture_counts():
    from backend.server.metrics import Metrics

    metrics, counts = Metrics(), captures.CaptureCounts(captures=5, captures_after_ready=2, compilations=7)
    metrics.watch_captures(counts)
    text = metrics.render().decode()
    assert "reviewer_graph_captures_total 5.0" in text
    assert "reviewer_graph_captures_after_ready_total 2.0" in text
    assert "reviewer_compilations_total 7.0" in text and "reviewer_compilations_after_ready_total 0.0" in text
    counts.captures_after_ready = 3  # read at each scrape
    assert "reviewer_graph_captures_after_ready_total 3.0" in metrics.render().decode()


@cuda
@pytest.mark.parametrize("kind", ["tiny-llama", "tiny-hybrid"])
def test_cuda_one_graph_replays_eager_bits_at_every_length(kind):
    """Graphs captured at the first length (the whole cache as attention span) give, at three other lengths,
    exactly the logits of the same forwards run eagerly with the exact span: the decode step and verifies of 1, 5
    and 16 tokens. The graph count does not grow with the length."""
    model = tiny_model(kind).to("cuda", torch.bfloat16)
    graphs = load_fast(model, 2048, cuda_graphs=True)
    eager = load_fast(model, 2048, cuda_graphs=False)
    g = torch.Generator().manual_seed(1)
    held = None
    for length in (7, 300, 1100, 1900):
        prompt = torch.randint(0, 128, (length,), generator=g).tolist()
        block = torch.randint(0, 128, (16,), generator=g).tolist()
        outs = []
        for fm in (graphs, eager):
            fm.reset()
            fm.prefill(prompt)
            logits = [fm.decode(block[0])[0]]
            for T in (1, 5, 16):
                logits.append(fm.verify(block[:T])[0])
                fm.abandon()  # the caches as the step left them (Gated DeltaNet states are not advanced by a verify)
            outs.append(logits)
        for a, b in zip(*outs):
            assert torch.equal(a, b), length
        if held is None:
            held = len(graphs._graphs)
        assert len(graphs._graphs) == held, "a new length captured a new graph"


def windowed(drafter, window: int):
    """The same drafter with a sliding window in its first layer (the released Qwen3.6 drafter: 5 of 6 layers)."""
    from dataclasses import replace

    from backend.dflash.model import DFlashDrafter

    layers = drafter.cfg.num_hidden_layers
    cfg = replace(drafter.cfg, layer_types=["sliding_attention"] + ["full_attention"] * (layers - 1),
                  sliding_window=window)
    out = DFlashDrafter(cfg)
    out.load_state_dict(drafter.state_dict())
    return out.eval()


@cuda
@pytest.mark.parametrize("window", [None, 300], ids=["full", "sliding"])
def test_cuda_drafter_graph_replays_eager_bits_at_every_length(window):
    """The drafter's cycle graph (whole-cache span) drafts, at several context lengths, bitwise what its body drafts
    eagerly over the exact span, and one graph per absorbed-rows count serves them all; with a sliding window as
    well (the kernel's window), whose drafts agree with SDPA's masked attention."""
    model = tiny_model("tiny-llama").to("cuda", torch.bfloat16)
    unwindowed = random_drafter(model, block_size=16, num_layers=2)
    drafter = windowed(unwindowed, window) if window else unwindowed
    drafter, unwindowed = drafter.to("cuda", torch.bfloat16), unwindowed.to("cuda", torch.bfloat16)
    drafter.check_target(model)
    unwindowed.check_target(model)  # the SDPA reference below drafts with it too (binds the target's embedding)
    width = len(drafter.target_layer_ids) * drafter.cfg.hidden_size
    fd = FastDrafter(drafter, max_context=2048)
    assert fd.block_kernel
    g = torch.Generator(device="cuda").manual_seed(2)
    for length in (10, 700, 1500):
        feats = torch.randn(1, length, width, device="cuda", generator=g, dtype=torch.bfloat16)
        block = torch.randn(16, width, device="cuda", generator=g, dtype=torch.bfloat16)
        results = []
        for replay in (True, False):
            fd.reset()
            fd.add_pending(feats)
            fd.token_dev.fill_(11)
            fd.features[:6].copy_(block[:6])
            fd.keep_dev.fill_(4)
            if replay:
                fd.launch(features=fd.features, rows=6)
            else:  # the same body, eagerly, attending over the exact span (in inference mode, as launch() runs:
                # with autograd on, torch.compile builds other kernels for the glue, with other roundings)
                with torch.inference_mode():
                    fd.logits = fd._body(6, length + 6 + fd.block_size)
            torch.cuda.synchronize()
            results.append((fd.block_tokens.clone(), fd.logits.clone(), int(fd.length_dev)))
        (t1, l1, n1), (t2, l2, n2) = results
        assert n1 == n2 == length + 4
        assert torch.equal(t1, t2) and torch.equal(l1, l2), length
        if window and length > window:  # the same cycle through SDPA and a mask (eager _body calls), with the
            # window and without: the kernel's drafts sit far closer to the windowed ones than the window moves them
            refs = []
            for d in (drafter, unwindowed):
                sdpa = FastDrafter(d, max_context=2048)
                sdpa.block_kernel = False  # _body's other path: the cache write, a mask and SDPA
                sdpa.add_pending(feats)
                sdpa.token_dev.fill_(11)
                sdpa.features[:6].copy_(block[:6])
                sdpa.keep_dev.fill_(4)
                with torch.inference_mode():
                    refs.append(sdpa._body(6, length + 6 + sdpa.block_size).float())
            gap, moved = (refs[0] - l1.float()).abs().max().item(), (refs[0] - refs[1]).abs().max().item()
            assert gap < moved / 4, (length, gap, moved)
    assert sorted(fd._graphs) == [(6, fd.max_context)]


def _embedded():
    from backend.loading import ModelLoadError, load_model

    try:
        return load_model("embedded", device="cuda", dtype="bfloat16")
    except ModelLoadError as exc:
        pytest.skip(f"the embedded model is not installed here: {exc}")


def _conversation(tokenizer, turns: int = 6):
    """A conversation whose context grows by a few hundred tokens a turn (text of a real file, held out from the
    drafter's training prompts: this test module's own source)."""
    text = open(__file__).read()
    messages = [{"role": "system", "content": "You review Python code. Answer briefly."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Part {i + 1} of the file:\n" + text[i * 900:(i + 1) * 900]})
        yield messages


@cuda
def test_cuda_after_warm_up_a_growing_conversation_captures_nothing():
    """The server's sequence: Engine.warm_up(), mark_ready(), then requests whose context grows past several of the
    old attention spans (256, 512, 1024, 2048 columns): no CUDA graph is captured and nothing is compiled."""
    from backend.chat import stop_token_ids
    from backend.dflash.checkpoint import find_shipped_drafter, load_drafter

    loaded = _embedded()
    engine = Engine(loaded.model, drafter=load_drafter(find_shipped_drafter(loaded.name)), max_context=8192)
    assert engine.warm_up() >= 1 + 16 + 17
    engine.mark_ready()
    before = (engine.captures.captures_after_ready, engine.captures.compilations_after_ready)
    stops = stop_token_ids(loaded.tokenizer, loaded.model.generation_config)
    lengths = []
    for messages in _conversation(loaded.tokenizer, turns=8):
        prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        reply = [t for b in engine.generate(prompt, SamplingParams(max_tokens=64, stop_token_ids=stops)) for t in b]
        messages.append({"role": "assistant", "content": loaded.tokenizer.decode(reply, skip_special_tokens=True)})
        lengths.append(len(prompt))
    assert lengths[-1] > 2048, lengths
    after = (engine.captures.captures_after_ready, engine.captures.compilations_after_ready)
    assert after == before, f"captured/compiled after ready: {after} (before {before}), contexts {lengths}"


@cuda
def test_cuda_drafter_none_and_speculation_give_the_same_text_over_a_conversation():
    """One numerics on the GPU: an engine with the defaults and no drafter (`--drafter none`) and the speculative
    engine emit the same tokens, turn after turn, with prefix reuse across turns, on the embedded model's real
    weights in bf16."""
    from backend.chat import stop_token_ids
    from backend.dflash.checkpoint import find_shipped_drafter, load_drafter

    loaded = _embedded()
    plain = Engine(loaded.model, max_context=8192)
    engine = Engine(loaded.model, drafter=load_drafter(find_shipped_drafter(loaded.name)), max_context=8192)
    assert "token-identical to --drafter none" in engine.describe_decoding()
    assert plain.numerics.kind == engine.numerics.kind == "invariant"  # one record for both (models/numerics.py)
    assert plain.numerics.llama == engine.numerics.llama and plain.numerics.qwen == engine.numerics.qwen
    stops = stop_token_ids(loaded.tokenizer, loaded.model.generation_config)
    replies = {id(plain): [], id(engine): []}
    for e in (plain, engine):
        for messages in _conversation(loaded.tokenizer, turns=6):  # each engine's conversation holds its replies
            prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
            reply = [t for b in e.generate(prompt, SamplingParams(max_tokens=96, stop_token_ids=stops)) for t in b]
            replies[id(e)].append(reply)
            messages.append({"role": "assistant", "content": loaded.tokenizer.decode(reply, skip_special_tokens=True)})
    assert replies[id(engine)] == replies[id(plain)]
    assert engine.last_stats.cycles > 0
