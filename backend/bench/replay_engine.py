"""The replay's sessions driven through `Engine.generate` in-process (`python -m backend.bench.replay --interface
engine`): for the GPU shapes with random weights (qwen3.6-35b-a3b-shape), where serving over HTTP would measure
nothing more and acceptance must be forced, and for the tiny random models on the CPU.

The session structure is the serve replay's, at the token level: the opening (system prompt, tool schemas, first
turn) rendered by a tokenizer's chat template, then per turn the engine's own reply ids and the next file chunk as a
ChatML tool-response turn. A model without a tokenizer (the random shapes) borrows the embedded model's; ids are
taken modulo the target's vocabulary (a no-op for the 35B-A3B shape's 248,320). Each configuration gets a fresh
Engine over the one loaded target (cold: its graphs and compiles are made anew), warmed as `reviewer serve` warms it
before its ready line. With --forced-tau the speculative run's drafts are replaced by the --drafter none run's reply
at the same turn (device_cycle.ForcedAcceptance), so its replies must equal that reference.
"""

from __future__ import annotations

import gc
import hashlib
import time

import torch

from backend.bench.routing import route_engine_by_trace, trace_distinct_experts
from backend.bench.run import TINY_MODELS, load_target, make_drafter
from backend.bench.sessions import Chunk, ReplayError, Session, TurnRow, load_tools
from backend.bench.shapes import RELEASED_DRAFTER, SHAPE_MODELS
from backend.chat import render_chat, stop_token_ids
from backend.decoding.device_cycle import ForcedAcceptance
from backend.decoding.engine import Engine, SamplingParams
from backend.loading import EMBEDDED_NAME, convert_gguf, embedded_gguf_path


def render_tokenizer(folder=None):
    """The tokenizer that renders the sessions for a target without one: a folder's, or the embedded model's."""
    from transformers import AutoTokenizer

    path = folder or convert_gguf(embedded_gguf_path(), EMBEDDED_NAME)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ReplayError(f"--tokenizer {path}: not a tokenizer folder ({exc})") from None


def chunk_turn_text(chunk: Chunk) -> str:
    """The reply's end, then the chunk as a tool response, then the next reply's start (ChatML, as the embedded and
    Qwen templates write a tool turn)."""
    return (f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{chunk.tool_output()}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")


def drafter_spec(config: str, model: str) -> str:
    """--drafter auto for a random target: the released drafter's shape (shapes) or a random drafter (tiny)."""
    if config == "auto" and model in SHAPE_MODELS:
        return RELEASED_DRAFTER
    if config == "auto" and model in TINY_MODELS:
        return "random"
    return config


def session_ids(sessions: list[Session], tokenizer, vocab: int) -> list[tuple[list[int], list[list[int]]]]:
    """Per session: (opening ids, ids of each chunk's turn)."""
    tools = load_tools()
    out = []
    for s in sessions:
        _, opening = render_chat(tokenizer, s.opening(), tools)
        turns = [tokenizer.encode(chunk_turn_text(c), add_special_tokens=False) for c in s.chunks]
        out.append(([t % vocab for t in opening], [[t % vocab for t in ids] for ids in turns]))
    return out


def timed_generate(engine: Engine, ids: list[int], max_tokens: int, stops) -> tuple[list[int], float, float]:
    """(reply ids, seconds to the first committed token, wall)."""
    t0 = time.perf_counter()
    first, out = None, []
    for block in engine.generate(ids, SamplingParams(max_tokens=max_tokens, stop_token_ids=stops)):
        if first is None and block:
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            first = time.perf_counter() - t0
        out += block
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return out, first, time.perf_counter() - t0


def replay_config(engine: Engine, config: str, sessions, ids, *, max_context: int, max_tokens: int, max_turns,
                  stops, references: dict, forced_tau, vocab: int):
    """Every session through one engine; returns (rows, walls, stop reasons). `references` collects (session, turn)
    -> reply ids for --drafter none and feeds the forcing otherwise."""
    rows, walls, why = [], {}, {}
    for s, (ctx, turns) in zip(sessions, ids):
        ctx, t0, why[s.name] = list(ctx), time.perf_counter(), "chunks exhausted"
        for turn in range(len(turns) + 1):
            if max_turns is not None and turn >= max_turns:
                why[s.name] = f"max_turns {max_turns}"
                break
            if len(ctx) + max_tokens > max_context:
                why[s.name] = f"next turn would not fit: {len(ctx)} + {max_tokens} > {max_context}"
                break
            ref = references.get((s.name, turn))
            if forced_tau and engine.drafter is not None and ref is not None:
                engine.forced_acceptance = ForcedAcceptance(ref, forced_tau, vocab, engine.device, seed=turn)
            reply, ttft, wall = timed_generate(engine, ctx, max_tokens, stops)
            if config == "none":
                references[(s.name, turn)] = reply
            st = engine.last_stats
            spec = ({"spec_cycles": st.cycles, "draft_n": st.draft_tokens, "draft_n_accepted": st.accepted_tokens,
                     "tau": round((st.accepted_tokens + st.cycles) / st.cycles, 3)} if st.cycles else None)
            rows.append(TurnRow(config=config, session=s.name, turn=turn, context_tokens=len(ctx),
                                counted_tokens=len(ctx), cached_tokens=st.cached_tokens,
                                completion_tokens=st.generated_tokens, ttft_s=None if ttft is None else round(ttft, 4),
                                decode_tok_s=round(st.generated_tokens / st.decode_seconds, 2) if st.decode_seconds
                                else None, decode_tok_s_source="engine stats", wall_s=round(wall, 4),
                                finish_reason=st.finish_reason, tool_calls=0,
                                reply_sha256=hashlib.sha256(repr(reply).encode()).hexdigest(), spec=spec))
            if turn < len(turns):
                ctx += reply + turns[turn]
        walls[s.name] = round(time.perf_counter() - t0, 4)
    return rows, walls, why


ISOLATED = ("each configuration in its own process (spawned, the target loaded anew): nothing one leaves in memory "
            "(Triton's loaded kernels, cuDNN's plans, the allocator's pool) serves the next, as with two cold servers; "
            "Triton's on-disk kernel cache is shared, as across restarts of a server on one machine")


def isolated_replay(model: str, sessions: list[Session], *, drafters: tuple[str, ...], **options):
    """engine_replay with each configuration in a fresh process, one after the other (the --drafter none run first:
    its replies are the forced runs' reference). In one process the second configuration found the first one's
    per-shape caches warm (the 35B-A3B shape: prefill 0.40 s a turn against 0.67 s, the same code): that ordering,
    not the drafter, made a third of the speed-up."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    runs, rows, references, name, settings = {}, [], {}, model, {}
    for config in drafters:
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            got = pool.submit(engine_replay, model, sessions, drafters=(config,), references=references,
                              **options).result()
        runs.update(got[0])
        rows += got[1]
        name, settings = got[2], settings or got[3]
        references.update(got[4])
    return runs, rows, name, {**settings, "processes": ISOLATED}


def engine_replay(model: str, sessions: list[Session], *, drafters: tuple[str, ...], device: str, max_context: int,
                  max_tokens: int, max_turns, forced_tau, routing_trace: int = 0, tokenizer_dir=None,
                  references: dict | None = None) -> tuple[dict, list, str, dict, dict]:
    """Each configuration on a fresh Engine over one loaded target, in this process; returns (runs, rows, model
    name, settings, the --drafter none replies by (session, turn)). routing_trace: MoE targets with random weights,
    routed by backend/bench/routing.py's trace over this many hot experts, as `reviewer bench --routing-trace`
    (random routing wakes twice the experts a real router does). references: an earlier none run's replies."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ReplayError("--interface engine --device cuda, but torch sees no CUDA device")
    if forced_tau is not None and (device != "cuda" or forced_tau < 1):
        raise ReplayError("--forced-tau times the GPU's device cycle: use --device cuda and a tau of at least 1")
    t0 = time.perf_counter()
    try:
        target, tokenizer, name, _ = load_target(model, device, max_context=max_context)
    except Exception as exc:  # noqa: BLE001 - a bad --model is one line for the user
        raise ReplayError(f"cannot load {model}: {exc}") from None
    load_s = time.perf_counter() - t0
    vocab = target.get_input_embeddings().weight.shape[0]
    render_tok = tokenizer or render_tokenizer(tokenizer_dir)
    stops = stop_token_ids(tokenizer, getattr(target, "generation_config", None)) if tokenizer else ()
    ids = session_ids(sessions, render_tok, vocab)
    runs, rows, tables = {}, [], None
    references = dict(references or {})
    for config in drafters:
        t0 = time.perf_counter()
        draft_model, source = make_drafter(drafter_spec(config, model), target, name, None)
        engine = Engine(target, drafter=draft_model, max_context=max_context)
        if routing_trace:
            try:
                tables = route_engine_by_trace(engine, routing_trace)
            except ValueError as exc:
                raise ReplayError(f"--routing-trace: {exc}") from None
        graphs = engine.warm_up()  # what `reviewer serve` does before its ready line
        engine.mark_ready()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        ready_s = round(time.perf_counter() - t0, 3)
        # the counts are process-wide (the hooks of torch.compile and Triton are): this configuration's are the growth
        before = (engine.captures.captures, engine.captures.compilations, len(engine.captures.after_ready))
        got, walls, why = replay_config(engine, config, sessions, ids, max_context=max_context, max_tokens=max_tokens,
                                        max_turns=max_turns, stops=stops, references=references,
                                        forced_tau=forced_tau if config != "none" else None, vocab=vocab)
        rows += got
        runs[config] = {"drafter": config, "drafter_source": source, "ready_s": ready_s, "graphs_at_ready": graphs,
                        "ready_line": engine.describe_decoding(), "sessions_wall_s": walls, "stop_reasons": why,
                        "captures_after_ready": engine.captures.captures - before[0],
                        "compilations_after_ready": engine.captures.compilations - before[1],
                        "after_ready_what": engine.captures.after_ready[before[2]:], "window": max_context}
        print(f"--drafter {config} ({source}): engine ready in {ready_s:.1f} s; {len(got)} turns in "
              f"{sum(walls.values()):.1f} s")
        del engine, draft_model  # its graphs and caches go before the next configuration's are made
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    settings = {"model_load_s": round(load_s, 3), "device": device, "window": max_context,
                "tokenizer": "the model's" if tokenizer else f"{tokenizer_dir or EMBEDDED_NAME}'s (the target has "
                f"none); ids modulo the target's vocabulary ({vocab})",
                "ready_s_means": "drafter + Engine construction + Engine.warm_up(), as `reviewer serve` before its ready "
                                 "line (the model is loaded once, before, and shared)",
                "captures_after_ready_note": "CUDA graphs captured during the configuration's replay (backend/models/"
                                             "captures.py counts; compilations_after_ready likewise)",
                "routing_trace": None if not routing_trace else {
                    "what": "synthetic (backend/bench/routing.py): per MoE layer, each position takes its top-k among "
                            f"a hot set of {routing_trace} experts, alike in decode steps and verifies (a forced "
                            "condition)", "hot_experts": routing_trace,
                    "distinct_experts_per_16_positions": trace_distinct_experts(tables)},
                "forcing": None if forced_tau is None else "drafts replaced by the --drafter none run's reply at the "
                           "same turn up to a geometric accept length (device_cycle.ForcedAcceptance): a forced "
                           "condition, not a drafter's tau"}
    return runs, rows, name, settings, references
