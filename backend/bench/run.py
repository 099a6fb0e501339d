"""`reviewer bench`: plain vs speculative decoding on one target, side by side in one run.

Prints the seed's table (tau, per-position acceptance, T_d, T_t, L_target, eta predicted vs measured, tok/s with and
without the drafter, transformers' own generate for reference, identical-output checks, and for MoE targets the
distinct experts a verify block wakes per layer) as text, and writes it as JSON with the command, date and machine.

    python -m backend.bench --model tiny-hybrid --drafter random --device cpu --prompts 4 --max-tokens 64
    main(model="embedded", drafter="auto", device="cpu", prompts=4, max_tokens=128, json_out=Path(...))
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from backend.bench.report import compare, format_table, machine_info, numerics, summary
from backend.bench.routing import ExpertCounter, route_engine_by_trace, trace_distinct_experts
from backend.bench.shapes import RELEASED_DRAFTER, SHAPE_MODELS, released_shape_drafter, shape_model
from backend.chat import stop_token_ids
from backend.decoding.device_cycle import ForcedAcceptance
from backend.loading import load_model
from backend.decoding.engine import Engine, SamplingParams
from backend.dflash.checkpoint import find_shipped_drafter, load_drafter, random_drafter
from backend.models.llama import Llama
from backend.models.numerics import LLAMA_INVARIANT_PATH, LLAMA_INVARIANT_PATHS

TINY_MODELS = ("tiny-hybrid", "tiny-moe", "tiny-llama")  # tiny-moe: another name for tiny-hybrid
PROMPTS = [  # coding-assistant prompts like the ones the personas send (first four: shared/probes/prompts.json)
    "Write a Python function that reverses the words in a sentence.",
    "Explain what a virtual environment is in Python and why it is useful.",
    "Review this code for bugs:\n\ndef first(xs):\n    return xs[1]\n",
    "How do I run only one test with pytest?",
    "Write a shell command that counts the lines of every .py file in a folder.",
    "What does `git rebase -i` do? Give a short example.",
    "Write a unit test for a function add(a, b) that returns a + b.",
    "Explain the difference between a list and a tuple in Python.",
    # 9-16: so that 16 prompts are 16 different ones
    "My script raises `KeyError: 'HOME'` when run from cron. Why, and how do I fix it?",
    "Write a Python generator that yields the running maximum of a list of numbers.",
    "What is the difference between `pip install -e .` and `pip install .`?",
    "Review this function:\n\ndef mean(xs):\n    return sum(xs) / len(xs)\n",
    "How can I time a Python function more reliably than with time.time()?",
    "Write a pytest test that checks a function raises ValueError on negative input.",
    "Explain what a race condition is, with a short example in Python threads.",
    "How do I read a large CSV file in chunks with pandas?",
]


class BenchError(Exception):
    """A user mistake (unknown model, missing drafter): reported as one line, no traceback."""


# ---- targets ------------------------------------------------------------------------------------------------------


def tiny_model(kind: str, *, vocab: int = 128, hidden: int = 64, layers: int = 4, experts: int = 16, seed: int = 0):
    """Tiny random targets built from transformers' own classes (tests and CPU benchmarks of the machinery).
    tiny-hybrid: Qwen3.5/3.6-MoE layout, Gated DeltaNet layers + one gated full-attention layer every 4, `experts`
    routed experts (top-2) + a shared expert. tiny-llama: a dense Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    if kind in ("tiny-hybrid", "tiny-moe"):
        config = Qwen3_5MoeTextConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
            shared_expert_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=hidden // 4, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=hidden // 4, linear_value_head_dim=hidden // 4, linear_conv_kernel_dim=4,
            num_experts=experts, num_experts_per_tok=2,
            layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
            initializer_range=0.1, max_position_embeddings=4096,
        )
        return Qwen3_5MoeForCausalLM(config).eval()
    if kind == "tiny-llama":
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             initializer_range=0.1, max_position_embeddings=4096)
        return LlamaForCausalLM(config).eval()
    raise ValueError(f"unknown tiny model {kind!r}; choose from {TINY_MODELS}")


def load_target(spec: str, device: str, max_context: int | None = None):
    """(model, tokenizer or None, name, max_context) for a tiny config, `embedded`, a HF folder or a .gguf file.
    max_context: the window (default 4,096 for the random targets, the model's own otherwise)."""
    if spec in TINY_MODELS:
        model = tiny_model(spec).to(device)
        return model, None, spec, max_context or 4096
    if spec in SHAPE_MODELS:
        if torch.device(device).type != "cuda":
            raise BenchError(f"{spec} is a GPU shape (tens of GB of random weights): use --device cuda")
        return shape_model(spec, device), None, spec, max_context or 4096
    loaded = load_model(spec, device=device, max_context=max_context)
    return loaded.model, loaded.tokenizer, loaded.name, loaded.max_context


def make_prompts(tokenizer, n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    if tokenizer is None:  # random targets: random prompts
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab, (64,), generator=gen).tolist() for _ in range(n)]
    out = []
    for i in range(n):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    return out


def make_drafter(spec: str, model, name: str, block_size: int | None):
    if spec == "none":
        return None, "none"
    if spec == "random":
        return random_drafter(model, block_size=block_size or 8), "random (untrained, 1 layer)"
    if spec == RELEASED_DRAFTER:
        return released_shape_drafter(model), "random, the released Qwen3.6-35B-A3B drafter's shape (6 layers)"
    path = find_shipped_drafter(name) if spec == "auto" else Path(spec)
    if path is None:  # like `reviewer serve --drafter auto`: plain decoding only
        print(f"reviewer bench: no drafter is shipped for {name}; measuring plain decoding only "
              "(--drafter random measures the machinery with an untrained drafter)", file=sys.stderr)
        return None, "none (auto: none shipped for this model)"
    drafter = load_drafter(path)
    if block_size:
        drafter.block_size = block_size
    return drafter, str(path)


# ---- measurement --------------------------------------------------------------------------------------------------


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_hf_generate(model, prompts, max_tokens, stops, device):
    outs, tokens, t0 = [], 0, time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            x = torch.tensor([p], device=device)
            kw = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=stops[0] if stops else 0)
            kw["eos_token_id"] = list(stops) if stops else None
            if not stops:
                kw["min_new_tokens"] = max_tokens
            # an explicit mask: otherwise generate masks every prompt token equal to pad_token_id
            o = model.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(p):].tolist()
            if o and o[-1] in stops:
                o = o[:-1]  # the engine does not emit the stop token
            outs.append(o)
            tokens += len(o)
    _sync(device)
    wall = time.perf_counter() - t0
    return {"outputs": outs, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def run_engine(engine, prompts, max_tokens, stops, force=None):
    """Each prompt once, greedy. force(i): a device_cycle.ForcedAcceptance for prompt i (benchmarks of random
    weights), or None."""
    outs, stats_list = [], []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        if force is not None:
            engine.forced_acceptance = force(i)
        out = [t for b in engine.generate(p, SamplingParams(max_tokens=max_tokens, stop_token_ids=stops)) for t in b]
        outs.append(out)
        stats_list.append(engine.last_stats)
    wall = time.perf_counter() - t0
    tokens = sum(s.generated_tokens for s in stats_list)
    decode = sum(s.decode_seconds for s in stats_list)
    res = {"outputs": outs, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
           "decode_s": decode, "decode_tok_s": tokens / decode if decode else 0.0,
           "prefill_s": sum(s.prefill_seconds for s in stats_list)}
    cycles = sum(s.cycles for s in stats_list)
    if cycles:
        width = max(len(s.accepted_per_position) for s in stats_list)
        per_pos = [sum(s.accepted_per_position[k] for s in stats_list if k < len(s.accepted_per_position))
                   for k in range(width)]
        sizes: dict[int, int] = {}
        for s in stats_list:
            for n, c in s.verify_sizes.items():
                sizes[n] = sizes.get(n, 0) + c
        accepted = sum(s.accepted_tokens for s in stats_list)
        res.update({
            "cycles": cycles, "draft_tokens": sum(s.draft_tokens for s in stats_list), "accepted_tokens": accepted,
            "tau": (accepted + cycles) / cycles,
            "acceptance_per_position": [c / cycles for c in per_pos],
            "T_d_ms": 1e3 * sum(s.draft_seconds for s in stats_list) / cycles,
            "T_t_ms": 1e3 * sum(s.verify_seconds for s in stats_list) / cycles,
            "rollback_ms": 1e3 * sum(s.rollback_seconds for s in stats_list) / cycles,
            "cycle_ms": 1e3 * decode / cycles,
            # the device cycle's first draft of each generation (before its first cycle, in no cycle's T_d)
            "first_draft_ms_per_generation": 1e3 * sum(s.first_draft_seconds for s in stats_list) / len(stats_list),
            "verify_sizes": dict(sorted(sizes.items())),
            "out_of_draft_vocab": sum(s.out_of_draft_vocab for s in stats_list),
        })
        # what the device spent outside draft, verify and acceptance: the host's share of a cycle. The first draft
        # of each generation is a draft, not host time (charged here, it weighed most where a generation has few
        # cycles: the forced runs, ~4.4x fewer than unforced ones)
        first = 1e3 * sum(s.first_draft_seconds for s in stats_list) / cycles
        res["host_ms_per_cycle"] = res["cycle_ms"] - res["T_d_ms"] - res["T_t_ms"] - res["rollback_ms"] - first
    return res


def score(r: dict, costs: dict, plain: dict, l_target_ms: float, baseline: dict) -> None:
    """A speculative run against plain decoding: identical outputs, predicted and measured eta, and the verify cost
    curve its adaptive length measured at load (empty for a fixed length)."""
    if costs:
        r["verify_cost_ms_at_load"] = {n: round(1e3 * t, 4) for n, t in costs.items()}
    compare(r, plain)
    if r.get("cycles"):
        r["eta_predicted"] = r["tau"] * l_target_ms / (r["T_t_ms"] + r["T_d_ms"])
        r["eta_measured"] = r["decode_tok_s"] / baseline["decode_tok_s"]


def main(model: str = "tiny-hybrid", drafter: str = "random", device: str = "cpu", prompts: int = 4,
         max_tokens: int = 64, json_out: Path | None = None, **options) -> int:
    """`reviewer bench`: run_bench(...), print the table (and write JSON); returns the exit code (0, or 2 after a
    one-line error for a user mistake). options: block_size, adaptive, compare_hf, threads, command."""
    try:
        run_bench(model=model, drafter=drafter, device=device, prompts=prompts, max_tokens=max_tokens,
                  json_out=json_out, **options)
    except BenchError as exc:
        print(f"reviewer bench: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:  # bad drafter folder / checkpoint, bad argument
        print(f"reviewer bench: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if type(exc).__name__ == "ModelLoadError":  # backend.loading's user-facing errors
            print(f"reviewer bench: {exc}", file=sys.stderr)
            return 2
        raise
    return 0


@dataclass
class BenchSetup:
    """What every run of one benchmark shares: the target and drafter, the workload, and the warm-up that precedes
    each timed run. tables: the routing trace's tables of the last engine routed by it (None without a trace)."""

    target: object
    name: str
    max_context: int
    draft_model: object
    drafter_desc: str
    vocab: int
    prompt_ids: list[list[int]]
    stops: tuple[int, ...]
    warm: list[list[int]]
    warm_tokens: int
    device: str
    max_tokens: int
    routing_trace: int = 0
    tables: list | None = None
    llama_invariant: str = LLAMA_INVARIANT_PATH  # Engine(llama_invariant_path=...) for every engine of the run


def check_options(device: str, adaptive: str, forced_tau, compare_hf: bool, routing_trace: int,
                  threads: int | None, llama_invariant: str | None = None) -> tuple[str, tuple[float, ...]]:
    """(device with "auto" resolved, forced_tau parsed), or a BenchError for a user mistake; sets torch's CPU threads.
    Runs before any model is loaded, so a mistake costs nothing."""
    if threads:
        torch.set_num_threads(threads)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda, but torch sees no CUDA device")
    if adaptive not in ("off", "on", "both"):
        raise BenchError("adaptive must be off, on or both")
    if llama_invariant is not None and llama_invariant not in LLAMA_INVARIANT_PATHS:
        raise BenchError(f"--llama-invariant must be glue or mma, got {llama_invariant!r}")
    forced_tau = parse_taus(forced_tau)
    if forced_tau and torch.device(device).type != "cuda":
        raise BenchError("--forced-tau times the GPU's device cycle: use --device cuda")
    if routing_trace and compare_hf:
        raise BenchError("--routing-trace replaces the fast path's routing, which transformers' generate cannot "
                         "follow: add --no-hf")
    return device, forced_tau


def load_setup(model: str, drafter: str, device: str, prompts: int, max_tokens: int, block_size: int | None,
               routing_trace: int) -> BenchSetup:
    """The target, the drafter, the prompts and stops, and the warm-up workload."""
    target, tokenizer, name, max_context = load_target(model, device)
    draft_model, drafter_desc = make_drafter(drafter, target, name, block_size)
    vocab = target.get_input_embeddings().weight.shape[0]
    prompt_ids = make_prompts(tokenizer, prompts, vocab)
    stops = stop_token_ids(tokenizer, getattr(target, "generation_config", None))
    # On a GPU every CUDA graph (target and drafter: per block size and attention span) and compile is made on first
    # use: warm up on the whole workload, so the timed run replays and never captures.
    cuda = torch.device(device).type == "cuda"
    return BenchSetup(target=target, name=name, max_context=max_context,
                      draft_model=draft_model, drafter_desc=drafter_desc, vocab=vocab, prompt_ids=prompt_ids,
                      stops=stops, warm=prompt_ids if cuda else [prompt_ids[0][:8]],
                      warm_tokens=max_tokens if cuda else 4, device=device, max_tokens=max_tokens,
                      routing_trace=routing_trace)


def new_record(setup: BenchSetup, model: str, drafter: str, prompts: int, command: str | None) -> dict:
    """The record's header (command, date, machine, target, numerics, drafter) with no runs yet."""
    target, device = setup.target, setup.device
    return {"benchmark": "spec_e2e", "device": device, "command": command or " ".join(sys.argv),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(device),
            "model": {"spec": model, "name": setup.name, "class": type(target).__name__,
                      "layers": target.config.get_text_config().num_hidden_layers,
                      "params_m": round(sum(p.numel() for p in target.parameters()) / 1e6, 2),
                      "dtype": str(next(target.parameters()).dtype).removeprefix("torch.")},
            "numerics": numerics(device, next(target.parameters()).dtype),
            "drafter": {"spec": drafter, "source": setup.drafter_desc},
            "prompts": prompts, "max_tokens": setup.max_tokens, "runs": {}}


def engine_for(setup: BenchSetup, **kw) -> Engine:
    """An engine over the target, routed by the trace when there is one (its tables kept in setup.tables)."""
    engine = Engine(setup.target, max_context=setup.max_context, llama_invariant_path=setup.llama_invariant, **kw)
    if setup.routing_trace:
        try:
            setup.tables = route_engine_by_trace(engine, setup.routing_trace)
        except ValueError as exc:
            raise BenchError(f"--routing-trace: {exc}") from None
    return engine


def warm_and_time(setup: BenchSetup, engine: Engine) -> dict:
    """run_engine once on the warm-up workload (untimed: graphs and compiles are made there), then the timed run."""
    run_engine(engine, setup.warm, setup.warm_tokens, setup.stops)
    return run_engine(engine, setup.prompt_ids, setup.max_tokens, setup.stops)


def describe_engine(setup: BenchSetup, plain: Engine) -> dict:
    """Which path and numerics the plain reference engine took (and for a Llama, its kernels)."""
    numerics = plain.numerics
    info = {"path": "fast" if plain.fast else "transformers", "exact": numerics.exact,
            "invariant_verify": plain.invariant_verify, "numerics": numerics.kind, "numerics_why": numerics.why}
    fast_model = plain.target.fast.model if plain.fast else None
    if isinstance(fast_model, Llama):
        info.update(llama_invariant_path=setup.llama_invariant, llama_step_path=fast_model.step_path,
                    llama_mma_projections=sorted(numerics.llama.mma_projections))
    return info


def run_plain(setup: BenchSetup, result: dict, compare_hf: bool) -> dict:
    """transformers' generate (if asked), plain decoding in the speculative numerics, and plain decoding in the
    default numerics where those differ; records L_target and L_reference; returns the baseline run (the faster
    plain run, which speed ratios divide by)."""
    runs = result["runs"]
    if compare_hf:
        run_hf_generate(setup.target, setup.warm, 4, setup.stops, setup.device)
        runs["hf_generate"] = run_hf_generate(setup.target, setup.prompt_ids, setup.max_tokens, setup.stops,
                                              setup.device)
    # the reference speculative output must equal: plain decoding in the speculative engine's numerics (on the CPU
    # exact mode; on CUDA the fast model's invariant verify path: Engine's defaults with a drafter)
    cuda = torch.device(setup.device).type == "cuda"
    plain = engine_for(setup, exact=not cuda, invariant_verify=cuda and setup.draft_model is not None)
    result["engine"] = describe_engine(setup, plain)
    runs["plain"] = warm_and_time(setup, plain)
    baseline = runs["plain"]
    if result["engine"]["exact"] or plain.invariant_verify:
        # those numerics cost plain decoding (exact mode pads every step to a 16-token block; the invariant path
        # gives up the one-token kernels); a plain engine without a drafter uses neither, so speed ratios use the
        # faster of the two plain runs
        runs["plain_default"] = warm_and_time(setup, engine_for(setup, exact=False, invariant_verify=False))
        runs["plain_default"]["identical_to_plain"] = runs["plain_default"]["outputs"] == runs["plain"]["outputs"]
        if runs["plain_default"]["decode_tok_s"] > baseline["decode_tok_s"]:
            baseline = runs["plain_default"]
    result["baseline"] = "plain_default" if baseline is not runs["plain"] else "plain"
    result["L_target_ms"] = 1e3 * baseline["decode_s"] / max(baseline["tokens"], 1)
    # plain decoding in the speculative engines' numerics (the output they must equal), when that is not the baseline
    result["L_reference_ms"] = 1e3 * runs["plain"]["decode_s"] / max(runs["plain"]["tokens"], 1)
    return baseline


def describe_drafter(draft_model) -> dict:
    """The drafter's shape, for the record (None where a drafter class lacks the attribute)."""
    return {"block_size": draft_model.block_size,
            "layers": len(draft_model.layers) if hasattr(draft_model, "layers") else None,
            "block_attention": getattr(getattr(draft_model, "cfg", None), "block_attention", None),
            "target_layer_ids": getattr(draft_model, "target_layer_ids", None)}


def run_speculative(setup: BenchSetup, result: dict, modes: list[bool], baseline: dict) -> None:
    """The speculative runs (fixed and/or adaptive verify length), scored against plain decoding; for MoE targets
    the distinct experts a verify block and a plain decode step wake per layer."""
    runs, draft_model = result["runs"], setup.draft_model
    counter = ExpertCounter(setup.target)
    for adaptive_on in modes:
        key = "speculative_adaptive" if adaptive_on else "speculative"
        engine = engine_for(setup, drafter=draft_model, adaptive_verify=adaptive_on)
        counter.watch(engine)
        run_engine(engine, setup.warm, setup.warm_tokens, setup.stops)
        costs = engine.measure_verify_costs() if adaptive_on else {}  # the adaptive length's curve, at load
        counter.by_size.clear()  # count the timed run only, after the warm-up and the cost curve
        r = runs[key] = run_engine(engine, setup.prompt_ids, setup.max_tokens, setup.stops)
        score(r, costs, runs["plain"], result["L_target_ms"], baseline)
        if counter.handles:  # exact mode pads every verify to the fast model's max_block
            padded = engine.fast and engine.target.exact
            full = engine.target.fast.max_block if padded else draft_model.block_size
            r["experts_per_layer"] = {"of": counter.num_experts, "verify_block": counter.mean(full),
                                      "verify_block_tokens": full, "decode_step": None}
    if counter.handles:  # a plain decode step, for comparison (one token: no exact-mode padding)
        counter.by_size.clear()
        single = engine_for(setup, exact=False)
        counter.watch(single)
        run_engine(single, setup.prompt_ids[:1], 8, setup.stops)
        for key in ("speculative", "speculative_adaptive"):
            if key in runs:
                runs[key]["experts_per_layer"]["decode_step"] = counter.mean(1)
    counter.close()


def run_forced(setup: BenchSetup, result: dict, forced_tau: tuple[float, ...], modes: list[bool],
               baseline: dict) -> None:
    """The real cycle at a real tau: drafts replaced by plain decoding's own tokens (random weights accept nothing,
    so this is the only way to time the device cycle at a tau a trained drafter reaches)."""
    runs = result["runs"]
    reference = runs["plain"]["outputs"]
    for tau, adaptive_on in itertools.product(forced_tau, modes):
        engine = engine_for(setup, drafter=setup.draft_model, adaptive_verify=adaptive_on)
        force = lambda i, tau=tau: ForcedAcceptance(reference[i], tau, setup.vocab, engine.device, seed=i)  # noqa: E731
        run_engine(engine, setup.warm, setup.warm_tokens, setup.stops, force)
        costs = engine.measure_verify_costs() if adaptive_on else {}
        key = f"forced_tau_{tau:g}" + ("_adaptive" if adaptive_on else "")
        r = runs[key] = run_engine(engine, setup.prompt_ids, setup.max_tokens, setup.stops, force)
        r["forced_acceptance"] = {"tau": tau, "what": "drafts replaced by the target's plain greedy continuation "
                                  "up to a geometric accept length (a forced condition, not a drafter's tau)"}
        score(r, costs, runs["plain"], result["L_target_ms"], baseline)


def finish_record(setup: BenchSetup, result: dict, compare_hf: bool, baseline: dict, json_out: Path | None) -> None:
    """The routing trace's label, the summary, the last identical-output check; then outputs cut to their lengths,
    the table printed and the JSON written."""
    runs = result["runs"]
    if setup.tables is not None:
        result["routing_trace"] = {
            "what": "synthetic (backend/bench/routing.py): per MoE layer, each position takes its top-k among a hot "
                    f"set of {setup.routing_trace} experts, alike in decode steps and verifies (a forced condition)",
            "hot_experts": setup.routing_trace,
            "distinct_experts_per_16_positions": trace_distinct_experts(setup.tables)}
    result["summary"] = {key: summary(r, result["L_target_ms"], baseline) for key, r in runs.items()
                         if r.get("cycles")}
    if compare_hf:
        runs["plain"]["identical_to_hf_generate"] = runs["plain"]["outputs"] == runs["hf_generate"]["outputs"]
    for r in runs.values():
        r["outputs"] = [len(o) for o in r["outputs"]]  # lengths only in the report; the checks above saw the tokens
    print(format_table(result))
    if json_out:
        json_out = Path(json_out)
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_out}")


def run_bench(model: str = "tiny-hybrid", drafter: str = "random", device: str = "cpu", prompts: int = 4,
              max_tokens: int = 64, json_out: Path | None = None, block_size: int | None = None,
              adaptive: str = "both", compare_hf: bool = True, threads: int | None = None,
              command: str | None = None, forced_tau: tuple[float, ...] = (), routing_trace: int = 0,
              llama_invariant: str | None = None) -> dict:
    """Run the benchmark; print the text table; write JSON to json_out if given; return the result dict.
    drafter: "random" | "none" | "auto" | a checkpoint folder. adaptive: "off" | "on" | "both".
    threads: torch CPU threads (on a shared CPU, fewer threads than cores avoids OpenMP stalls).
    forced_tau: also time speculative runs under forced acceptance at these tau (device_cycle.ForcedAcceptance:
    random weights accept nothing; labelled "forced" in the record). routing_trace: MoE targets, route every fast-path
    engine by backend/bench/routing.py's synthetic trace over this many hot experts (labelled in the record).
    llama_invariant: Llama targets, how the engines' batch-invariant steps and verifies run, "glue" or "mma" (every
    engine's llama_invariant_path; default backend.models.numerics.LLAMA_INVARIANT_PATH)."""
    device, forced_tau = check_options(device, adaptive, forced_tau, compare_hf, routing_trace, threads,
                                       llama_invariant)
    setup = load_setup(model, drafter, device, prompts, max_tokens, block_size, routing_trace)
    setup.llama_invariant = llama_invariant or LLAMA_INVARIANT_PATH
    result = new_record(setup, model, drafter, prompts, command)
    baseline = run_plain(setup, result, compare_hf)
    if setup.draft_model is not None:
        result["drafter"].update(describe_drafter(setup.draft_model))
        modes = {"off": [False], "on": [True], "both": [False, True]}[adaptive]
        run_speculative(setup, result, modes, baseline)
        run_forced(setup, result, forced_tau, modes, baseline)
    finish_record(setup, result, compare_hf, baseline, json_out)
    return result


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-hybrid", help=f"{', '.join(TINY_MODELS + SHAPE_MODELS)} (random "
                    "weights), embedded, a HF folder or .gguf")
    ap.add_argument("--drafter", default="random", help=f"random, {RELEASED_DRAFTER} (random weights), none, auto "
                    "(shipped for the model) or a folder")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--adaptive", default="both", choices=["off", "on", "both"],
                    help="speculative (and forced) runs with a fixed verify length, the adaptive one (its cost curve "
                    "measured before the timed run: Engine.measure_verify_costs), or both")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--routing-trace", type=int, default=0, metavar="HOT",
                    help="MoE targets (random weights route uniformly): route by a synthetic trace, each layer's "
                    "top-k among HOT experts (50: ~47 distinct per 16 positions, like a real router); needs --no-hf")
    ap.add_argument("--forced-tau", default="", help="comma-separated tau values: also time speculative runs with "
                    "forced acceptance (random weights; labelled forced in the record), e.g. 4.9,6.4,8.1")
    ap.add_argument("--llama-invariant", choices=["glue", "mma"], default=None,
                    help="Llama targets: how the speculative engine's steps and verifies run, batch-invariant: the "
                    "compiled glue + cuBLAS on 16 padded rows, or our tensor-core row kernels for every projection "
                    f"(default: {LLAMA_INVARIANT_PATH}, backend.models.numerics.LLAMA_INVARIANT_PATH)")
    a = ap.parse_args(argv)
    return main(model=a.model, drafter=a.drafter, device=a.device, prompts=a.prompts, max_tokens=a.max_tokens,
         json_out=a.json, block_size=a.block_size, adaptive=a.adaptive, compare_hf=not a.no_hf, threads=a.threads,
         forced_tau=a.forced_tau, routing_trace=a.routing_trace, llama_invariant=a.llama_invariant,
         command="python -m backend.bench " + " ".join(argv if argv is not None else sys.argv[1:]))


def parse_taus(text) -> tuple[float, ...]:
    """--forced-tau "4.9,6.4" -> (4.9, 6.4); a tuple passes through."""
    if not isinstance(text, str):
        return tuple(text)
    try:
        taus = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise BenchError(f"--forced-tau takes numbers separated by commas, got {text!r}") from None
    if any(t < 1 for t in taus):
        raise BenchError("--forced-tau: tau is at least 1 (the target's own token)")
    return taus


if __name__ == "__main__":
    sys.exit(cli())
