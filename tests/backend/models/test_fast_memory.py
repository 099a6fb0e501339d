"""What the fast path holds beside the transformers model (issue 29: the idle server's memory): the fused Llama
projections are the only copy of their weights, and a CPU KV cache that grows with use gives bitwise the logits of one
allocated for the whole window. The memory itself is measured by bench/serve_hostile.py --idle, not here."""
import torch

from backend.models import load_fast
from backend.models.static_cache import KVCache
from tests.backend.models.test_fast_models import seeded, tiny_llama


def test_fused_projections_are_the_only_copy_and_transformers_reads_them_unchanged():
    seeded()
    hf = tiny_llama()
    tokens = torch.randint(0, 320, (1, 23))
    with torch.no_grad():
        before = hf(tokens).logits
    originals = [{n: getattr(layer.self_attn, n).weight.clone() for n in ("q_proj", "k_proj", "v_proj")} |
                 {n: getattr(layer.mlp, n).weight.clone() for n in ("gate_proj", "up_proj")}
                 for layer in hf.model.layers]
    first, second = load_fast(hf, max_context=64), load_fast(hf, max_context=64)  # two engines over one model
    for layer, fused, again, orig in zip(hf.model.layers, first.model.layers, second.model.layers, originals):
        a, m = layer.self_attn, layer.mlp
        assert torch.equal(fused.wqkv, torch.cat([orig["q_proj"], orig["k_proj"], orig["v_proj"]]))
        assert torch.equal(fused.w_gate_up, torch.cat([orig["gate_proj"], orig["up_proj"]]))
        for module, name in [(a.q_proj, "q_proj"), (a.k_proj, "k_proj"), (a.v_proj, "v_proj")]:
            assert module.weight.untyped_storage().data_ptr() == fused.wqkv.untyped_storage().data_ptr(), name
            assert torch.equal(module.weight, orig[name])
        for module in (m.gate_proj, m.up_proj):
            assert module.weight.untyped_storage().data_ptr() == fused.w_gate_up.untyped_storage().data_ptr()
        assert again.wqkv.data_ptr() == fused.wqkv.data_ptr()  # the second engine made no new copy
        assert again.w_gate_up.data_ptr() == fused.w_gate_up.data_ptr()
    with torch.no_grad():
        assert torch.equal(hf(tokens).logits, before)


def test_a_growing_cpu_kv_cache_gives_the_logits_of_a_whole_one():
    seeded()
    hf = tiny_llama()
    window = 1100
    growing, whole = load_fast(hf, max_context=window), load_fast(hf, max_context=window)
    kv = growing.model.kv
    whole.model.kv = KVCache(len(hf.model.layers), kv.k.shape[1], kv.k.shape[3], window, "cpu", kv.k.dtype,
                             growable=False)
    assert kv.growable and kv.capacity == KVCache.INITIAL_COLUMNS and whole.model.kv.capacity == window
    prompt = torch.randint(0, 320, (300,))  # past the first 256 positions at once
    a, _ = growing.prefill(prompt)
    b, _ = whole.prefill(prompt)
    assert torch.equal(a, b) and kv.capacity == 512
    token = int(a.argmax())
    for _ in range(300):  # plain steps across 512
        a, _ = growing.decode(token)
        b, _ = whole.decode(token)
        assert torch.equal(a, b), growing.length
        token = int(a.argmax())
    for _ in range(65):  # verified blocks across 1024 (600 + 65 x 7), partly accepted, as speculation does
        block = [token] + torch.randint(0, 320, (15,)).tolist()
        la, _ = growing.verify(block)
        lb, _ = whole.verify(block)
        assert torch.equal(la, lb), growing.length
        growing.accept(7)
        whole.accept(7)
        token = int(la[6].argmax())
    assert kv.capacity == window and growing.length == whole.length > 1024
    n = growing.length
    assert torch.equal(kv.k[:, :, :n], whole.model.kv.k[:, :, :n])
    assert torch.equal(kv.v[:, :, :n], whole.model.kv.v[:, :, :n])
