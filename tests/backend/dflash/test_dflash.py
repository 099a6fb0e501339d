"""The DFlash drafter: z-lab checkpoints (both config schemas) load and save, block attention modes, the incremental
context cache, restricted draft vocabularies, and finding the drafter shipped for a model."""

import json

import pytest
import torch
from safetensors.torch import save_file

from backend.bench.run import tiny_model
from backend.dflash.checkpoint import build_draft_vocab, find_shipped_drafter, load_drafter, random_drafter, save_drafter
from backend.dflash.model import DFlashDrafter, DrafterConfig, block_mask
from backend.decoding.engine import Engine, SamplingParams


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_model("tiny-llama")


def _zlab_config(**over):
    """A config.json like z-lab's released drafters (newer schema), scaled down to the tiny target."""
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "vocab_size": 128, "num_target_layers": 4,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "sliding_window": 6,
        "use_sliding_window": True, "tie_word_embeddings": False, "dtype": "float32",
        "dflash_config": {"block_size": 4, "mask_token_id": 127, "target_layer_ids": [0, 2]},
    }
    raw.update(over)
    return raw


def _zlab_tensors(raw, seed=0):
    """Weights under the z-lab key names, written without our own saver."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, d = raw["hidden_size"], raw["intermediate_size"], raw["head_dim"]
    qh, kvh = raw["num_attention_heads"], raw["num_key_value_heads"]
    n_feat = len(raw["dflash_config"]["target_layer_ids"])

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    tensors = {"fc.weight": w(h, n_feat * h), "hidden_norm.weight": 1 + w(h), "norm.weight": 1 + w(h)}
    for i in range(raw["num_hidden_layers"]):
        p = f"layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(qh * d, h), p + "self_attn.k_proj.weight": w(kvh * d, h),
            p + "self_attn.v_proj.weight": w(kvh * d, h), p + "self_attn.o_proj.weight": w(h, qh * d),
            p + "self_attn.q_norm.weight": 1 + w(d), p + "self_attn.k_norm.weight": 1 + w(d),
            p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": 1 + w(h), p + "post_attention_layernorm.weight": 1 + w(h),
        })
    return tensors


def _write_zlab(path, raw):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    tensors = _zlab_tensors(raw)
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def _draft_once(drafter, target, prompt, token=5):
    """Bind to the target, feed the prompt's features as context, and draft one block greedily."""
    drafter.check_target(target)
    with torch.no_grad():
        hidden = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    ctx = drafter.new_context()
    ctx.add_pending(drafter.select_features(hidden))
    return drafter.draft(ctx, token, 0.0, 1.0, torch.Generator())


@pytest.mark.parametrize("schema", ["new", "old"])
def test_loads_zlab_checkpoints_in_both_schemas(tmp_path, target, schema):
    raw = _zlab_config()
    if schema == "old":  # older files: block_size at top level, not in dflash_config
        raw["block_size"] = raw["dflash_config"].pop("block_size")
    tensors = _write_zlab(tmp_path / "ckpt", raw)
    drafter = load_drafter(tmp_path / "ckpt")
    assert drafter.block_size == 4 and drafter.mask_token_id == 127 and drafter.target_layer_ids == [0, 2]
    assert drafter.cfg.sliding_window == 6 and drafter.cfg.block_attention == "mixed"
    assert [layer.causal for layer in drafter.layers] == [True, True, False]  # z-lab: sliding causal, full bidi
    state = drafter.state_dict()
    for key, value in tensors.items():
        assert torch.equal(state[key], value), key

    # round trip through our own writer, in either schema
    out = save_drafter(drafter, tmp_path / "again", schema=schema)
    written = json.loads((out / "config.json").read_text())
    assert ("block_size" in written) == (schema == "old")
    assert ("block_size" in written["dflash_config"]) == (schema == "new")
    again = load_drafter(out)
    prompt = list(range(10, 30))
    assert _draft_once(drafter, target, prompt).tokens == _draft_once(again, target, prompt).tokens


def test_block_attention_mode_is_read_recorded_and_overridable(tmp_path, target):
    _write_zlab(tmp_path / "bidi", _zlab_config(is_causal=False))
    bidi = load_drafter(tmp_path / "bidi")
    assert bidi.cfg.block_attention == "bidirectional" and not any(layer.causal for layer in bidi.layers)
    forced = load_drafter(tmp_path / "bidi", block_attention="causal")
    assert all(layer.causal for layer in forced.layers)
    saved = json.loads((save_drafter(forced, tmp_path / "causal") / "config.json").read_text())
    assert saved["is_causal"] is True and saved["dflash_config"]["block_attention"] == "causal"
    assert load_drafter(tmp_path / "causal").cfg.block_attention == "causal"
    # the modes really differ on the same weights
    prompt = list(range(40, 60))
    mixed = load_drafter(tmp_path / "bidi", block_attention="mixed")
    a, b = _draft_once(bidi, target, prompt), _draft_once(mixed, target, prompt)
    assert a.confidence != b.confidence


def test_causal_block_positions_ignore_later_positions(target):
    drafter = random_drafter(target, num_layers=2, block_size=6, block_attention="causal", seed=1)
    drafter.check_target(target)
    ctx_k = [torch.randn(1, 2, 5, 16) for _ in range(2)]
    ctx_v = [torch.randn(1, 2, 5, 16) for _ in range(2)]
    ctx_pos, pos = torch.arange(5), torch.arange(5, 11)
    x = torch.randn(1, 6, 64)
    y = x.clone()
    y[:, 4:] += 1.0
    with torch.no_grad():
        hx = drafter.block_hidden(x, pos, ctx_k, ctx_v, ctx_pos)
        hy = drafter.block_hidden(y, pos, ctx_k, ctx_v, ctx_pos)
    torch.testing.assert_close(hx[:, :4], hy[:, :4])
    assert not torch.allclose(hx[:, 4:], hy[:, 4:])


def test_block_mask_sliding_window():
    mask = block_mask(torch.arange(6), torch.arange(6, 9), causal=True, sliding_window=4)
    # query at position 6 sees positions 3..6; at 8 sees 5..8
    assert mask[0].nonzero().flatten().tolist() == [3, 4, 5, 6]
    assert mask[2].nonzero().flatten().tolist() == [5, 6, 7, 8]
    assert block_mask(torch.arange(6), torch.arange(6, 9), causal=False, sliding_window=None) is None


def test_incremental_context_equals_full_recompute(target):
    """The drafter's context cache (per-layer K/V of committed positions, extended each cycle) gives the same draft
    as projecting the whole context at once."""
    drafter = random_drafter(target, num_layers=2, block_size=5, seed=2)
    drafter.check_target(target)
    ids = list(range(3, 40))
    with torch.no_grad():
        feats = drafter.select_features(target(torch.tensor([ids]), output_hidden_states=True).hidden_states)
    step = drafter.new_context()
    for lo, hi in [(0, 20), (20, 23), (23, 24), (24, 37)]:
        step.add_pending(feats[:, lo:hi])
        if hi < 37:
            drafter.draft(step, ids[hi], 0.0, 1.0, torch.Generator())  # absorbs the pending features
    step.crop(36)  # and cropping back works
    step.add_pending(feats[:, 36:37])
    whole = drafter.new_context()
    whole.add_pending(feats)
    a = drafter.draft(step, 7, 0.0, 1.0, torch.Generator())
    b = drafter.draft(whole, 7, 0.0, 1.0, torch.Generator())
    assert a.tokens == b.tokens
    assert a.confidence == pytest.approx(b.confidence, rel=1e-5)


def test_rejects_what_it_cannot_run(tmp_path, target):
    dflash2 = _zlab_config()
    dflash2["dflash_config"].update(conv_kernel_size=2, selector_rank=256)
    (tmp_path / "d2").mkdir()
    (tmp_path / "d2" / "config.json").write_text(json.dumps(dflash2))
    with pytest.raises(ValueError, match="DFlash2"):
        load_drafter(tmp_path / "d2")
    raw = _zlab_config()
    del raw["dflash_config"]["mask_token_id"]
    (tmp_path / "nomask").mkdir()
    (tmp_path / "nomask" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="mask_token_id"):
        load_drafter(tmp_path / "nomask")
    wrong = DFlashDrafter(DrafterConfig.from_json(_zlab_config(hidden_size=32, head_dim=8)))
    with pytest.raises(ValueError, match="hidden size"):
        Engine(target, drafter=wrong)
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path / "missing")


def test_restricted_draft_vocabulary(tmp_path, target):
    counts = torch.zeros(128)
    counts[torch.arange(0, 128, 3)] = torch.arange(43, dtype=torch.float) + 1  # every third id was seen
    vocab = build_draft_vocab(counts, 32)
    assert vocab.tolist() == sorted(vocab.tolist()) and len(vocab) == 32 and all(int(v) % 3 == 0 for v in vocab)
    drafter = random_drafter(target, block_size=5, seed=3)
    drafter.restrict_vocab(vocab, 128)
    path = save_drafter(drafter, tmp_path / "small")
    loaded = load_drafter(path)
    assert torch.equal(loaded.draft_vocab, vocab)
    prompt = list(range(60, 80))
    engine = Engine(target, drafter=loaded)
    out = [t for b in engine.generate(prompt, SamplingParams(max_tokens=30)) for t in b]
    assert out == [t for b in Engine(target).generate(prompt, SamplingParams(max_tokens=30)) for t in b]
    assert engine.last_stats.out_of_draft_vocab == sum(1 for t in out if t not in set(vocab.tolist()))
    draft = loaded.draft(loaded.new_context(), 5, 1.0, 1.0, torch.Generator().manual_seed(0))
    assert set(draft.tokens) <= set(vocab.tolist())
    assert float(draft.probs[:, [i for i in range(128) if i not in set(vocab.tolist())]].sum()) == 0.0


def test_find_shipped_drafter(tmp_path):
    raw = _zlab_config()
    raw["dflash_config"]["target_model"] = "SmolLM2-135M-Instruct"
    (tmp_path / "smollm2-dflash-b8").mkdir()
    (tmp_path / "smollm2-dflash-b8" / "config.json").write_text(json.dumps(raw))
    (tmp_path / "Qwen3.6-35B-A3B-DFlash").mkdir()
    (tmp_path / "Qwen3.6-35B-A3B-DFlash" / "config.json").write_text(json.dumps(_zlab_config()))
    found = tmp_path / "smollm2-dflash-b8"
    assert find_shipped_drafter("SmolLM2-135M-Instruct", root=tmp_path) == found
    assert find_shipped_drafter("HuggingFaceTB/SmolLM2-135M-Instruct", root=tmp_path) == found
    assert find_shipped_drafter("SmolLM2-135M-Instruct.Q4_1.gguf", root=tmp_path) == found
    assert find_shipped_drafter("Qwen/Qwen3.6-35B-A3B", root=tmp_path) == tmp_path / "Qwen3.6-35B-A3B-DFlash"
    assert find_shipped_drafter("SmolLM2-360M-Instruct", root=tmp_path) is None
    assert find_shipped_drafter("anything", root=tmp_path / "nowhere") is None
