"""The fast target path: backend/models (Llama, Qwen3.5/3.6-MoE, FastModel), backend/models/static_cache.py and
reviewer_kernels/gdn_state.py, checked against transformers' own implementations on tiny random configs (CPU, fp32), and
against the real embedded model (SmolLM2-135M) once.

What is claimed and checked here:
- logits and drafter features equal transformers' within fp32 rounding, for prefill (both Gated DeltaNet forms), plain
  decode steps and block verifies;
- after a verify and accept(n), at every n, the caches are those plain decoding reaches (same states within fp32
  rounding, same next logits), and greedy speculative decoding emits exactly the plain greedy tokens;
- the recurrence kernel's per-position states are bit-for-bit those of running the tokens one at a time (PyTorch loop
  here; the Triton kernel under Triton's CPU interpreter in a subprocess, fp32);
- architectures without a fast path get None, so the engine keeps transformers.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_qwen

from backend.models import FastModel, invariant_numerics, load_fast
from backend.models.qwen3_5_moe import CHUNKED_FROM
from reviewer_kernels.gdn_state import gdn_chunked, gdn_recurrent
from tests import interpreter

TOL = dict(rtol=1e-5, atol=2e-5)


# Tiny matmuls: a second OpenMP thread only adds synchronisation (and on a shared 2-core machine, waits).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def seeded(seed=None) -> int:
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    torch.manual_seed(seed)
    return seed


def tiny_llama(tie=True, rope=None) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                         max_position_embeddings=512, rope_parameters=rope or {"rope_type": "default",
                                                                                 "rope_theta": 100000.0})
    model = LlamaForCausalLM(config).eval()
    _spread(model)
    return model


def tiny_qwen(layers=4) -> Qwen3_5MoeForCausalLM:
    config = Qwen3_5MoeTextConfig(vocab_size=320, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                  linear_key_head_dim=16, linear_value_head_dim=16, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=48, num_experts=16, num_experts_per_tok=4,
                                  max_position_embeddings=512)
    model = Qwen3_5MoeForCausalLM(config).eval()
    _spread(model)
    return model


def count_calls(module, names, calls: dict | None = None) -> dict:
    """Replace module.<name> for each name by a wrapper that counts its calls into `calls` (returned; new if None):
    the interpreter scripts check which kernels a decode step really took."""
    calls = {} if calls is None else calls
    for name in names:
        calls[name] = 0

        def wrapper(*args, _name=name, _fn=getattr(module, name), **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        setattr(module, name, wrapper)
    return calls


def _spread(model) -> None:
    """Random init leaves norms at their identity and logits tiny; spread them so mistakes show and argmax is stable."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0, 1.0)


def hf_step(model, ids, cache, hidden=False):
    with torch.no_grad():
        return model(torch.as_tensor(ids).reshape(1, -1), past_key_values=cache, use_cache=True,
                     output_hidden_states=hidden)


# ---- the Gated DeltaNet recurrence -----------------------------------------------------------------------------------

def random_gdn(T, hk=2, hv=4, dk=16, dv=8, dtype=torch.float32):
    r = torch.randn
    return (r(T, hk, dk, dtype=dtype), r(T, hk, dk, dtype=dtype), r(T, hv, dv, dtype=dtype),
            -torch.rand(T, hv) * 2, torch.rand(T, hv, dtype=dtype), r(hv, dk, dv))


@pytest.mark.parametrize("T", [1, 5, 70, 130])
def test_recurrence_matches_transformers(T):
    seeded()
    q, k, v, g, beta, s0 = random_gdn(T)
    # each key head serves consecutive value heads, expanded before the reference as transformers' layer does (its
    # function takes grouped heads itself only in some releases: 5.17 does not)
    group = v.shape[1] // q.shape[1]
    qe, ke = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    ref_out, ref_state = hf_qwen.torch_recurrent_gated_delta_rule(
        qe[None], ke[None], v[None], g[None], beta[None], initial_state=s0[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    state = s0.clone()
    out = gdn_recurrent(q, k, v, g, beta, state, state, every_position=False)
    torch.testing.assert_close(out, ref_out[0], rtol=0, atol=0)
    torch.testing.assert_close(state, ref_state[0], rtol=0, atol=0)
    state = s0.clone()  # the chunked prefill form: same function, other summation order
    out = gdn_chunked(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state[0], rtol=1e-5, atol=1e-5)


def test_per_position_states_equal_token_by_token():
    seeded()
    T = 9
    q, k, v, g, beta, s0 = random_gdn(T, hk=1, hv=3, dk=12, dv=20)
    snaps = torch.full((T, 3, 12, 20), float("nan"))
    out = gdn_recurrent(q, k, v, g, beta, s0, snaps, every_position=True)
    state, outs = s0.clone(), []
    for t in range(T):
        outs.append(gdn_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state, state,
                                  every_position=False))
        assert torch.equal(snaps[t], state), t
    assert torch.equal(torch.cat(outs), out)


def test_replaying_a_verifys_recorded_inputs_gives_the_decode_states():
    """gdn_verify records the block's inputs and leaves the state alone; gdn_replay(n) then gives every layer the state
    plain decoding reaches after n tokens, bit for bit, and the verify's outputs are the decode steps' (PyTorch)."""
    from reviewer_kernels.gdn_state import GdnRecord, gdn_replay, gdn_verify

    seeded()
    T, layers, hk, hv, dk, dv = 6, 2, 1, 3, 12, 20
    # gates given as g, beta: on the CPU, torch's vectorised softplus over T tokens and its scalar tail over one can
    # round differently (the Triton script below computes them in the kernel, per element)
    gates = None
    blocks = [random_gdn(T, hk=hk, hv=hv, dk=dk, dv=dv) for _ in range(layers)]
    record = GdnRecord.empty(layers, 8, hk, dk, hv, dv, "cpu", torch.float32)
    states = torch.stack([b[-1] for b in blocks])
    before = states.clone()
    outs = [gdn_verify(q, k, v, a, b, states[i], record.layer(i), gates=gates)
            for i, (q, k, v, a, b, _) in enumerate(blocks)]
    assert torch.equal(states, before)  # a verify writes no state
    for n in range(1, T + 1):
        replayed = states.clone()
        gdn_replay(record, replayed, n)
        for i, (q, k, v, a, b, s0) in enumerate(blocks):
            state = s0.clone()
            for t in range(n):
                step = gdn_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], a[t:t + 1], b[t:t + 1], state, state,
                                     False, gates=gates)
                assert torch.equal(step[0], outs[i][t])
            assert torch.equal(replayed[i], state), (n, i)
    with pytest.raises(ValueError, match="replay 1..8"):
        gdn_replay(record, states, 9)


def test_recurrence_rejects_bad_shapes():
    q, k, v, g, beta, s0 = random_gdn(4)
    with pytest.raises(ValueError, match="states_out"):
        gdn_recurrent(q, k, v, g, beta, s0, torch.empty(3, *s0.shape), every_position=True)
    with pytest.raises(ValueError, match="state_in"):
        gdn_recurrent(q, k, v, g, beta, s0.double(), s0, every_position=False)


TRITON_SCRIPT = textwrap.dedent("""
    import torch
    from reviewer_kernels.gdn_state import gdn_recurrent
    torch.manual_seed(0)
    for T, hk, hv, dk, dv, prefetch in [(7, 2, 4, 16, 8, True), (3, 1, 2, 12, 40, True), (5, 2, 4, 16, 8, False)]:
        q, k = torch.randn(T, hk, dk), torch.randn(T, hk, dk)
        v, g, beta, s0 = torch.randn(T, hv, dv), -torch.rand(T, hv), torch.rand(T, hv), torch.randn(hv, dk, dv)
        snaps = torch.full((T, hv, dk, dv), float("nan"))
        out = gdn_recurrent(q, k, v, g, beta, s0, snaps, True, use_triton=True, prefetch=prefetch)
        ref_snaps = torch.empty_like(snaps)
        ref = gdn_recurrent(q, k, v, g, beta, s0, ref_snaps, True, use_triton=False)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(snaps, ref_snaps, rtol=1e-5, atol=1e-5)
        state = s0.clone()
        for t in range(T):  # one token at a time through the same kernel: bit-identical states
            step = gdn_recurrent(q[t:t+1], k[t:t+1], v[t:t+1], g[t:t+1], beta[t:t+1], state, state, False,
                                 use_triton=True, prefetch=prefetch)
            assert torch.equal(state, snaps[t]) and torch.equal(step[0], out[t]), (T, t)
    # gates computed in the kernel from the raw projections a, b (softplus over both of its branches)
    T, hk, hv, dk, dv = 6, 2, 4, 16, 8
    q, k, v, s0 = torch.randn(T, hk, dk), torch.randn(T, hk, dk), torch.randn(T, hv, dv), torch.randn(hv, dk, dv)
    a, b = torch.linspace(-30, 30, T * hv).reshape(T, hv), torch.randn(T, hv) * 4
    gates = (-torch.rand(hv) - 0.1, torch.randn(hv))
    snaps, ref_snaps = torch.empty(T, hv, dk, dv), torch.empty(T, hv, dk, dv)
    out = gdn_recurrent(q, k, v, a, b, s0, snaps, True, gates=gates, use_triton=True)
    ref = gdn_recurrent(q, k, v, a, b, s0, ref_snaps, True, gates=gates, use_triton=False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(snaps, ref_snaps, rtol=1e-5, atol=1e-5)
    # a verify that records its inputs, replayed for two layers in one launch: the states of token-by-token decoding
    from reviewer_kernels.gdn_state import GdnRecord, gdn_replay, gdn_verify
    record = GdnRecord.empty(2, T, hk, dk, hv, dv, "cpu", torch.float32)
    states = torch.stack([s0, s0 + 1])
    outs = [gdn_verify(q, k, v, a, b, states[i], record.layer(i), gates=gates, use_triton=True) for i in range(2)]
    assert torch.equal(outs[0], out)
    for n in (1, 4, T):
        replayed = states.clone()
        gdn_replay(record, replayed, n, use_triton=True)
        for i in range(2):
            state = states[i].clone()
            for t in range(n):
                gdn_recurrent(q[t:t+1], k[t:t+1], v[t:t+1], a[t:t+1], b[t:t+1], state, state, False, gates=gates,
                              use_triton=True)
            assert torch.equal(replayed[i], state), (n, i)
    print("ok")
""")


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    done = interpreter.run(TRITON_SCRIPT, timeout=300)  # usually computed in the background already
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# ---- Llama -----------------------------------------------------------------------------------------------------------

def test_llama_prefill_decode_verify_match_transformers():
    seeded()
    hf = tiny_llama()
    fast = load_fast(hf, max_context=256)
    assert fast is not None and not fast.hybrid
    prompt = torch.randint(0, 320, (37,))
    cache = DynamicCache(config=hf.config)
    ref = hf_step(hf, prompt, cache, hidden=True)
    logits, feats = fast.prefill(prompt, hidden_ids=(0, 2))
    torch.testing.assert_close(logits, ref.logits[0, -1], **TOL)
    # layer 0's output, and the last layer's (after the final norm, like transformers' hidden_states[-1])
    torch.testing.assert_close(feats, torch.cat([ref.hidden_states[1][0], ref.hidden_states[3][0]], -1), **TOL)
    token = int(logits.argmax())
    for _ in range(4):
        ref = hf_step(hf, [token], cache)
        logits, _ = fast.decode(token)
        torch.testing.assert_close(logits, ref.logits[0, -1], **TOL)
        token = int(logits.argmax())
    block = torch.randint(0, 320, (7,))
    ref = hf_step(hf, block, cache)
    logits, _ = fast.verify(block)
    torch.testing.assert_close(logits, ref.logits[0], **TOL)
    fast.accept(7)
    assert fast.length == 37 + 4 + 7


def test_llama_untied_head_and_scaled_rope():
    seeded()
    hf = tiny_llama(tie=False, rope={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64})
    fast = load_fast(hf, max_context=512)
    prompt = torch.randint(0, 320, (300,))  # past original_max_position_embeddings
    with torch.no_grad():
        ref = hf(prompt[None]).logits[0, -1]
    torch.testing.assert_close(fast.prefill(prompt)[0], ref, **TOL)


LLAMA_TRITON_SCRIPT = textwrap.dedent("""
    import importlib
    import torch
    from transformers import DynamicCache
    from backend.models import load_fast
    from tests.backend.models.test_fast_models import TOL, count_calls, hf_step, seeded, tiny_llama
    calls = count_calls(importlib.import_module("backend.models.llama"), ["norm_gemv", "gemv"])
    seeded()
    for tie, hidden in ((True, (0, 2)), (False, (1,))):  # with the last layer's features: its norm outside the head
        hf = tiny_llama(tie=tie)
        fast = load_fast(hf, max_context=64)
        prompt = torch.randint(0, 320, (9,))
        cache = DynamicCache(config=hf.config)
        fast.prefill(prompt)
        token = int(hf_step(hf, prompt, cache).logits[0, -1].argmax())
        for _ in range(3):
            logits, feats = fast.decode(token, hidden_ids=hidden)
            ref = hf_step(hf, [token], cache, hidden=True)
            torch.testing.assert_close(logits, ref.logits[0, -1], **TOL)
            torch.testing.assert_close(feats, torch.cat([ref.hidden_states[i + 1][0] for i in hidden], -1), **TOL)
            token = int(ref.logits[0, -1].argmax())
    # 3 layers x (q/k/v, gate/up) per step, + the LM head (always the row kernel: the features of the last layer
    # take their own norm); 2 models x 3 steps
    assert calls == {"norm_gemv": 2 * 3 * (2 * 3 + 1), "gemv": 2 * 3 * 2 * 3}, calls
    print("ok")
""")


def test_llama_decode_step_through_triton_kernels_under_interpreter():
    """A decode step with every Triton kernel (interpreted on the CPU): norm + q/k/v + RoPE, norm + gate/up + SwiGLU
    and the LM head through reviewer_kernels/norm_gemv.py, the output and down projections with their residual add
    through reviewer_kernels/gemv.py; logits and features are transformers' (fp32)."""
    pytest.importorskip("triton")
    done = interpreter.run(LLAMA_TRITON_SCRIPT, timeout=600)  # usually computed in the background already
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


LLAMA_GLUE_SCRIPT = textwrap.dedent("""
    import torch
    from transformers import DynamicCache
    from backend.models import invariant_numerics, load_fast
    from tests.backend.models.test_fast_models import TOL, count_calls, hf_step, seeded, tiny_llama
    seeded()
    hf = tiny_llama(tie=False)
    fast = load_fast(hf, max_context=64, numerics=invariant_numerics("test", "glue"))  # llama_invariant_path "glue"
    assert fast.model.step_path == "glue" and not fast.model.glue_steps  # on the CPU the cuBLAS check is not passed
    fast.model.kv.use_block_kernel = True  # the block-attention kernel runs interpreted too (CUDA-only by default)
    fast.model.glue_invariant = True  # CPU BLAS fails that check (row counts round differently): this checks the math
    assert fast.model.glue_steps
    calls = count_calls(fast.model, ["_padded_glue"])
    prompt = torch.randint(0, 320, (20,))
    cache = DynamicCache(config=hf.config)
    fast.prefill(prompt)  # 20 tokens: the unpadded glue
    token = int(hf_step(hf, prompt, cache).logits[0, -1].argmax())
    for _ in range(2):
        logits, feats = fast.decode(token, hidden_ids=(0, 2))
        ref = hf_step(hf, [token], cache, hidden=True)
        torch.testing.assert_close(logits, ref.logits[0, -1], **TOL)
        torch.testing.assert_close(feats, torch.cat([ref.hidden_states[i + 1][0] for i in (0, 2)], -1), **TOL)
        token = int(ref.logits[0, -1].argmax())
    block = [token, 5, 6, 7]
    logits, _ = fast.verify(block)
    ref = hf_step(hf, block, cache)
    torch.testing.assert_close(logits, ref.logits[0], **TOL)
    assert calls == {"_padded_glue": 3}, calls
    print("ok")
""")


def test_llama_glue_steps_compute_what_the_model_does_under_interpreter():
    """step_path "glue" (_padded_glue: the glue on 16 padded rows, attention on the real ones, written into the
    padded buffer) gives transformers' logits and features (fp32, every kernel interpreted) for decode steps and a
    verify."""
    pytest.importorskip("triton")
    done = interpreter.run(LLAMA_GLUE_SCRIPT, timeout=600)  # usually computed in the background already
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_no_fast_path_for_other_architectures():
    seeded()
    dynamic = tiny_llama(rope={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert load_fast(dynamic) is None
    from transformers import Qwen2Config, Qwen2ForCausalLM
    qwen2 = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert load_fast(qwen2) is None


# ---- Qwen3.5/3.6 MoE -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt_len", [CHUNKED_FROM + 13, 9])  # chunked and token-loop prefill
def test_qwen_prefill_decode_verify_match_transformers(prompt_len):
    seeded()
    hf = tiny_qwen()
    fast = load_fast(hf, max_context=256)
    assert fast is not None and fast.hybrid
    prompt = torch.randint(0, 320, (prompt_len,))
    cache = DynamicCache(config=hf.config)
    ref = hf_step(hf, prompt, cache, hidden=True)
    logits, feats = fast.prefill(prompt, hidden_ids=(1, 2, 3))
    torch.testing.assert_close(logits, ref.logits[0, -1], **TOL)
    torch.testing.assert_close(feats, torch.cat([ref.hidden_states[i + 1][0] for i in (1, 2, 3)], -1), **TOL)
    token = int(logits.argmax())
    for _ in range(4):
        ref = hf_step(hf, [token], cache)
        logits, _ = fast.decode(token)
        torch.testing.assert_close(logits, ref.logits[0, -1], **TOL)
        token = int(logits.argmax())
    block = torch.randint(0, 320, (16,))
    ref = hf_step(hf, block, cache)
    logits, _ = fast.verify(block)
    torch.testing.assert_close(logits, ref.logits[0], **TOL)
    fast.accept(16)  # all accepted: the caches now equal transformers' after the same 16 tokens
    token = int(ref.logits[0, -1].argmax())
    torch.testing.assert_close(fast.decode(token)[0], hf_step(hf, [token], cache).logits[0, -1], **TOL)


QWEN_TRITON_SCRIPT = textwrap.dedent("""
    import importlib
    import torch
    from transformers import DynamicCache
    from backend.models import load_fast
    from tests.backend.models.test_fast_models import TOL, count_calls, hf_step, seeded, tiny_qwen, tiny_qwen_same_shared
    qm = importlib.import_module("backend.models.qwen3_5_moe")
    fm = importlib.import_module("reviewer_kernels.fused_moe")
    calls = count_calls(fm, ["decode_moe"], count_calls(qm, ["gemv"]))
    seeded()
    for shared in (48, 32):  # the shared expert inside the kernels (same intermediate size) or beside them
        hf = tiny_qwen() if shared == 48 else tiny_qwen_same_shared()
        fast = load_fast(hf, max_context=64)
        prompt = torch.randint(0, 320, (9,))
        cache = DynamicCache(config=hf.config)
        logits, _ = fast.prefill(prompt)
        token = int(hf_step(hf, prompt, cache).logits[0, -1].argmax())
        for _ in range(3):
            logits, _ = fast.decode(token)
            ref = hf_step(hf, [token], cache).logits[0, -1]
            torch.testing.assert_close(logits, ref, **TOL)
            token = int(ref.argmax())
    # 4 layers: 3 DeltaNet + 1 attention output projections and 4 MoE blocks per decode step
    assert calls == {"gemv": 2 * 3 * 4, "decode_moe": 2 * 3 * 4}, calls
    print("ok")
""")


QWEN_PADDED_SCRIPT = textwrap.dedent("""
    import importlib
    import torch
    from dataclasses import replace
    from backend.models import invariant_numerics, load_fast
    from backend.models.numerics import QwenNumerics
    from tests.backend.models.test_fast_models import count_calls, seeded, tiny_qwen
    seeded()
    hf = tiny_qwen()
    for kernels, experts in ((False, "tuned"), (True, "tuned"), (True, "gemv_blocks")):
        # the invariant numerics' padded rows, both kinds of projection through reviewer_kernels/wide_linear.py, the
        # glue compiled-or-eager PyTorch or in our kernels; the experts on grouped tiles or on the one-token programs'
        # block kernels (the next layer's norm then in norms.py's launch: no slot sum holds it)
        numerics = replace(invariant_numerics("test"), qwen=QwenNumerics(
            padded_rows=True, wide_projections={"in", "out"}, glue_kernels=kernels, experts=experts))
        ref, fast = load_fast(hf, max_context=128), load_fast(hf, max_context=128, numerics=numerics)
        fast.model.kv.use_block_kernel = True  # the block-attention kernel runs interpreted too (CUDA-only by default)
        calls = count_calls(fast.model, ["_padded_rows"], count_calls(importlib.import_module(
            "backend.models.qwen3_5_moe"), ["wide_linear", "gdn_conv", "attention_prep"]))
        count_calls(importlib.import_module("reviewer_kernels.norms"), ["gated_rms_norm", "rms_norm"], calls)
        count_calls(importlib.import_module("reviewer_kernels.fused_moe"), ["blocks_moe"], calls)
        prompt = torch.randint(0, 320, (12,))
        for model in (ref, fast):
            model.prefill(prompt, hidden_ids=(1, 3))
        tokens = torch.randint(0, 320, (6,)).tolist()
        for t in tokens[:2]:  # decode steps, with drafter features (the last layer's after the final norm)
            a, b = ref.decode(t, (1, 3)), fast.decode(t, (1, 3))
            torch.testing.assert_close(b[0], a[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(b[1], a[1], rtol=1e-4, atol=1e-4)
        a, b = ref.verify(tokens[2:])[0], fast.verify(tokens[2:])[0]  # a verify, cut short
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        ref.accept(2)
        fast.accept(2)
        torch.testing.assert_close(fast.decode(7)[0], ref.decode(7)[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fast.model.linear.state, ref.model.linear.state, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fast.model.kv.k, ref.model.kv.k, rtol=1e-4, atol=1e-5)
        # the 12-token prefill too (pieces of up to 16 tokens take it), 2 steps, verify, step; each through the 4
        # layers' output projections (reviewer_kernels/wide_linear.py; and the input projections too when asked), each
        # DeltaNet layer's convolution with its cache update in one launch (reviewer_kernels/gdn_conv.py); with
        # glue_kernels each DeltaNet layer's gated norm (reviewer_kernels/norms.py) and the attention layer's norms,
        # RoPE and cache write (reviewer_kernels/attention_prep.py)
        gemv = experts != "tuned"
        want = {"_padded_rows": 5, "wide_linear": 5 * 4 * 2, "gdn_conv": 5 * 3, "attention_prep": 5 * kernels,
                "gated_rms_norm": 5 * 3 * kernels, "rms_norm": 5 * 4 * kernels * gemv, "blocks_moe": 5 * 4 * gemv}
        assert {k: v for k, v in calls.items() if v} == {k: v for k, v in want.items() if v}, (kernels, experts, calls)
    print("ok")
""")


def test_qwen_padded_rows_compute_what_the_model_does_under_interpreter():
    """The invariant numerics' path (QwenNumerics.padded_rows: _padded_rows, glue and the projections of
    reviewer_kernels/wide_linear.py on 16 padded rows, attention, recurrence and experts on the real ones, written into
    the padded buffers) gives the regular forward's logits and states (fp32, every kernel interpreted) for decode steps,
    a verify and the accept after it."""
    pytest.importorskip("triton")
    done = interpreter.run(QWEN_PADDED_SCRIPT, timeout=600)  # usually computed in the background already
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


QWEN_PIECE_SCRIPT = textwrap.dedent("""
    import importlib
    import torch
    from transformers import DynamicCache
    from backend.models import load_fast
    from backend.models.qwen3_5_moe import CHUNKED_FROM
    from tests.backend.models.test_fast_models import TOL, count_calls, hf_step, seeded, tiny_qwen
    qm = importlib.import_module("backend.models.qwen3_5_moe")
    calls = count_calls(qm, ["gdn_conv_prefill", "gdn_chunked"],
                        count_calls(importlib.import_module("reviewer_kernels.norms"),
                                    ["rms_norm", "add_rms_norm", "gated_rms_norm"]))
    seeded()
    hf = tiny_qwen()
    fast = load_fast(hf, max_context=320)
    cache = DynamicCache(config=hf.config)
    # two pieces: the second continues from the conv window and state the first left (and from a decode step's)
    for n in (CHUNKED_FROM + 13, CHUNKED_FROM + 70):
        prompt = torch.randint(0, 320, (n,))
        ref = hf_step(hf, prompt, cache, hidden=True)
        logits, feats = fast.prefill(prompt, hidden_ids=(1, 3))
        torch.testing.assert_close(logits, ref.logits[0, -1], **TOL)
        torch.testing.assert_close(feats, torch.cat([ref.hidden_states[i + 1][0] for i in (1, 3)], -1), **TOL)
        token = int(logits.argmax())
        torch.testing.assert_close(fast.decode(token)[0], hf_step(hf, [token], cache).logits[0, -1], **TOL)
    # per piece: 3 DeltaNet layers' convolution, recurrence and gated norm; 4 pre-norms + the final one; 4 MoE norms
    assert calls == {"gdn_conv_prefill": 6, "gdn_chunked": 6, "rms_norm": 10, "add_rms_norm": 8,
                     "gated_rms_norm": 6}, calls
    print("ok")
""")


def test_qwen_prefill_piece_kernels_match_transformers_under_interpreter():
    """A prefill piece of >= CHUNKED_FROM tokens where Triton runs takes the piece path (reviewer_kernels/norms.py,
    gdn_conv_prefill, the chunked recurrence's terms, solve and walk): logits and drafter features of two pieces (the second
    continuing the caches the first and a decode step left) and the decode step after each are transformers' (fp32,
    every kernel interpreted)."""
    pytest.importorskip("triton")
    done = interpreter.run(QWEN_PIECE_SCRIPT, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def tiny_qwen_same_shared():
    """tiny_qwen with the shared expert as wide as the routed ones (the 35B-A3B case: fused into the MoE kernels)."""
    seeded()
    config = tiny_qwen().config
    config.shared_expert_intermediate_size = config.moe_intermediate_size
    model = Qwen3_5MoeForCausalLM(config).eval()
    _spread(model)
    return model


def test_qwen_decode_step_through_triton_kernels_under_interpreter():
    """A decode step with every Triton kernel (interpreted on the CPU): the output projections with their gated norm
    or gate in one launch (reviewer_kernels/gemv.py) and the one-token MoE path (reviewer_kernels/moe_decode.py) are the
    ones taken, and the logits are transformers' (fp32)."""
    pytest.importorskip("triton")
    done = interpreter.run(QWEN_TRITON_SCRIPT, timeout=600)  # usually computed in the background already
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_qwen_rollback_equals_plain_decoding_at_every_accept_length():
    seeded()
    hf = tiny_qwen()
    fast, plain = load_fast(hf, max_context=128), load_fast(hf, max_context=128)
    prompt = torch.randint(0, 320, (20,))
    fast.prefill(prompt)
    plain.prefill(prompt)
    start = fast.snapshot()
    block = torch.randint(0, 320, (16,)).tolist()
    expected = []  # plain decoding, one token at a time: states after each block token, and the next step's logits
    for t in block:
        plain.decode(t)
        lin = plain.model.linear
        expected.append((lin.conv.clone(), lin.state.clone()))
        here = plain.snapshot()
        expected[-1] += (plain.decode(7)[0],)
        plain.restore(here)
    for keep in range(1, 17):
        fast.restore(start)
        fast.verify(block)
        fast.accept(keep)
        assert fast.length == 20 + keep
        conv, state, follow = expected[keep - 1]
        torch.testing.assert_close(fast.model.linear.conv, conv, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fast.model.linear.state, state, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fast.decode(7)[0], follow, **TOL)  # the next step sees the same model state


def greedy_plain(fast: FastModel, prompt, n):
    logits, _ = fast.prefill(prompt)
    out = [int(logits.argmax())]
    while len(out) < n:
        out.append(int(fast.decode(out[-1])[0].argmax()))
    return out


def greedy_speculative(fast: FastModel, prompt, n, propose):
    """Greedy speculative decoding over a FastModel: `propose(committed)` drafts up to 15 tokens."""
    logits, _ = fast.prefill(prompt)
    out = [int(logits.argmax())]
    while len(out) < n:
        draft = propose(out)[: min(15, n - len(out) - 1)]
        logits, _ = fast.verify([out[-1], *draft])
        choice = logits.argmax(-1).tolist()
        accepted = next((j for j, d in enumerate(draft) if d != choice[j]), len(draft))
        fast.accept(accepted + 1)
        out += draft[:accepted] + [choice[accepted]]
    return out[:n]


@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_greedy_speculative_output_identical_to_plain(arch):
    seeded()
    hf = tiny_llama() if arch == "llama" else tiny_qwen()
    prompt = torch.randint(0, 320, (12,))
    reference = greedy_plain(load_fast(hf, max_context=256), prompt, 60)
    rng = torch.Generator().manual_seed(1)

    def propose(committed):  # the true continuation with random corruptions: every accept length occurs
        truth = reference[len(committed):len(committed) + 15]
        return [t if torch.rand((), generator=rng) < 0.85 else (t + 1) % 320 for t in truth]

    fast = load_fast(hf, max_context=256)
    assert greedy_speculative(fast, prompt, 60, propose) == reference
    assert fast.length == 12 + 60 - 1  # the last token is emitted, not fed


def test_fastmodel_guards():
    seeded()
    fast = load_fast(tiny_qwen(layers=4), max_context=40)
    fast.prefill(torch.randint(0, 320, (30,)))
    fast.verify([1, 2, 3])
    with pytest.raises(RuntimeError, match="accept"):
        fast.decode(4)
    with pytest.raises(ValueError, match="keep"):
        fast.accept(4)
    fast.accept(2)
    with pytest.raises(ValueError, match="cannot be cut back"):
        fast.truncate(10)
    with pytest.raises(ValueError, match="exceed the context"):
        fast.verify(list(range(9)))
    with pytest.raises(ValueError, match="verify block"):
        fast.verify(list(range(17)))
    llama = load_fast(tiny_llama(), max_context=64)
    llama.prefill(torch.randint(0, 320, (20,)))
    llama.truncate(5)  # attention-only: any prefix
    assert llama.length == 5


# ---- the real embedded model -----------------------------------------------------------------------------------------

def test_embedded_smollm2_matches_transformers():
    from backend.loading import ModelLoadError, load_model
    try:
        loaded = load_model("embedded", device="cpu", dtype="float32")
    except ModelLoadError as exc:
        pytest.skip(f"embedded model unavailable: {exc}")
    hf, tok = loaded.model, loaded.tokenizer
    fast = load_fast(hf, max_context=512)
    assert fast is not None
    text = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a list."}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    cache = DynamicCache(config=hf.config)
    ref = hf_step(hf, prompt, cache)
    logits, _ = fast.prefill(prompt)
    torch.testing.assert_close(logits, ref.logits[0, -1], rtol=1e-4, atol=1e-4)
    ours, theirs = [int(logits.argmax())], [int(ref.logits[0, -1].argmax())]
    for _ in range(12):
        theirs.append(int(hf_step(hf, [theirs[-1]], cache).logits[0, -1].argmax()))
        ours.append(int(fast.decode(ours[-1])[0].argmax()))
    assert ours == theirs


# ---- GPU (skipped without CUDA) --------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_recurrence_kernel_bf16_matches_loop():
    seeded()
    q, k, v, g, beta, s0 = (x.cuda() for x in random_gdn(16, hk=4, hv=8, dk=128, dv=128))
    q, k, v, beta = q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16()
    snaps, ref_snaps = torch.empty(16, *s0.shape, device="cuda"), torch.empty(16, *s0.shape, device="cuda")
    out = gdn_recurrent(q, k, v, g, beta, s0, snaps, True, use_triton=True)
    ref = gdn_recurrent(q, k, v, g, beta, s0, ref_snaps, True, use_triton=False)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(snaps, ref_snaps, rtol=1e-4, atol=1e-4)
    # Token by token through the decode variant of the kernel: equal to fp32 rounding. (Bitwise on Triton's CPU
    # interpreter; on an H200 the EVERY_POSITION and in-place variants, or the alignment specialisations of sliced
    # inputs, compiled to code that differed in the last bits: seen 2026-11-29.)
    state = s0.clone()
    for t in range(16):
        gdn_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state, state, False)
        torch.testing.assert_close(state, snaps[t], rtol=1e-5, atol=1e-6)


@cuda
def test_cuda_replay_of_a_recorded_verify_is_bitwise_the_decode_states():
    """bf16 at the 35B-A3B shape (16 key heads, 32 value heads, 128 x 128), three layers: the states gdn_replay gives
    after n of a 16-token verify's tokens are bitwise those of n decode steps through the kernel, and the verify's
    outputs the decode steps' outputs (the engine's rollback after an accept)."""
    from reviewer_kernels.gdn_state import GdnRecord, gdn_replay, gdn_verify

    seeded()
    layers, T, hk, hv, d = 3, 16, 16, 32, 128
    gates = (-torch.rand(hv, device="cuda") - 0.1, torch.randn(hv, device="cuda"))
    blocks = []
    for _ in range(layers):  # inputs as the engine's glue makes them: rows of one projection output
        proj = torch.randn(T, 2 * hk * d + hv * d + 2 * hv, device="cuda").bfloat16()
        q, k, v, a, b = proj.split([hk * d, hk * d, hv * d, hv, hv], -1)
        blocks.append((q.view(T, hk, d), k.view(T, hk, d), v.view(T, hv, d), a, b))
    states = torch.randn(layers, hv, d, d, device="cuda") * 0.1
    record = GdnRecord.empty(layers, T, hk, d, hv, d, "cuda", torch.bfloat16)
    outs = [gdn_verify(*blk, states[i], record.layer(i), gates=gates) for i, blk in enumerate(blocks)]
    # the same verify again gives the same bits: a changed recurrence (eb3d6ec, reverted) differed from run to run in
    # 2 of 6 runs of this test on an H100, at a different token each time
    for _ in range(8):
        for i, blk in enumerate(blocks):
            again = gdn_verify(*blk, states[i], GdnRecord.empty(1, T, hk, d, hv, d, "cuda", torch.bfloat16).layer(0),
                               gates=gates)
            assert torch.equal(again, outs[i]), i
    for n in (1, 2, 7, 16):
        replayed = states.clone()
        gdn_replay(record, replayed, n)
        for i, (q, k, v, a, b) in enumerate(blocks):
            state = states[i].clone()
            for t in range(n):
                step = gdn_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], a[t:t + 1], b[t:t + 1], state, state,
                                     False, gates=gates)
                assert torch.equal(step[0], outs[i][t]), (n, i, t)
            assert torch.equal(replayed[i], state), (n, i)


@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_cuda_graphs_replay_what_eager_computes(arch):
    seeded()
    hf = (tiny_llama() if arch == "llama" else tiny_qwen()).to("cuda", torch.bfloat16)
    graphed, eager = load_fast(hf, 300, cuda_graphs=True), load_fast(hf, 300, cuda_graphs=False)
    prompt = torch.randint(0, 320, (40,))
    ref = hf_step(hf, prompt.cuda(), DynamicCache(config=hf.config)).logits[0, -1].float()
    for fast in (graphed, eager):
        logits, _ = fast.prefill(prompt)
        assert float((logits.float() - ref).norm() / ref.norm()) < 2e-2
    for step in range(40):  # decode and verify/accept at varying lengths, across attention-span buckets
        if step % 3:
            a, b = graphed.decode(step)[0], eager.decode(step)[0]
        else:
            block = torch.randint(0, 320, (1 + step % 16,))
            a, b = graphed.verify(block, hidden_ids=(1,))[0], eager.verify(block, hidden_ids=(1,))[0]
            keep = 1 + step % block.numel()
            graphed.accept(keep)
            eager.accept(keep)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert graphed.length == eager.length


@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_cuda_greedy_speculative_identical_to_plain(arch):
    seeded()
    hf = (tiny_llama() if arch == "llama" else tiny_qwen()).cuda()  # fp32: rounding far below the argmax margins
    prompt = torch.randint(0, 320, (12,))
    reference = greedy_plain(load_fast(hf, max_context=256), prompt, 60)
    rng = torch.Generator().manual_seed(1)

    def propose(committed):
        truth = reference[len(committed):len(committed) + 15]
        return [t if torch.rand((), generator=rng) < 0.85 else (t + 1) % 320 for t in truth]

    assert greedy_speculative(load_fast(hf, max_context=256), prompt, 60, propose) == reference


@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_cuda_compiled_glue_matches_eager(arch):
    seeded()
    hf = (tiny_llama() if arch == "llama" else tiny_qwen()).to("cuda", torch.bfloat16)
    compiled, eager = load_fast(hf, 256, compile=True), load_fast(hf, 256, cuda_graphs=False)
    prompt = torch.randint(0, 320, (20,))
    compiled.prefill(prompt)
    eager.prefill(prompt)
    for step in range(8):
        if step % 2:
            a, b = compiled.decode(step)[0], eager.decode(step)[0]
        else:
            block = torch.randint(0, 320, (2 + step,))
            a, b = compiled.verify(block)[0], eager.verify(block)[0]
            compiled.accept(2)
            eager.accept(2)
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 2e-2  # fused bf16 rounding differs


def test_qwen_numerics_choose_the_padded_steps_experts(monkeypatch):
    """QwenNumerics.experts: the grouped tiles of the device (here the untuned fallback), or every token through the
    one-token kernels for all PADDED_ROWS token counts (with their grids' token axis, or the block kernels sorted
    from 2 tokens); anything else is refused where the record is made."""
    from backend.models.numerics import QwenNumerics
    from backend.models.qwen3_5_moe import PADDED_ROWS
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton_usable on the CPU; no kernel runs here
    pytest.importorskip("triton")
    x = torch.zeros(1, 64)
    for experts in ("tuned", "gemv", "gemv_blocks"):
        numerics = replace(invariant_numerics("test"), qwen=QwenNumerics(padded_rows=True, experts=experts))
        tiles = load_fast(tiny_qwen(), max_context=64, numerics=numerics).model.expert_tiles(x)
        if experts == "gemv":
            assert tiles == {"decode": None, "gemv_tokens": PADDED_ROWS}
        elif experts == "gemv_blocks":
            assert tiles == {"decode": None, "gemv_tokens": PADDED_ROWS, "gemv_sorted_from": 2}
        else:
            assert tiles["decode"] is False and tiles["direct"] and "gemv_tokens" not in tiles
    with pytest.raises(ValueError, match="experts must be one of tuned, gemv, gemv_blocks"):
        QwenNumerics(experts="one_token")


@cuda
@pytest.mark.parametrize("glue_kernels, experts, sum_in_down", [
    (False, "tuned", False), (True, "tuned", False), (False, "tuned", True), (False, "gemv", False),
    (True, "gemv", False), (False, "gemv_blocks", False), (True, "gemv_blocks", False)],
    ids=["compiled-glue", "glue-kernels", "sum-in-down", "experts-gemv", "glue-kernels-gemv", "experts-gemv-blocks",
         "glue-kernels-gemv-blocks"])
def test_cuda_qwen_invariant_verify_position_logits_are_batch_invariant(glue_kernels, experts, sum_in_down):
    """A CUDA engine's Qwen3.5-MoE numerics (the invariant record: _padded_rows), with CUDA graphs and the
    compiled glue as the engine runs them (or the glue in our kernels: QwenNumerics.glue_kernels; or the experts'
    slots summed inside their down kernel, as a tuned entry's sum_in_down asks; or every token's experts through the
    one-token kernels, gemv_tokens, or their block kernels, gemv_blocks): a position's logits are bitwise the same from a plain decode step and from inside
    a verify block of every size 2..16, from a restored prompt checkpoint and after an accept cut a block short (the
    conv window and recurrent states handed over)."""
    seeded()
    numerics = invariant_numerics("test", compile=True)
    numerics = replace(numerics, qwen=replace(numerics.qwen, glue_kernels=glue_kernels, experts=experts))
    fm = load_fast(tiny_qwen().to("cuda", torch.bfloat16), 600, compile=True, numerics=numerics)
    if sum_in_down:  # as a tuned entry asks (none does yet); before the first forward, which the graphs capture
        tiles = fm.model.expert_tiles
        fm.model.expert_tiles = lambda x: dict(tiles(x), sum_in_down=True)
    assert fm.model.numerics.qwen.padded_rows and fm.model.batch_invariant
    prompt = torch.randint(0, 320, (CHUNKED_FROM,)).tolist()  # the chunked prefill, as real prompts take
    logits, _ = fm.prefill(prompt)
    snap = fm.snapshot()
    tokens, steps = [], []
    for _ in range(16):
        tokens.append(int(logits.argmax()))
        logits, _ = fm.decode(tokens[-1])
        steps.append(logits)
    for size in range(2, 17):
        fm.restore(snap)
        block, _ = fm.verify(tokens[:size])
        fm.accept(size)
        for j in range(size):
            assert torch.equal(block[j], steps[j]), (size, j)
    fm.restore(snap)
    fm.verify(tokens[:9])
    fm.accept(4)  # keep 4 of 9, then decode on
    for j in range(4, 16):
        logits, _ = fm.decode(tokens[j])
        assert torch.equal(logits, steps[j]), j