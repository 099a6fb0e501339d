"""`reviewer train` on the CPU with a tiny random Llama target (a real tokenizer and chat template, tests/conftest.py):
the training forward equals the drafter's inference forward, data comes from a real reviews.db and from the built-in
set, every knob trains, the loss goes down, checkpoints load in the real engine and keep greedy output identical,
and resuming continues the step count."""

import gzip
import json

import pytest
import torch

from backend.train import run as T
from backend.train import evaluate
from backend.train import config
from backend.train import objective
from backend.train import data as td
from backend.train import prompts as tp
from backend.bench.run import tiny_model as bench_tiny_model
from backend.dflash.checkpoint import load_drafter
from backend.chat import stop_token_ids
from backend.decoding.engine import Engine, SamplingParams

# Tiny shapes: one intra-op thread is faster, and far faster on a box whose two cores are shared.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


COMMON = dict(device="cpu", builtin_prompts=False, max_new_tokens=12, max_prompt_tokens=512, gen_batch=8,
              layers=2, intermediate_size=64, block_size=6, batch_blocks=32, anchors_per_seq=8, log_every=2,
              eval_prompts=0, save_every=1000)


# ---- a real reviews.db ----------------------------------------------------------------------------------------------


def _transcript(i: int) -> list[dict]:
    if i % 4:  # text-mode tool calls (short prompts: no tool schemas in them)
        return [
            {"role": "system", "content": "You are a careful tester."},
            {"role": "user", "content": f"Review repository number {i}: install it and run the tests."},
            {"role": "assistant", "content": "I will install it first: pip install -e ."},
            {"role": "user", "content": f"Tool result: exit code {i % 2}\nSuccessfully installed pkg{i}"},
            {"role": "assistant", "content": "Now the tests: pytest -q"},
        ]
    return [
        {"role": "system", "content": "You are a careful tester. Make one tool call per reply."},
        {"role": "user", "content": f"Review repository number {i}: install it and run the tests."},
        {"role": "assistant", "content": "I will install it first.",
         "tool_calls": [{"id": f"c{i}", "type": "function",
                         "function": {"name": "bash", "arguments": json.dumps({"command": "pip install -e ."})}}]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": f"exit code {i % 2}\nSuccessfully installed pkg{i}"},
        {"role": "assistant", "content": "Now the tests.",
         "tool_calls": [{"id": f"d{i}", "type": "function",
                         "function": {"name": "bash", "arguments": json.dumps({"command": "pytest -q"})}}]},
    ]


@pytest.fixture(scope="module")
def reviews_db(tmp_path_factory):
    """A reviews.db written by reviewer/store/db.py: 24 persona runs with two assistant turns each, plus a smoke run and
    a transcript cut mid-write (both must be skipped)."""
    from reviewer.store import db

    path = tmp_path_factory.mktemp("db") / "reviews.db"
    with db.session(str(path)) as s:
        repo = db.get_or_create_repository(s, "file:///tmp/example")
        run = db.ReviewRun(repository_id=repo.id, commit_sha="abc123", status="completed")
        s.add(run)
        s.commit()
        for i in range(24):
            s.add(db.PersonaRun(run_id=run.id, persona="correctness", status="completed",
                                transcript=json.dumps(_transcript(i))))
        s.add(db.PersonaRun(run_id=run.id, persona="smoke", transcript=json.dumps(_transcript(99))))
        s.add(db.PersonaRun(run_id=run.id, persona="docs", transcript='[{"role": "system", "content": "cut'))
        s.commit()
    db._engines.clear()
    return path


def test_from_db_reads_every_assistant_turn_context(reviews_db, tiny_model):
    records = tp.load_from_db(reviews_db)
    assert len(records) == 48  # 24 runs x 2 assistant turns; the smoke run and the broken transcript are skipped
    assert all(r.category == "db:correctness" for r in records)
    by_len = sorted({len(r.messages) for r in records})
    assert by_len == [2, 4]  # the context before each assistant turn
    assert all(r.messages[-1]["role"] in ("user", "tool") for r in records)
    native = [r for r in records if r.tools]  # transcripts with native tool calls get the agent's tool schemas
    assert len(native) == 12 and all(r.tools[0]["function"]["name"] == "bash" for r in native)
    assert all(r.messages[-1]["role"] == "tool" for r in native if len(r.messages) == 4)
    splits = {}
    for r in records:  # a transcript's prompts share a prefix: they must land in one split
        splits.setdefault(r.id.split("-")[1], set()).add(r.split)
    assert all(len(s) == 1 for s in splits.values())
    assert {r.split for r in records} == {"train", "heldout"}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model("llama"))
    text = tok.decode(td.render(tok, native[1]))
    assert "Successfully installed" in text and '"name": "bash"' in text  # tool result and tool schemas rendered


def test_from_db_errors_are_clear(tmp_path):
    with pytest.raises(config.DataError, match="no database"):
        tp.load_from_db(tmp_path / "missing.db")
    bad = tmp_path / "not.db"
    bad.write_text("hello")
    with pytest.raises(config.DataError, match="not a reviews database"):
        tp.load_from_db(bad)


def test_from_transcripts_reads_replayed_sessions_and_its_errors_are_clear(tmp_path):
    """--from-transcripts (backend/bench/replay.py --transcripts lines, several files): a prompt per reply, each
    session in one split; a missing file or a line that is no transcript is one clear error. (The replay's own test
    writes such a file from real `reviewer serve` sessions and reads it back.)"""
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("\n".join(json.dumps({"session": f"s{k}", "persona": "docs", "tools": tools,
                                           "messages": _transcript(k)}) for k in range(12)) + "\n\n")
    second.write_text(json.dumps({"session": "s0", "messages": _transcript(0)}) + "\n")
    records = tp.load_transcripts(f"{first}, {second}")
    assert len(records) == 13 * 2 and {r.category for r in records} == {"replay:docs", "replay:agent"}
    assert all(r.messages[-1]["role"] in ("user", "tool") for r in records)
    assert sum(r.tools == tools for r in records) == 24 and sum(r.tools is None for r in records) == 2
    splits: dict[str, set] = {}
    for r in records:
        splits.setdefault(r.id.rsplit("-", 1)[0], set()).add(r.split)
    assert len(splits) == 13 and all(len(s) == 1 for s in splits.values())  # s0 of each file is its own session
    with pytest.raises(config.DataError, match="no file at"):
        tp.load_transcripts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"session": "s0", "messages": []}\n')
    with pytest.raises(config.DataError, match=r"bad.jsonl:1: not a replay transcript line"):
        tp.load_transcripts(str(tmp_path / "bad.jsonl"))


def test_builtin_prompt_set():
    records = tp.load_builtin()
    assert len(records) > 1500
    cats = {r.category for r in records}
    assert cats == {"code_review", "debugging", "performance", "readme", "coding", "agent"}
    held = sum(r.split == "heldout" for r in records)
    assert 0.04 < held / len(records) < 0.12
    from backend.bench.run import PROMPTS

    assert not {r.messages[-1]["content"] for r in records} & set(PROMPTS)  # bench prompts are never trained on
    agent = [r for r in records if r.category == "agent"]
    assert agent and all(r.tools and r.messages[0]["role"] == "system" for r in agent)


def test_extra_prompt_set_is_training_only_and_shares_no_code_with_the_held_out_prompts():
    import re

    main, extra = tp.load_builtin(), tp.load_builtin(tp.BUILTIN_EXTRA)
    assert len(extra) >= 5000 and {r.split for r in extra} == {"train"}
    assert {r.category for r in extra} == {"code_review", "debugging", "performance", "agent", "readme", "coding"}
    assert not {r.id for r in main} & {r.id for r in extra}
    # the agent conversations quote other READMEs than the held-out prompts, and carry the tool schemas
    held_text = "\n".join(m["content"] for r in main if r.split == "heldout" for m in r.messages)
    agent = [r for r in extra if r.category == "agent"]
    docs = [r.messages[1]["content"].split("-----\n")[1][:300] for r in agent]
    assert len(docs) > 500 and not any(d in held_text for d in docs)
    assert all(r.tools and r.messages[0]["role"] == "system" for r in agent)

    def code_blocks(records):
        return {b.strip() for r in records for b in re.findall(r"```python\n(.*?)```", r.messages[-1]["content"], re.S)}

    held, more = code_blocks([r for r in main if r.split == "heldout"]), code_blocks(extra)
    assert len(held) > 50 and len(more) > 4000 and not held & more
    from backend.bench.run import PROMPTS

    assert not {r.messages[-1]["content"] for r in extra} & set(PROMPTS)
    # --builtin-extra adds them to the training prompts only (the held-out ones stay the main set's)
    both = T.load_records(config.TrainConfig(builtin_extra=True))
    alone = T.load_records(config.TrainConfig(builtin_prompts=True))
    assert len(both) == len(alone) + len(extra)
    assert [r.id for r in both if r.split == "heldout"] == [r.id for r in alone if r.split == "heldout"]


def test_agent_tools_copy_matches_the_reviewer():
    from reviewer.persona.tools import TOOLS

    assert json.loads(tp.AGENT_TOOLS.read_text()) == TOOLS, "rerun bench/train_build_prompts.py"


# ---- the training forward -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["mixed", "bidirectional", "causal"])
@pytest.mark.parametrize("window", [0, 5])
def test_block_forward_equals_the_inference_forward(attention, window):
    target = bench_tiny_model("tiny-llama")
    cfg = config.TrainConfig(layers=3, intermediate_size=96, block_size=6, attention=attention, sliding_window=window,
                        seed=1)
    drafter = objective.new_drafter(cfg, target, [0, 2, 3], "tiny")
    drafter.check_target(target)
    feats = torch.randn(1, 24, 3 * 64)
    anchors = torch.tensor([[3, 11, 18]])
    ids = torch.full((1, 3, 6), drafter.mask_token_id)
    ids[..., 0] = torch.tensor([5, 17, 42])
    embeds = target.get_input_embeddings()(ids.view(1, -1))
    with torch.no_grad():
        batched = objective.block_forward(drafter, feats, anchors, embeds).view(1, 3, 6, -1)
        for j, a in enumerate(anchors[0].tolist()):
            ctx = drafter.new_context()
            ctx.add_pending(feats[:, :a])
            drafter._absorb_pending(ctx)
            one = drafter.block_hidden(embeds.view(1, 3, 6, -1)[:, j], torch.arange(a, a + 6), ctx.keys(),
                                       ctx.values(), torch.arange(a))
            torch.testing.assert_close(batched[:, j], one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [2, 3, 7])
def test_length_groups_give_the_one_batch_result_and_gradients(groups):
    """--length-groups: sequences of very different reach in sub-batches, each cut to its own context, give the
    padded batch's hidden states and the same gradients, in the batch's order."""
    target = bench_tiny_model("tiny-llama")
    cfg = config.TrainConfig(layers=2, intermediate_size=96, block_size=4, attention="mixed", sliding_window=5, seed=2)
    drafter = objective.new_drafter(cfg, target, [0, 2, 3], "tiny")
    S, L = 5, 40
    feats = torch.randn(S, L, 3 * 64, generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[30, 35], [3, 5], [12, 9], [36, 2], [7, 8]])  # reach 35, 5, 12, 36, 8: unsorted
    ids = torch.full((S, 2, 4), drafter.mask_token_id)
    ids[..., 0] = torch.arange(S * 2).view(S, 2) + 3
    embeds = target.get_input_embeddings()(ids.view(S, -1)).detach()

    def run(g):
        drafter.zero_grad()
        out = objective.grouped_block_forward(drafter, feats, anchors, embeds, g)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}

    whole, whole_grads = run(1)
    torch.testing.assert_close(whole, objective.block_forward(drafter, feats, anchors, embeds).detach())
    split, split_grads = run(groups)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    assert whole_grads.keys() == split_grads.keys() and whole_grads
    for name in whole_grads:
        torch.testing.assert_close(split_grads[name], whole_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_position_weights():
    w = objective.position_weights(5, 2.0, "cpu")
    assert w[0] == 0 and w[1] == 1.0
    torch.testing.assert_close(w[2:], torch.exp(-torch.arange(1, 4) / 2.0))


# ---- whole runs ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tiny_model, reviews_db, tmp_path_factory):
    """The target's responses and features for the reviews.db prompts, made once for the module."""
    path = tmp_path_factory.mktemp("data")
    summary = T.main(model=str(tiny_model("llama")), out=str(path / "prep"), data_dir=str(path), from_db=str(reviews_db),
                     data_only=True, **COMMON)
    assert summary["splits"]["train"]["sequences"] > 0 and summary["splits"]["heldout"]["sequences"] > 0
    return path


def run(tiny_model, reviews_db, data_dir, out, **knobs):
    return T.main(model=str(tiny_model("llama")), out=str(out), data_dir=str(data_dir), from_db=str(reviews_db),
                  **{**COMMON, **knobs})


def test_features_are_the_targets_and_responses_its_greedy_output(tiny_model, data_dir):
    from backend.loading import load_model

    loaded = load_model(str(tiny_model("llama")), device="cpu", dtype="float32")
    data = td.load_features(data_dir, "train", "cpu")
    s = 0
    start, end, p = int(data.offsets[s]), int(data.offsets[s + 1]), int(data.prompt_lens[s])
    ids = data.tokens[start:end]
    with torch.no_grad():
        out = loaded.model(input_ids=ids[None], output_hidden_states=True)
    want = td.select_features(out.hidden_states, [0, 1])[0]
    torch.testing.assert_close(data.features[start:end].float(), want, rtol=2e-2, atol=2e-2)  # stored in bf16
    assert torch.equal(data.argmax[start:end], out.logits[0].argmax(-1))
    stops = stop_token_ids(loaded.tokenizer, loaded.model.generation_config)
    greedy = [t for b in Engine(loaded.model).generate(ids[:p].tolist(), SamplingParams(max_tokens=12, stop_token_ids=stops))
              for t in b]
    response = ids[p:].tolist()
    assert response[: len(greedy)] == greedy  # the stored response is the target's own (plus its stop token)


def test_static_cache_generates_what_the_dynamic_cache_does(tiny_model):
    """The static cache (in-place KV writes; bench/train_gen_speed.py times it) changes no response: greedy and
    seeded sampled ones, with left padding across prompts of different lengths and stop tokens cutting them."""
    from backend.loading import load_model

    loaded = load_model(str(tiny_model("llama")), device="cpu", dtype="float32")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 200, (int(n),), generator=g).tolist() for n in (7, 19, 3, 12, 25)]
    stops = stop_token_ids(loaded.tokenizer, loaded.model.generation_config)
    for temperature in (0.0, 0.9):
        runs = {cache: td.generate_responses(loaded.model, prompts, max_new_tokens=10, stops=stops, batch_size=3,
                                             temperature=temperature, seed=5, cache=cache, log=lambda *_: None)
                for cache in td.GEN_CACHES}
        assert runs["static"] == runs["dynamic"]
        assert all(len(r) > 0 for r in runs["static"])
    with pytest.raises(config.DataError, match="unknown generation cache"):
        td.generate_responses(loaded.model, prompts, max_new_tokens=2, stops=stops, batch_size=2, cache="paged")


def test_features_load_shard_by_shard_into_one_set(tiny_model, tmp_path):
    """Several shards load into the same tensors a plain concatenation gives (the big ones are filled in place on the
    device, a shard at a time), and an empty split is a clear error."""
    from safetensors.torch import load_file

    from backend.loading import load_model

    loaded = load_model(str(tiny_model("llama")), device="cpu", dtype="float32")
    seqs = [[(7 * i + j) % 60 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    shards = td.extract_features(loaded.model, seqs, [3] * len(seqs), [0, 1], tmp_path / "train", shard_tokens=12,
                                 log=lambda *_: None)
    assert len(shards) >= 3
    td.write_manifest(tmp_path, {"splits": {"train": {"shards": shards}, "heldout": {"shards": []}}})
    data = td.load_features(tmp_path, "train", "cpu")
    parts = [load_file(str(tmp_path / "train" / s["file"])) for s in shards]
    for key, got in (("features", data.features), ("final", data.final), ("tokens", data.tokens),
                     ("argmax", data.argmax), ("prompt_lens", data.prompt_lens)):
        want = torch.cat([p[key] for p in parts])
        assert got.dtype == (torch.long if key in ("tokens", "argmax") else want.dtype)
        assert torch.equal(got, want.to(got.dtype)), key
    assert data.index == torch.cat([p["index"] for p in parts]).tolist()
    assert sorted(data.index) == list(range(len(seqs)))
    with pytest.raises(config.DataError, match="empty"):
        td.load_features(tmp_path, "heldout", "cpu")


def test_sampled_responses_add_training_sequences(tiny_model, reviews_db, data_dir, tmp_path):
    """--samples-per-prompt 2: every training prompt appears three times (greedy + 2 sampled, some different from
    the greedy one), the held-out split is untouched, and the data key changes (no stale reuse)."""
    greedy = td.read_manifest(data_dir)
    out = tmp_path / "sampled"
    summary = T.main(model=str(tiny_model("llama")), out=str(out / "prep"), data_dir=str(out), from_db=str(reviews_db),
                     data_only=True, samples_per_prompt=2, sample_temperature=1.0, **COMMON)
    manifest = td.read_manifest(out)
    assert manifest["key"] != greedy["key"]
    ids = greedy["splits"]["train"]["records"]
    assert manifest["splits"]["train"]["records"] == ids + [f"{i}~1" for i in ids] + [f"{i}~2" for i in ids]
    assert summary["splits"]["heldout"]["sequences"] == len(greedy["splits"]["heldout"]["records"])
    data = td.load_features(out, "train", "cpu")
    n = len(ids)
    where = {seq: s for s, seq in enumerate(data.index)}  # shards are sorted by length; index maps back

    def split(i):  # (prompt, response) of the i-th sequence in manifest order
        s = where[i]
        start, cut, end = int(data.offsets[s]), int(data.offsets[s]) + int(data.prompt_lens[s]), int(data.offsets[s + 1])
        return data.tokens[start:cut].tolist(), data.tokens[cut:end].tolist()

    for i in range(n):
        assert split(i)[0] == split(n + i)[0] == split(2 * n + i)[0]  # the same prompt three times
    assert any(split(i)[1] != split(n + i)[1] for i in range(n))  # and sampling really sampled
    # each prompt's features are stored once: the other two sequences keep only their response rows ...
    assert data.features.shape[0] == int(data.lengths.sum()) - 2 * sum(len(split(i)[0]) for i in range(n))
    assert sorted(data.skip.tolist()).count(0) == n
    # ... and a batch still holds the target's own features and argmax at every position of every sequence
    from backend.loading import load_model
    loaded = load_model(str(tiny_model("llama")), device="cpu", dtype="float32")
    seqs = torch.tensor([where[i] for i in (0, n, 2 * n, n - 1, 2 * n - 1, 3 * n - 1)])
    batch = data.gather(seqs, need_final=True)
    for row, s in enumerate(seqs.tolist()):
        length = int(data.lengths[s])
        ids = data.tokens[int(data.offsets[s]): int(data.offsets[s]) + length]
        with torch.no_grad():
            ref = loaded.model(input_ids=ids[None], output_hidden_states=True)
        want = td.select_features(ref.hidden_states, [0, 1])[0]
        torch.testing.assert_close(batch["features"][row, :length].float(), want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(batch["final"][row, :length].float(), ref.hidden_states[-1][0], rtol=2e-2,
                                   atol=2e-2)
        assert torch.equal(batch["argmax"][row, :length], ref.logits[0].argmax(-1))
    trained = run(tiny_model, reviews_db, out, tmp_path / "on-shared-prompts", samples_per_prompt=2,
                  sample_temperature=1.0, steps=4)  # training and its estimate read the shared rows too
    assert trained["budget"]["steps"] == 4 and 1.0 <= trained["estimate"]["tau_est"] <= COMMON["block_size"]
    with pytest.raises(config.TrainError, match="samples-per-prompt"):
        T.main(model=str(tiny_model("llama")), out=str(tmp_path / "bad"), from_db=str(reviews_db), data_only=True,
               samples_per_prompt=-1, **COMMON)


def test_on_path_labels_drop_the_slots_after_a_hidden_departure(tiny_model, reviews_db, tmp_path):
    """--labels on-path: in blocks over sampled responses, a masked slot is a target only while no masked slot
    before it holds a token other than the target's argmax (checked here slot by slot against the stored tokens and
    argmax); a visible slot (uniform corruption) never cuts, and --labels all keeps every masked slot."""
    out = tmp_path / "sampled"
    T.main(model=str(tiny_model("llama")), out=str(out / "prep"), data_dir=str(out), from_db=str(reviews_db),
           data_only=True, samples_per_prompt=1, sample_temperature=1.5, **COMMON)
    data = td.load_features(out, "train", "cpu")
    B = COMMON["block_size"]
    seqs = torch.arange(len(data))
    counts = data.anchor_counts()
    anchors = data.prompt_lens[:, None] + (torch.rand(len(data), 8, generator=torch.Generator().manual_seed(0))
                                           * counts[:, None]).long()
    cut_somewhere = False
    for corruption in ("full", "uniform"):
        kw = dict(need_final=False)
        mask = -7  # no token's id: a slot holds it exactly when it is masked
        every = objective.make_blocks(data, seqs, anchors, B, mask, corruption, gen=torch.Generator().manual_seed(1), **kw)
        on = objective.make_blocks(data, seqs, anchors, B, mask, corruption, gen=torch.Generator().manual_seed(1),
                           on_path_only=True, **kw)
        assert torch.equal(every["ids"], on["ids"]) and torch.equal(every["labels"], on["labels"])
        masked = on["ids"] == mask
        batch = data.gather(seqs, need_final=False)
        for s in range(len(data)):
            n = int(data.lengths[s])
            for j in range(anchors.shape[1]):
                departed = False
                for k in range(1, B):
                    p = int(anchors[s, j]) + k
                    inside = p < n
                    want_all = bool(masked[s, j, k]) and inside
                    assert bool(every["valid"][s, j, k]) == want_all
                    assert bool(on["valid"][s, j, k]) == (want_all and not departed)
                    cut_somewhere |= want_all and departed
                    if inside and masked[s, j, k] and batch["tokens"][s, p] != batch["argmax"][s, p - 1]:
                        departed = True  # a hidden token the target would not have chosen
    assert cut_somewhere  # sampling at 1.5 leaves the greedy path: the filter had work to do


def test_init_from_starts_at_a_saved_drafter(tiny_model, reviews_db, data_dir, tmp_path):
    """--init-from copies a checkpoint's weights (a vocabulary-restricted one too): with a learning rate too small to
    move a bf16 weight, the new run saves the same tensors. A drafter of another shape is a one-line error."""
    from safetensors.torch import load_file

    first = run(tiny_model, reviews_db, data_dir, tmp_path / "first", steps=4, vocab_top_k=64)
    assert first["budget"]["steps"] == 4
    second = run(tiny_model, reviews_db, data_dir, tmp_path / "second", steps=2, lr=1e-12,
                 init_from=str(tmp_path / "first"))
    a = load_file(str(tmp_path / "first" / "model.safetensors"))
    b = load_file(str(tmp_path / "second" / "model.safetensors"))
    assert "d2t" in a and "d2t" not in b  # the run's own vocabulary (full) wins
    assert set(a) - {"d2t", "t2d"} == set(b)
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert second["config"]["init_from"] == str(tmp_path / "first")
    fresh = run(tiny_model, reviews_db, data_dir, tmp_path / "fresh", steps=2, lr=1e-12)
    c = load_file(str(tmp_path / "fresh" / "model.safetensors"))
    assert not torch.equal(c["fc.weight"], b["fc.weight"])  # a fresh start would not have given those weights
    with pytest.raises(config.TrainError, match="--init-from .*num_hidden_layers 2 .this run: 1."):
        run(tiny_model, reviews_db, data_dir, tmp_path / "bad", steps=2, layers=1, init_from=str(tmp_path / "first"))
    with pytest.raises(config.TrainError, match="--init-from: no config.json"):
        run(tiny_model, reviews_db, data_dir, tmp_path / "bad2", steps=2, init_from=str(tmp_path / "nowhere"))


def test_init_from_keeps_the_saved_drafters_window_unless_told_otherwise(tiny_model, reviews_db, data_dir, tmp_path):
    """--sliding-window's default takes the window of the drafter --init-from names (the shipped one drafts with one:
    a fine-tune of it must not lose it silently); an explicit 0 trains without one; a fresh drafter has none."""
    from backend.dflash.checkpoint import load_drafter

    run(tiny_model, reviews_db, data_dir, tmp_path / "windowed", steps=2, sliding_window=5)
    assert load_drafter(tmp_path / "windowed").cfg.sliding_window == 5
    kept = run(tiny_model, reviews_db, data_dir, tmp_path / "kept", steps=2, init_from=str(tmp_path / "windowed"))
    assert kept["config"]["sliding_window"] == 5 and load_drafter(tmp_path / "kept").cfg.sliding_window == 5
    run(tiny_model, reviews_db, data_dir, tmp_path / "off", steps=2, init_from=str(tmp_path / "windowed"),
        sliding_window=0)
    assert load_drafter(tmp_path / "off").cfg.sliding_window is None
    fresh = run(tiny_model, reviews_db, data_dir, tmp_path / "fresh", steps=2)
    assert fresh["config"]["sliding_window"] == 0 and load_drafter(tmp_path / "fresh").cfg.sliding_window is None
    with pytest.raises(config.TrainError, match="--sliding-window must be"):
        run(tiny_model, reviews_db, data_dir, tmp_path / "bad", steps=2, sliding_window=-2)


def test_init_from_a_shallower_drafter_starts_as_the_same_function(tiny_model, reviews_db, data_dir, tmp_path):
    """--layers above the checkpoint's: the saved layers keep their types (the last, full attention, stays last), the
    new ones in between add nothing until trained, so the deeper drafter drafts what the saved one drafts."""
    import torch.nn.functional as F
    from backend.loading import load_model

    run(tiny_model, reviews_db, data_dir, tmp_path / "first", steps=30, lr=3e-3)  # 2 layers
    run(tiny_model, reviews_db, data_dir, tmp_path / "deep", steps=1, lr=1e-12, layers=4,
        init_from=str(tmp_path / "first"))
    first, deep = (load_drafter(tmp_path / name).float() for name in ("first", "deep"))
    assert deep.cfg.num_hidden_layers == 4 and deep.cfg.layer_types[-1] == first.cfg.layer_types[-1]
    assert torch.equal(deep.layers[3].mlp.up_proj.weight, first.layers[1].mlp.up_proj.weight)
    assert torch.equal(deep.layers[0].self_attn.q_proj.weight, first.layers[0].self_attn.q_proj.weight)
    assert float(deep.layers[1].self_attn.o_proj.weight.detach().abs().max()) < 1e-9  # new: silent at the start
    assert float(deep.layers[2].self_attn.q_proj.weight.detach().abs().max()) > 0  # but not empty
    loaded = load_model(str(tiny_model("llama")), device="cpu", dtype="float32")
    frozen = objective.frozen_parts(loaded.model, None, torch.float32)
    data = td.load_features(data_dir, "train", "cpu")
    seqs = torch.arange(4)
    anchors = data.prompt_lens[seqs][:, None] + torch.tensor([[0, 2, 5]])
    blocks = objective.make_blocks(data, seqs, anchors, first.block_size, first.mask_token_id, "full", False, None)
    embeds = F.embedding(blocks["ids"].view(4, -1), frozen.embed)
    with torch.no_grad():
        want = objective.block_forward(first, blocks["features"], blocks["anchors"], embeds)
        got = objective.block_forward(deep, blocks["features"], blocks["anchors"], embeds)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    trained = run(tiny_model, reviews_db, data_dir, tmp_path / "deep2", steps=5, lr=3e-3, layers=4,
                  init_from=str(tmp_path / "first"))  # and it trains: the new layers start to count
    assert float(load_drafter(tmp_path / "deep2").layers[1].self_attn.o_proj.weight.detach().abs().max()) > 1e-4
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trained["history"])


def test_responses_file_may_be_gzipped_and_must_match_the_target(tmp_path):
    rows = [{"id": "a", "tokens": [1, 2, 3]}, {"id": "b~1", "tokens": [4]}]
    text = "\n".join(json.dumps(r) for r in [{"target": "tiny"}] + rows) + "\n"
    packed = tmp_path / "responses.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write(text)
    assert td.load_responses([packed], "tiny") == {"a": [1, 2, 3], "b~1": [4]}
    with pytest.raises(config.DataError, match="not of the target"):
        td.load_responses([packed], "another")


def test_responses_are_written_and_reused_instead_of_generated(tiny_model, reviews_db, data_dir, tmp_path, capsys):
    """Every data run leaves responses.jsonl; --responses-only stops there; a later run given the file takes its
    responses (a planted one shows up in the features) and generates only what the file lacks."""
    model = str(tiny_model("llama"))
    first = tmp_path / "first"
    summary = T.main(model=model, out=str(first / "prep"), data_dir=str(first), from_db=str(reviews_db),
                     responses_only=True, samples_per_prompt=1, sample_temperature=1.0, **COMMON)
    assert summary["responses"] > 0 and td.read_manifest(first) is None  # no features, no manifest
    lines = (first / td.RESPONSES).read_text().splitlines()
    header, rows = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    greedy = td.read_manifest(data_dir)["splits"]
    assert {r["id"] for r in rows} == set(greedy["train"]["records"]) | {f"{i}~1" for i in greedy["train"]["records"]} \
        | set(greedy["heldout"]["records"])
    target = header["target"]
    # plant a response nobody would generate, drop another (it must be generated again), and reuse the file
    planted_id, dropped_id = rows[0]["id"], rows[1]["id"]
    planted = [7, 8, 9, 10, 11]
    rows[0]["tokens"] = planted
    kept = [r for r in rows if r["id"] != dropped_id]
    (tmp_path / "mine.jsonl").write_text("\n".join([json.dumps(header)] + [json.dumps(r) for r in kept]) + "\n")
    second = tmp_path / "second"
    T.main(model=model, out=str(second / "prep"), data_dir=str(second), from_db=str(reviews_db), data_only=True,
           responses=str(tmp_path / "mine.jsonl"), samples_per_prompt=1, sample_temperature=1.0, **COMMON)
    n_train = len(greedy["train"]["records"])
    assert f"data[train]: {n_train - 1} greedy responses taken from earlier runs" in capsys.readouterr().out
    manifest = td.read_manifest(second)
    data = td.load_features(second, "train", "cpu")
    order = manifest["splits"]["train"]["records"]
    seq = {order[i]: s for s, i in enumerate(data.index)}  # shards are sorted by length; index maps back

    def response(rid):
        s = seq[rid]
        return data.tokens[int(data.offsets[s]) + int(data.prompt_lens[s]):int(data.offsets[s + 1])].tolist()

    assert response(planted_id) == planted
    regenerated = {json.loads(line)["id"]: json.loads(line)["tokens"]
                   for line in (second / td.RESPONSES).read_text().splitlines()[1:]}
    assert regenerated[planted_id] == planted and dropped_id in regenerated and len(regenerated) == len(rows)
    # another target's responses are refused with a clear error
    (tmp_path / "other.jsonl").write_text(json.dumps({"target": "some-other-model"}) + "\n")
    code = T.cli(["--model", model, "--out", str(tmp_path / "o"), "--device", "cpu", "--no-builtin-prompts",
                  "--from-db", str(reviews_db), "--data-only", "--responses", str(tmp_path / "other.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and "some-other-model" in err and target in err and "Traceback" not in err


@pytest.mark.parametrize("loss,attention,corruption,top_k", [
    ("kl", "mixed", "full", 0), ("ce", "causal", "full", 0), ("ce", "bidirectional", "full", 0),
    ("kl", "mixed", "uniform", 0), ("ce", "mixed", "uniform", 64), ("kl", "causal", "full", 64),
])
def test_every_knob_trains_and_saves_a_loadable_checkpoint(tiny_model, reviews_db, data_dir, tmp_path, loss,
                                                          attention, corruption, top_k):
    m = run(tiny_model, reviews_db, data_dir, tmp_path / "run", loss=loss, attention=attention, corruption=corruption,
            vocab_top_k=top_k, steps=4, decay=3.0)
    assert m["budget"]["steps"] == 4 and all(torch.isfinite(torch.tensor(h["loss"])) for h in m["history"])
    assert len(m["history"][-1]["acc"]) == 5  # per draft position
    assert 1.0 <= m["estimate"]["tau_est"] <= 6.0
    drafter = load_drafter(tmp_path / "run")
    assert drafter.cfg.block_attention == attention and drafter.block_size == 6
    assert drafter.target_layer_ids == [0, 1]
    if top_k:
        assert drafter.draft_vocab is not None and drafter.draft_vocab.shape[0] == 64
    else:
        assert drafter.draft_vocab is None


def test_loss_goes_down_and_the_checkpoint_is_lossless_in_the_engine(tiny_model, reviews_db, data_dir, tmp_path):
    m = run(tiny_model, reviews_db, data_dir, tmp_path / "run", loss="kl", steps=40, lr=3e-3, log_every=5,
            eval_prompts=3, eval_max_tokens=16, eval_check_plain=True)
    losses = [h["loss"] for h in m["history"]]
    assert losses[-1] < 0.8 * losses[0], losses
    e = m["engine"]
    assert e["cycles"] > 0 and e["tau"] >= 1.0 and len(e["acceptance"]) == 5
    assert e["identical_to_plain"] is True
    per_prompt = e["per_prompt"]  # [tokens, cycles, accepted] each: they add up to the totals
    assert len(per_prompt) == e["prompts"] and [sum(col) for col in zip(*per_prompt)][:2] == [e["tokens"], e["cycles"]]
    assert abs((sum(p[2] for p in per_prompt) + e["cycles"]) / e["cycles"] - e["tau"]) < 1e-9
    # and the checkpoint as any user would load it, through the engine directly
    from backend.loading import load_model

    loaded = load_model(str(tiny_model("llama")), device="cpu", dtype="float32")
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Review this code for bugs."}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    params = SamplingParams(max_tokens=20)
    plain = [t for b in Engine(loaded.model).generate(prompt, params) for t in b]
    engine = Engine(loaded.model, drafter=load_drafter(tmp_path / "run"))
    spec = [t for b in engine.generate(prompt, params) for t in b]
    assert spec == plain and engine.last_stats.cycles > 0


def _near_tie_sequences(drafter, frozen, data, eps: float = 1e-3) -> set[int]:
    """Sequences whose walk passes a decisive drafted slot (an accepted one, or the miss that ends a block) whose
    top two logits are within eps. The stored features are bf16 and the engine drafts from the target's fp32 ones,
    so such a slot can go either way (one did, at a margin of 2e-4, once the tiny model's random weights changed
    with a transformers release)."""
    import torch.nn.functional as F

    B, out = drafter.block_size, set()
    for s in range(len(data)):
        p, n = int(data.prompt_lens[s]), int(data.lengths[s] - data.prompt_lens[s])
        if n <= 1:
            continue
        starts = torch.arange(p, p + n - 1)
        blocks = objective.make_blocks(data, torch.tensor([s]), starts[None], B, drafter.mask_token_id, "full", False, None)
        with torch.no_grad():
            hidden = objective.block_forward(drafter, blocks["features"], blocks["anchors"],
                                     F.embedding(blocks["ids"].view(1, -1), frozen.embed))
            top = F.linear(hidden, frozen.head).view(n - 1, B, -1).topk(2, dim=-1).values
        margin = top[..., 0] - top[..., 1]
        runs = evaluate._runs_of(drafter, frozen, data, s, starts, B, drafter.mask_token_id, False).tolist()
        if any(float(margin[j, 1:min(k + 2, B)].min()) < eps for j, k in evaluate._walk(runs, n)):
            out.add(s)
    return out


def test_walk_replays_the_engine_prompt_by_prompt(tiny_model, reviews_db, data_dir, tmp_path):
    """walk_acceptance on greedy responses gives what the real engine measures when it decodes their prompts:
    prompt by prompt the same tokens, cycles and accepted drafts, wherever no drafted slot on the way is a near-tie
    (fp32 on both sides but for the bf16 stored features). tau_est's evenly spread anchors are not what decoding
    visits; this is. (The training split: a tiny drafter trained briefly accepts next to nothing on held-out
    prompts, which would make the check hollow.)"""
    from backend.loading import load_model

    run(tiny_model, reviews_db, data_dir, tmp_path / "run", loss="kl", steps=300, lr=3e-3, log_every=100)
    loaded = load_model(str(tiny_model("llama")), device="cpu", dtype="float32")
    drafter = load_drafter(tmp_path / "run").float()
    data = td.load_features(data_dir, "train", "cpu")
    frozen = objective.frozen_parts(loaded.model, drafter.draft_vocab, torch.float32)
    walk = evaluate.walk_acceptance(drafter, frozen, data, drafter.block_size, drafter.mask_token_id)
    engine = Engine(loaded.model, drafter=drafter)
    params = SamplingParams(max_tokens=COMMON["max_new_tokens"], stop_token_ids=tuple(td.read_manifest(data_dir)["stop_ids"]))
    per_prompt = []
    for s in range(len(data)):
        start, p, end = int(data.offsets[s]), int(data.prompt_lens[s]), int(data.offsets[s + 1])
        out = [t for b in engine.generate(data.tokens[start:start + p].tolist(), params) for t in b]
        assert out == data.tokens[start + p:end].tolist()  # the stored response is the engine's greedy output
        per_prompt.append([engine.last_stats.generated_tokens, engine.last_stats.cycles,
                           engine.last_stats.accepted_tokens])
    ties = _near_tie_sequences(drafter, frozen, data)
    clean = [s for s in range(len(data)) if s not in ties]
    assert len(clean) >= 0.75 * len(data) and len(clean) >= 2
    assert [walk["per_sequence"][s] for s in clean] == [per_prompt[s] for s in clean]
    assert sum(per_prompt[s][2] for s in clean) > 0  # trained enough to accept drafts: the walk is not all misses
    assert [w[0] for w in walk["per_sequence"]] == [e[0] for e in per_prompt]  # tokens: no tie can change them
    assert walk["tau_walk"] == (sum(a for *_, a in walk["per_sequence"]) + walk["cycles"]) / walk["cycles"]
    # max_tokens cuts the walk where the engine's max_tokens stops decoding, and `which` picks the sequences
    which = clean[:2][::-1]
    cut = evaluate.walk_acceptance(drafter, frozen, data, drafter.block_size, drafter.mask_token_id, max_tokens=5,
                            which=which)
    short = SamplingParams(max_tokens=5, stop_token_ids=params.stop_token_ids)
    for s, got in zip(which, cut["per_sequence"]):
        start, p = int(data.offsets[s]), int(data.prompt_lens[s])
        list(engine.generate(data.tokens[start:start + p].tolist(), short))
        assert got == [engine.last_stats.generated_tokens, engine.last_stats.cycles, engine.last_stats.accepted_tokens]
    # --walk-anchors' table: the anchors of those cycles, scored for many sequences at once (small batches here, so
    # sequences of different lengths share one and are padded) as for one sequence at a time
    table = evaluate.walk_anchor_table(drafter, frozen, data, drafter.block_size, drafter.mask_token_id,
                                which=list(range(len(data))), blocks_per_call=24)
    for s in clean:
        n, cycles = per_prompt[s][:2]
        p = int(data.prompt_lens[s])
        runs = evaluate._runs_of(drafter, frozen, data, s, torch.arange(p, p + n - 1), drafter.block_size,
                          drafter.mask_token_id, False).tolist()
        got = table.flat[table.offsets[s]:table.offsets[s] + table.counts[s]].tolist()
        assert got == [p + j for j, _ in evaluate._walk(runs, n)] and len(got) == cycles  # the engine's cycles
    assert int(table.counts.sum()) < sum(n - 1 for n, *_ in per_prompt)  # drafts accepted: not every position


def test_walk_anchors_replace_uniform_ones_at_the_asked_share(data_dir):
    data = td.load_features(data_dir, "train", "cpu")
    counts = data.anchor_counts()

    def draw(walk, fraction):
        return objective.sample_batch(data, counts, 64, 8, torch.Generator().manual_seed(1), walk, fraction)

    plain_seqs, plain = draw(None, 0.0)
    t = int(torch.mode(plain_seqs).values)  # give the most drawn sequence two walked anchors, the others none
    walked = [int(data.prompt_lens[t]) + 1, int(data.prompt_lens[t]) + 3]
    n_walk = torch.zeros(len(data), dtype=torch.long)
    n_walk[t] = 2
    table = objective.WalkAnchors(flat=torch.tensor(walked), offsets=torch.zeros(len(data), dtype=torch.long), counts=n_walk)
    seqs, anchors = draw(table, 1.0)
    assert torch.equal(seqs, plain_seqs) and (seqs != t).any()
    assert set(anchors[seqs == t].flatten().tolist()) <= set(walked)  # every anchor of sequence t is a walked one
    assert torch.equal(anchors[seqs != t], plain[seqs != t])  # the others have none: uniform, as before
    assert torch.equal(draw(table, 0.0)[1], plain)  # share 0: the uniform sampler, draw for draw
    half = draw(table, 0.5)[1][seqs == t].flatten()
    assert (half != plain[seqs == t].flatten()).any() and set(half.tolist()) > set(walked)  # some walked, some uniform


def test_walk_anchors_train_from_a_saved_drafter(tiny_model, reviews_db, data_dir, tmp_path, capsys):
    run(tiny_model, reviews_db, data_dir, tmp_path / "first", steps=30, lr=3e-3)
    m = run(tiny_model, reviews_db, data_dir, tmp_path / "walk", steps=4, init_from=str(tmp_path / "first"),
            walk_anchors=0.5)
    assert m["budget"]["steps"] == 4 and all(torch.isfinite(torch.tensor(h["loss"])) for h in m["history"])
    assert "walk anchors:" in capsys.readouterr().out
    with pytest.raises(config.TrainError, match="--walk-anchors"):
        run(tiny_model, reviews_db, data_dir, tmp_path / "walk", steps=8, resume=True)  # the share must not change


def test_resume_continues_the_step_count(tiny_model, reviews_db, data_dir, tmp_path):
    out = tmp_path / "run"
    first = run(tiny_model, reviews_db, data_dir, out, steps=4)
    with pytest.raises(config.TrainError, match="--resume"):
        run(tiny_model, reviews_db, data_dir, out, steps=8)
    with pytest.raises(config.TrainError, match="--loss"):
        run(tiny_model, reviews_db, data_dir, out, steps=8, resume=True, loss="ce")
    second = run(tiny_model, reviews_db, data_dir, out, steps=8, resume=True)
    assert second["budget"]["steps"] == 8
    assert [h["step"] for h in second["history"]] == [2, 4, 6, 8]
    assert second["history"][:2] == first["history"]
    state = torch.load(out / config.STATE_FILE, weights_only=False)
    assert state["step"] == 8
    del state["config"]["labels"]  # a run saved before --labels existed trained on all labels
    torch.save(state, out / config.STATE_FILE)
    with pytest.raises(config.TrainError, match="--labels"):
        run(tiny_model, reviews_db, data_dir, out, steps=10, resume=True)
    assert run(tiny_model, reviews_db, data_dir, out, steps=10, resume=True, labels="all")["budget"]["steps"] == 10


def test_builtin_prompts_run_end_to_end_through_the_cli(tiny_model, tmp_path, capsys):
    code = T.cli(["--model", str(tiny_model("llama")), "--out", str(tmp_path / "run"), "--device", "cpu",
                  "--max-prompts", "3", "--max-heldout", "1", "--max-prompt-tokens", "4096", "--max-new-tokens", "6",
                  "--layers", "1", "--intermediate-size", "32", "--block-size", "4", "--steps", "2",
                  "--batch-blocks", "8", "--anchors-per-seq", "4", "--eval-prompts", "1", "--eval-max-tokens", "6",
                  "--log-every", "1"])
    assert code == 0
    metrics = json.loads((tmp_path / "run" / config.METRICS_FILE).read_text())
    assert metrics["budget"]["steps"] == 2 and metrics["data"]["train_sequences"] == 3
    assert metrics["engine"]["prompts"] == 1


def test_extra_prompts_alone_train_through_the_cli(tiny_model, tmp_path):
    """--no-builtin-prompts --builtin-extra: training prompts from the extra set only; no held-out prompts, so no
    estimate and no engine evaluation, and the run still completes."""
    code = T.cli(["--model", str(tiny_model("llama")), "--out", str(tmp_path / "run"), "--device", "cpu",
                  "--no-builtin-prompts", "--builtin-extra", "--max-prompts", "3", "--max-new-tokens", "6",
                  "--layers", "1", "--intermediate-size", "32", "--block-size", "4", "--steps", "2",
                  "--batch-blocks", "8", "--anchors-per-seq", "4", "--log-every", "1"])
    assert code == 0
    metrics = json.loads((tmp_path / "run" / config.METRICS_FILE).read_text())
    assert metrics["budget"]["steps"] == 2 and metrics["data"]["train_sequences"] == 3
    assert "estimate" not in metrics and metrics["config"]["labels"] == "on-path"
    records = td.read_manifest(tmp_path / "run" / "data")["splits"]["train"]["records"]
    assert len(records) == 3 and all("-x" in r for r in records)


@pytest.mark.parametrize("argv,message", [
    (["--loss", "mse"], "--loss must be one of kl, ce"),
    (["--attention", "sideways"], "--attention must be one of"),
    (["--block-size", "1"], "--block-size must be at least 2"),
    (["--labels", "some"], "--labels must be one of on-path, all"),
    (["--walk-anchors", "1.5"], "--walk-anchors must be between 0 and 1"),
    (["--no-builtin-prompts"], "no prompts"),
    (["--model", "/nonexistent/model"], "model not found"),
])
def test_bad_options_give_one_clear_line(argv, message, capsys, tmp_path):
    assert T.cli(argv + ["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
