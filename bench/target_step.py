"""Target-model step costs on the fast path (backend/models) against stock transformers, in one run.

Per model shape: the plain decode step L_target, the block verify T_t(k) for k = 1..16, the rollback (accept) copy, and
the bandwidth floor of each (the bytes the step must move: weights it reads, the distinct experts it wakes, KV and
Gated DeltaNet states; over the device-to-device copy bandwidth measured in the same run, bytes read + written).
Stock transformers (DynamicCache, its default kernels) is timed on the same weights. Our logits are compared with
transformers' on the same input. With --routing-trace the MoE verify is timed again with routing replayed from a
synthetic trace that wakes ~48 distinct experts per 16 tokens (a real router's locality; random weights wake ~100).

    python bench/target_step.py --device cuda --shape qwen3.6-35b-a3b --shape smollm2-135m --routing-trace
    python bench/target_step.py --device cpu --shape embedded --threads 1 --generate 64   # real SmolLM2, tok/s

Shapes: qwen3.6-35b-a3b (transformers' Qwen3_5MoeTextConfig defaults: 40 layers, 256 experts, top-8 + shared),
smollm2-135m (SmolLM2-135M's Llama shape), qwen3.5-moe-small (a reduced MoE shape that runs on a CPU), all with random
weights; embedded (the real SmolLM2-135M-Instruct through backend/loading.py). One JSON per shape goes to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench.report import cpu_model  # noqa: E402
from backend.bench.routing import install_routing_trace  # noqa: E402
from backend.models import load_fast  # noqa: E402
from backend.models.numerics import LlamaNumerics, Numerics, QwenNumerics  # noqa: E402
from backend.models.qwen3_5_moe import SparseMoE  # noqa: E402
from reviewer_kernels.gemv import GEMV_TILES  # noqa: E402
from reviewer_kernels.norm_gemv import LARGE_TILES, NORM_GEMV_TILES  # noqa: E402

TAU_SEED = 4.9  # tokens committed per cycle with z-lab's drafter (the seed)
DRAFT_OVER_VERIFY_SEED = 0.12  # T_d / T_t measured in the seed


# ---- models ----------------------------------------------------------------------------------------------------------

def build(shape: str, device: str, dtype):
    """(transformers model, tokenizer or None, label)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape == "embedded":
        from backend.loading import load_model
        loaded = load_model("embedded", device=device, dtype="float32" if dtype == torch.float32 else "bfloat16")
        return loaded.model, loaded.tokenizer, f"SmolLM2-135M-Instruct (embedded GGUF, {_dt(dtype)})"
    torch.manual_seed(0)
    if shape == "smollm2-135m":
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                             tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
        cls, label = LlamaForCausalLM, "SmolLM2-135M shape"
    else:
        try:
            from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        except ImportError:  # transformers too old for Qwen3.5: our model alone, no stock figures
            return None, None, f"{shape} (our model only: this transformers has no Qwen3.5-MoE), random {_dt(dtype)}"
        if shape == "qwen3.6-35b-a3b":
            config, label = Qwen3_5MoeTextConfig(), "Qwen3.6-35B-A3B shape"
        elif shape == "qwen3.5-moe-small":
            config = Qwen3_5MoeTextConfig(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                                          num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                                          linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                                          moe_intermediate_size=128, shared_expert_intermediate_size=128,
                                          num_experts=64, num_experts_per_tok=8)
            label = "Qwen3.5-MoE reduced shape (8 layers, hidden 512, 64 experts)"
        else:
            raise SystemExit(f"unknown shape {shape}")
        cls = Qwen3_5MoeForCausalLM
    return _instantiate(cls, config, device, dtype), None, f"{label}, random {_dt(dtype)}"


def _instantiate(cls, config, device, dtype):
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def random_qwen_without_transformers(shape: str, device, dtype, layers: int = 40):
    """Our Qwen35Moe with random weights from the shape's numbers alone (transformers' Qwen3_5MoeTextConfig defaults
    for the 35B-A3B shape), for machines whose transformers predates Qwen3.5. `layers` below 40 keeps the first ones
    (the same three-linear-one-full pattern): per-layer figures unchanged, and the weights fit an 80 GB card."""
    from backend.models.qwen3_5_moe import Qwen35MoeConfig
    if shape != "qwen3.6-35b-a3b":
        raise SystemExit(f"{shape}: this transformers has no Qwen3.5-MoE")
    return random_qwen(Qwen35MoeConfig(vocab_size=248320, hidden_size=2048,
                             layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                          for i in range(layers)],
                             num_heads=16, num_kv_heads=2, head_dim=256, linear_num_key_heads=16,
                             linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                             conv_kernel=4, num_experts=256, top_k=8, moe_intermediate_size=512,
                             shared_intermediate_size=512, rms_norm_eps=1e-6, tie_embeddings=False),
        rope_theta=10_000.0, partial_rotary=0.25, device=device, dtype=dtype)


def random_qwen(config, rope_theta, partial_rotary, device, dtype):
    """Our Qwen35Moe with transformers-like random init (std 0.02, zero-centred norms, A in U(0.01, 16))."""
    from backend.models import FastModel
    from backend.models.qwen3_5_moe import Qwen35Moe
    rotary = int(config.head_dim * partial_rotary)
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, rotary, 2, dtype=torch.float) / rotary))
    with torch.device(device):
        model = Qwen35Moe(config, inv_freq.to(device))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm1", "norm2", "norm", "q_norm", "k_norm")):
                p.fill_(1.0)  # (1 + weight) with transformers' zero init
            elif name.endswith("neg_A"):
                p.copy_(-torch.empty_like(p, dtype=torch.float).uniform_(0.01, 16))
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    model.to(dtype)
    for layer in model.layers:  # these stay fp32, as from_hf makes them
        layer.norm1.data, layer.norm2.data = layer.norm1.float(), layer.norm2.float()
        mixer = layer.mixer
        if hasattr(mixer, "neg_A"):
            mixer.neg_A.data = mixer.neg_A.float()
        else:
            mixer.q_norm.data, mixer.k_norm.data = mixer.q_norm.float(), mixer.k_norm.float()
    model.norm.data = model.norm.float()
    return model, FastModel


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def cpu_name() -> str:
    return cpu_model() or platform.processor() or "cpu"


def _dt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- timing ----------------------------------------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, reps: int, device, warmup: int = 2, between=None) -> float:
    """Median wall time of fn() in ms (synchronised); `between()` runs untimed after each call."""
    times = []
    for i in range(warmup + reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
        if between is not None:
            between()
    return statistics.median(times)


def interleaved_ms(calls: dict, reps: int, device, warmup: int = 2) -> dict[str, float]:
    """Median ms of each of several calls, timed in alternation (a, b, a, b, ...) so that load changes on a shared
    machine hit all of them alike. calls: name -> (fn, between or None)."""
    times = {name: [] for name in calls}
    for i in range(warmup + reps):
        for name, (fn, between) in calls.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            if i >= warmup:
                times[name].append((time.perf_counter() - t) * 1e3)
            if between is not None:
                between()
    return {name: statistics.median(ts) for name, ts in times.items()}


def copy_bandwidth(device) -> float:
    """Bytes per second of a large device copy, counting bytes read + written."""
    n = (1 << 30) if device.type == "cuda" else (1 << 27)
    x = torch.randn(n // 4, device=device)
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x), 10, device)
    return 2 * n / (ms / 1e3)


# ---- bytes a step must move ------------------------------------------------------------------------------------------

def step_bytes(fast, tokens: int, context: int, distinct_experts: list[int] | None) -> dict:
    """What one forward over `tokens` new tokens after `context` cached ones must read/write at least."""
    m, es = fast.model, fast.model.embed.element_size()
    total_params = sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())
    expert_params = 0
    per_expert = 0
    if fast.model.family == "qwen3_5_moe":
        moe0 = m.layers[0].moe
        per_expert = moe0.gate_up[0].numel() + moe0.down[0].numel()
        expert_params = sum(layer.moe.gate_up.numel() + layer.moe.down.numel() for layer in m.layers)
    embed_rows = 0 if m.lm_head is m.embed else m.embed.numel()  # an untied embedding is read a row per token
    dense = (total_params - expert_params - embed_rows) * es + tokens * m.embed.shape[1] * es
    experts = sum(distinct_experts) * per_expert * es if distinct_experts else 0
    kv = m.kv.nbytes_per_token() * (context + tokens)  # read the cached K/V, write the new
    linear = 2 * m.linear.nbytes_state() if m.linear is not None else 0  # read once, write once
    return {"weights_dense": dense, "experts": experts, "kv": kv, "linear_state": linear,
            "total": dense + experts + kv + linear}


# ---- routing ---------------------------------------------------------------------------------------------------------

def record_distinct_experts(fast, fn) -> list[int]:
    """Distinct experts each MoE layer wakes during fn() (run eagerly, through the model's own routing)."""
    seen, originals = [], []
    for moe in (mod for mod in fast.model.modules() if isinstance(mod, SparseMoE)):
        original = moe.route

        def traced(h, _original=original, **kw):
            weights, ids = _original(h, **kw)
            seen.append(int(ids.unique().numel()))
            return weights, ids
        originals.append((moe, original))
        moe.route = traced
    try:
        fn()
    finally:
        for moe, original in originals:
            if getattr(original, "__self__", None) is moe:
                del moe.route  # it was the class's method
            else:
                moe.route = original  # an override installed before (a routing trace)
    return seen


# ---- measurements ----------------------------------------------------------------------------------------------------

def stock_calls(hf, prompt, block):
    """transformers' decode step and 16-token verify on a DynamicCache after `prompt`, each as (call, undo). Attention
    caches are cropped back after each call; hybrid ones cannot be, so there the context grows as they run (as in
    shared/probes/h200_baseline.py: a few hundred tokens over the measurement)."""
    from transformers import DynamicCache
    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        hf(prompt[None], past_key_values=cache, use_cache=True)
    tok = prompt[-1:][None]

    hybrid = "linear_attention" in (getattr(hf.config.get_text_config(), "layer_types", None) or ())

    def step(ids):
        with torch.inference_mode():
            hf(ids, past_key_values=cache, use_cache=True)
    undo = (lambda n: None) if hybrid else (lambda n: cache.crop(-n))
    return (lambda: step(tok), lambda: undo(1)), (lambda: step(block[None]), lambda: undo(block.numel()))


def compare_logits(hf, fast, prompt, block) -> dict:
    """Our logits against transformers' on the same prompt + block (fresh caches on both sides), relative L2 error of
    the prompt's last logits and of the block's, and how often the argmax agrees."""
    from transformers import DynamicCache
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        ref_last = hf(prompt[None], past_key_values=cache, use_cache=True).logits[0, -1].float()
        ref_block = hf(block[None], past_key_values=cache, use_cache=True).logits[0].float()
    fast.reset()
    last, _ = fast.prefill(prompt)
    got_block, _ = fast.verify(block)
    fast.accept(block.numel())
    return {"prefill_last_rel_err": _rel(last, ref_last), "verify16_rel_err": _rel(got_block, ref_block),
            "verify16_argmax_agree": float((got_block.float().argmax(-1) == ref_block.argmax(-1)).float().mean())}


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def moe_equivalence(hf, prompt, block, numerics: Numerics, layers: int = 4) -> dict:
    """At a random-weight MoE shape, bf16 rounding flips near-tied top-k router choices (transformers' own bf16 run
    differs from its fp32 run by ~0.15 relative after 4 layers at full width), so a bf16 comparison over 40 layers
    cannot show equivalence. Two checks that can: (1) fp32, full width, the first `layers` layers: ours against
    transformers; (2) the noise floor in bf16: transformers with its experts run two ways (grouped_mm, batched_mm)
    against each other, beside ours against transformers."""
    import copy
    from transformers import Qwen3_5MoeForCausalLM
    config = copy.deepcopy(hf.config)
    config.num_hidden_layers, config.layer_types = layers, config.layer_types[:layers]
    torch.manual_seed(0)
    with torch.device(hf.device):
        shallow = Qwen3_5MoeForCausalLM(config).float().eval()
    fast = load_fast(shallow, max_context=prompt.numel() + 32, cuda_graphs=False, numerics=numerics)
    out = {f"fp32_{layers}_layers": compare_logits(shallow, fast, prompt, block)}
    del fast, shallow
    try:
        hf.set_experts_implementation("batched_mm")
        with torch.inference_mode():
            other = hf(prompt[None]).logits[0, -1]
        hf.set_experts_implementation("grouped_mm")
        with torch.inference_mode():
            base = hf(prompt[None]).logits[0, -1]
        out["bf16_transformers_batched_mm_vs_grouped_mm_rel_err"] = _rel(other, base)
    except Exception as exc:  # older transformers: no switch
        out["bf16_noise_floor"] = f"unavailable: {type(exc).__name__}: {exc}"
    return out


def measure_fast(fast, prompt, block, reps, device, stock=None) -> dict:
    """Our decode step, T_t(k) for k = 1..max_block and the rollback copy, at a fixed context of len(prompt) (each
    call is undone from a snapshot, untimed). With `stock` (transformers' step and verify callables) the decode step
    and the full verify are timed in alternation with transformers'."""
    fast.reset()
    fast.prefill(prompt)
    start = fast.snapshot()
    token = int(prompt[-1])
    res = {"context": int(prompt.numel())}
    n = fast.max_block

    def undo_verify():
        fast.accept(n)
        fast.restore(start)
    calls = {"L_target_ms": (lambda: fast.decode(token), lambda: fast.restore(start)),
             "T_verify16_ms": (lambda: fast.verify(block[:n]), undo_verify)}
    if stock is not None:
        calls |= {"stock_L_target_ms": stock[0], "stock_T_verify16_ms": stock[1]}
    res |= interleaved_ms(calls, reps, device)
    curve = {}
    for k in range(1, fast.max_block + 1):
        def after(k=k):
            fast.accept(k)
            fast.restore(start)
        curve[k] = median_ms(lambda k=k: fast.verify(block[:k]), reps, device, between=after)
    res["T_t_ms"] = curve
    rollback = []
    for _ in range(5):
        fast.verify(block)
        sync(device)
        t = time.perf_counter()
        fast.accept(1)
        sync(device)
        rollback.append((time.perf_counter() - t) * 1e3)
        fast.restore(start)
    res["rollback_ms"] = statistics.median(rollback)
    return res


def kernel_profile(fast, prompt, block, reps: int = 10, top: int = 30) -> dict:
    """Where a step's GPU time goes (CPU: op time): the kernels of `reps` decode steps and of `reps` 16-token verify +
    accept cycles (CUDA-graph replays when graphs are on), per kernel name: microseconds and launches per step, plus
    the host time of one call (Python + launch, no sync) against its GPU kernel time."""
    from torch.profiler import ProfilerActivity, profile

    fast.reset()
    fast.prefill(prompt)
    token = int(prompt[-1])

    def verify_cycle():
        fast.verify(block)
        fast.accept(block.numel())
    out = {}
    for name, call in [("decode", lambda: fast.decode(token)), ("verify16_accept", verify_cycle)]:
        call()  # capture / compile outside the profile
        sync(fast.device)
        host = []
        for _ in range(3):
            t = time.perf_counter()
            call()
            host.append((time.perf_counter() - t) * 1e6)
            sync(fast.device)
        cuda = fast.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(reps):
                call()
            sync(fast.device)
        kernels = []
        for e in prof.key_averages():
            # CUDA: kernel time; CPU: each op's own time (ops, not kernels: the same table, coarser)
            us = (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) if cuda \
                else e.self_cpu_time_total
            if us > 0:
                kernels.append({"kernel": e.key[:120], "us_per_step": us / reps, "launches_per_step": e.count / reps})
        kernels.sort(key=lambda k: -k["us_per_step"])
        out[name] = {"gpu_us_per_step": sum(k["us_per_step"] for k in kernels),
                     "launches_per_step": sum(k["launches_per_step"] for k in kernels),
                     "host_us_per_call": statistics.median(host), "top_kernels": kernels[:top]}
        print(f"  {name}: {out[name]['gpu_us_per_step']:.0f} us of kernels, {out[name]['launches_per_step']:.0f} "
              f"launches per step, host {out[name]['host_us_per_call']:.0f} us per call", flush=True)
        for k in kernels[:top]:
            print(f"    {k['us_per_step']:8.1f} us {k['launches_per_step']:6.1f}x  {k['kernel']}", flush=True)
    # at a fixed context (each call undone), after one call outside the profile (a graph for this span, if new)
    start = fast.snapshot()
    fast.decode(token)
    fast.restore(start)
    out["decode"]["host_functions"] = host_profile(lambda: fast.decode(token), fast.device,
                                                   undo=lambda: fast.restore(start))
    fast.reset()
    return out


def host_profile(call, device, undo, calls: int = 20, top: int = 12) -> list[dict]:
    """Where the host time of a call goes: cProfile over `calls` calls (each followed by a device sync and undo(),
    outside the profile), the functions with the most own time, in microseconds per call."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    for _ in range(calls):
        prof.enable()
        call()
        prof.disable()
        sync(device)
        undo()
    stats = pstats.Stats(prof).stats
    rows = [{"function": f"{fn[0].rsplit('/', 2)[-1]}:{fn[1]}:{fn[2]}", "own_us_per_call": tt / calls * 1e6,
             "cumulative_us_per_call": ct / calls * 1e6, "calls_per_call": nc / calls}
            for fn, (cc, nc, tt, ct, _) in stats.items()]
    return sorted(rows, key=lambda r: -r["own_us_per_call"])[:top]


def eager_verify_distinct(fast, prompt, block) -> list[int]:
    """Distinct experts per MoE layer in one 16-token verify after `prompt`, run eagerly so routing is observable."""
    fast.reset()
    fast.prefill(prompt)
    graphs, fast.cuda_graphs = fast.cuda_graphs, False
    try:
        distinct = record_distinct_experts(fast, lambda: fast.verify(block))
    finally:
        fast.cuda_graphs = graphs
    fast.accept(1)
    return distinct


def generation(hf, tok, fast, max_new: int) -> dict:
    """Greedy chat completions, transformers generate() against our prefill + decode loop: tok/s and identity."""
    questions = ["Write a Python function that checks whether a string is a palindrome.",
                 "Explain what a race condition is, with a short example.",
                 "How do I read a CSV file with pandas and print the first rows?",
                 "Write a bash one-liner that counts lines in all .py files."]
    stock_s = ours_s = 0.0
    identical = True
    for q in questions:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(hf.device)
        t = time.perf_counter()
        with torch.inference_mode():
            ref = hf.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)[0, ids.shape[1]:]
        stock_s += time.perf_counter() - t
        t = time.perf_counter()
        fast.reset()
        logits, _ = fast.prefill(ids[0])
        out = [int(logits.argmax())]
        while len(out) < max_new:
            out.append(int(fast.decode(out[-1])[0].argmax()))
        ours_s += time.perf_counter() - t
        identical &= out == ref.tolist()
    n = len(questions) * max_new
    return {"prompts": len(questions), "new_tokens_each": max_new, "stock_tok_s": n / stock_s,
            "ours_tok_s": n / ours_s, "speedup": stock_s / ours_s, "greedy_identical": identical}


def run_shape(args, shape: str, device, dtype, bandwidth: float) -> dict:
    hf, tok, label = build(shape, str(device), dtype)
    graphs = device.type == "cuda" and not args.no_graphs
    if hf is None:
        model, fast_cls = random_qwen_without_transformers(shape, device, dtype)
        fast = fast_cls(model, args.max_context, cuda_graphs=graphs, compile=args.compile, numerics=args.numerics)
    else:
        fast = load_fast(hf, max_context=args.max_context, cuda_graphs=graphs, compile=args.compile,
                         numerics=args.numerics)
    g = torch.Generator().manual_seed(1)
    vocab = fast.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt,), generator=g).to(device)
    block = torch.randint(0, vocab, (16,), generator=g).to(device)
    record = {"benchmark": "target_step", "model": label, "shape": shape}
    if hf is not None:
        record["equivalence"] = compare_logits(hf, fast, prompt, block)
        if fast.model.family == "qwen3_5_moe":
            record["equivalence"] |= moe_equivalence(hf, prompt, block, args.numerics)
        print(f"[{shape}] logits vs transformers: {record['equivalence']}", flush=True)
    stock = None if args.no_stock or hf is None else stock_calls(hf, prompt, block)
    ours = measure_fast(fast, prompt, block, args.reps, device, stock)
    if stock is not None:
        record["stock"] = {"L_target_ms": ours["stock_L_target_ms"], "T_verify16_ms": ours["stock_T_verify16_ms"],
                           "experts_implementation": getattr(hf.config, "_experts_implementation", None),
                           "flash_linear_attention": _has("fla")}
        print(f"[{shape}] stock: {record['stock']}", flush=True)
    record.update(L_target_ms=ours["L_target_ms"], T_verify16_ms=ours["T_verify16_ms"], T_t_ms=ours["T_t_ms"],
                  rollback_ms=ours["rollback_ms"], context=ours["context"])
    if args.profile:
        print(f"[{shape}] kernel profile:", flush=True)
        record["profile"] = kernel_profile(fast, prompt, block)
    moe = fast.model.family == "qwen3_5_moe"
    distinct = None
    if moe:
        distinct = eager_verify_distinct(fast, prompt, block)
        record["distinct_experts_16"] = statistics.mean(distinct)
    decode_bytes = step_bytes(fast, 1, args.prompt, [fast.config.top_k] * len(distinct) if moe else None)
    verify_bytes = step_bytes(fast, 16, args.prompt, distinct)
    record["L_target_floor_ms"] = decode_bytes["total"] / bandwidth * 1e3
    record["T_verify16_floor_ms"] = verify_bytes["total"] / bandwidth * 1e3
    record["bytes"] = {"decode": decode_bytes, "verify16": verify_bytes}
    if moe and args.routing_trace:
        install_routing_trace(fast, hot=args.hot_experts)
        traced = eager_verify_distinct(fast, prompt, block)
        trace_run = measure_fast(fast, prompt, block, args.reps, device)
        trace_bytes = step_bytes(fast, 16, args.prompt, traced)
        record["routing_trace"] = {
            "what": f"synthetic (backend/bench/routing.py): per layer, each position takes top-k among a hot set "
                    f"of {args.hot_experts} experts",
            "distinct_experts_16": statistics.mean(traced), "T_verify16_ms": trace_run["T_verify16_ms"],
            "T_t_ms": trace_run["T_t_ms"], "T_verify16_floor_ms": trace_bytes["total"] / bandwidth * 1e3}
        if args.profile:  # where the traced verify's time goes (issue 26 asks for this profile)
            print(f"[{shape}] kernel profile under the routing trace:", flush=True)
            record["routing_trace"]["profile"] = kernel_profile(fast, prompt, block)
    for name, verify_ms in [("ours", record["T_verify16_ms"])] + (
            [("stock", record["stock"]["T_verify16_ms"])] if "stock" in record else []):
        step_ms = record["L_target_ms"] if name == "ours" else record["stock"]["L_target_ms"]
        record.setdefault("eta_at_tau_4.9", {})[name] = {
            "draft_free": TAU_SEED * step_ms / verify_ms,
            "draft_0.12_of_verify": TAU_SEED * step_ms / (verify_ms * (1 + DRAFT_OVER_VERIFY_SEED))}
    if shape == "embedded" and args.generate:
        record["generation"] = generation(hf, tok, fast, args.generate)
        print(f"[{shape}] generation: {record['generation']}", flush=True)
    record["cuda_graphs"], record["compile"] = fast.cuda_graphs, fast.compile or "none"
    return record


def numerics_from_flags(args) -> Numerics:
    """The fast models' record from --invariant, --wide, --mma and --llama-steps (backend/models/numerics.py; each
    left out keeps the record's default)."""
    llama, qwen = LlamaNumerics(), QwenNumerics()
    if args.llama_steps:
        llama = replace(llama, step_path=args.llama_steps)
    if args.mma:
        llama = replace(llama, mma_projections=frozenset() if args.mma == "none" else frozenset(args.mma.split(",")))
    if args.invariant:
        qwen = replace(qwen, padded_rows=True)
    if args.wide is not None:
        qwen = replace(qwen, wide_projections=frozenset(args.wide.split(",")) - {"none"})
    return Numerics("invariant" if args.invariant else "one_token", "bench/target_step.py: its flags", llama, qwen,
                    invariant_steps=args.invariant, compile=args.compile)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", action="append", help="model shape (repeatable); default: all that fit the device")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) or float32 (default on CPU)")
    ap.add_argument("--prompt", type=int, default=512, help="context length before the measured steps")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--routing-trace", action="store_true", help="also time the MoE verify with ~48-expert routing")
    ap.add_argument("--hot-experts", type=int, default=50,
                    help="hot-set size of the synthetic trace (50: ~47 distinct)")
    ap.add_argument("--generate", type=int, default=0, help="embedded: greedy tok/s over 4 prompts of N new tokens")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--no-stock", action="store_true", help="skip stock transformers")
    ap.add_argument("--no-graphs", action="store_true", help="CUDA: run eagerly, without CUDA graphs")
    ap.add_argument("--compile", nargs="?", const="glue", default=False, choices=["glue", "full"],
                    help="torch.compile decode and verify: the per-layer glue (default when given) or the whole forward")
    ap.add_argument("--profile", action="store_true", help="also list the kernels of a decode step and of a verify "
                    "(torch.profiler over CUDA-graph replays): time and launches per step")
    ap.add_argument("--invariant", action="store_true",
                    help="Qwen3.5-MoE: decode steps through the verify's kernels (QwenNumerics.padded_rows)")
    ap.add_argument("--wide", default=None, metavar="SET",
                    help="with --invariant: which padded projections take reviewer_kernels/wide_linear.py, not cuBLAS "
                         "(QwenNumerics.wide_projections): 'in', 'out', 'in,out' or 'none'")
    ap.add_argument("--mma", default=None, metavar="SET",
                    help="Llama: the projections that take reviewer_kernels/rows_linear.py, comma-separated from qkv, "
                    "o, gate_up, down, lm_head ('none' for none; default: LlamaNumerics.mma_projections, none)")
    ap.add_argument("--llama-steps", choices=["rows", "glue"], default=None,
                    help="Llama: decode steps and verifies through our row kernels or the compiled glue + cuBLAS "
                    "(LlamaNumerics.step_path)")
    ap.add_argument("--route-in-matmul", action="store_true",
                    help="Qwen3.5-MoE: route inside the router matmul's launch "
                    "(reviewer_kernels.moe_routing.ROUTE_IN_MATMUL)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    if args.route_in_matmul:
        import reviewer_kernels.moe_routing

        reviewer_kernels.moe_routing.ROUTE_IN_MATMUL = True
    args.numerics = numerics_from_flags(args)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, None: None}[args.dtype] or (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    shapes = args.shape or (["smollm2-135m", "qwen3.6-35b-a3b"] if device.type == "cuda"
                            else ["embedded", "qwen3.5-moe-small"])
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s", flush=True)
    machine = torch.cuda.get_device_name() if device.type == "cuda" else \
        f"{cpu_name()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        load_before = os.getloadavg()[0]
        record = run_shape(args, shape, device, dtype, bandwidth)
        record.update(load_average_1min={"start": load_before, "end": os.getloadavg()[0]},
                      device=machine, date=datetime.datetime.now().isoformat(timespec="seconds"),
                      command="python " + " ".join(sys.argv), copy_bandwidth_GBps=bandwidth / 1e9,
                      torch=torch.__version__, transformers=__import__("transformers").__version__,
                      mma_projections=sorted(args.numerics.llama.mma_projections),
                      llama_step_path=args.numerics.llama.step_path,
                      qwen_invariant_steps=args.numerics.qwen.padded_rows,
                      qwen_wide_projections=sorted(args.numerics.qwen.wide_projections),
                      route_in_matmul=args.route_in_matmul,
                      row_kernel_tiles={"gemv": GEMV_TILES, "norm_gemv": NORM_GEMV_TILES, "lm_head": LARGE_TILES})
        tag = (f"_compile-{args.compile}" if args.compile else "") + (
            f"_mma-{args.mma.replace(',', '_')}" if args.mma else "") + ("_invariant" if args.invariant else "") + (
            f"_wide-{args.wide.replace(',', '_')}" if args.wide is not None else "") + (
            f"_steps-{args.llama_steps}" if args.llama_steps else "") + ("_route-in-matmul" if args.route_in_matmul
                                                                         else "")
        name = f"target_step_{shape}_{device.type}{tag}_{datetime.datetime.now():%Y%m%d_%H%M%S}.json"
        (Path(args.out) / name).write_text(json.dumps(record, indent=1))
        stock = record.get("stock", {})
        print(f"[{shape}] L_target {record['L_target_ms']:.2f} ms (floor {record['L_target_floor_ms']:.2f}, stock "
              f"{stock.get('L_target_ms', float('nan')):.2f}) | T_t(16) {record['T_verify16_ms']:.2f} ms (floor "
              f"{record['T_verify16_floor_ms']:.2f}, stock {stock.get('T_verify16_ms', float('nan')):.2f}) -> {name}",
              flush=True)
        del record
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
