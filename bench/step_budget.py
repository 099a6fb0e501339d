"""Where the 35B-A3B shape's time goes, layer by layer: a kernel trace of the real CUDA-graph replays.

For each context length: one plain decode step, one 16-token verify, its accept, and one prefill piece of an agent
turn's size, each in its own torch.profiler window (so a window holds exactly one call's kernels), repeated --reps
times. The kernels of a window, in launch order, are cut into layers where a layer's MoE kernels end (every layer
ends with its experts), and each kernel is put in a part by its name (attention, recurrence, projections, experts,
glue, ...). Per layer kind, the median microseconds of each part beside the bytes that part must move (its weights,
the experts the step wakes, the KV it reads, the Gated DeltaNet state) and their floor at the copy bandwidth measured
in the same run. The engine's numerics: batch-invariant padded rows for decode and verify (what `reviewer serve`
runs), the glue through torch.compile, CUDA graphs on, routing replayed from the synthetic trace (--hot-experts; a
forced condition: random weights route to ~100 experts per 16 tokens, a real router to far fewer).

    python bench/step_budget.py --context 3000 --context 30000 --prefill 1700 --out bench/results

Random weights, so nothing here says anything about text; only time. A sum of microbenchmarks would miss the gaps
and the graph's launch chain; this is the replay itself. (No wall times inside the windows: the profiler's own start
and stop sit inside them, so only the kernels' times are figures there. The prefill piece's wall, launches from
Python included, is timed again outside any window: `wall_ms`; so are the decode step's and the verify's, graph replay
and host work: `wall_us`.) --glue-kernels on / off times the padded steps' glue in our kernels or compiled
(QwenNumerics.glue_kernels): run it twice in one call for a side-by-side pair. --numerics one_token traces the
one-token kernels instead (reviewer bench's "plain (default kernels)", which L_target times): beside an invariant run
on the same machine it shows, kernel by kernel, what the invariant plain step pays over them. --experts gemv runs the
invariant step's experts through the one-token kernels for every token count (still invariant: each token runs the
one-token programs), --experts gemv_blocks the same arithmetic with each expert's rows read once a verify, to weigh a
plain step at one-token cost against the verify's:

    python bench/step_budget.py --compare one_token.json invariant.json [--compare-call verify16]   # no GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from backend.bench.report import cpu_model  # noqa: E402
from backend.bench.routing import install_routing_trace, trace_distinct_experts  # noqa: E402
from backend.models import Numerics, invariant_numerics  # noqa: E402
from backend.models.numerics import QWEN_EXPERTS  # noqa: E402
from reviewer_kernels import moe_routing as routing  # noqa: E402
from target_step import copy_bandwidth, random_qwen_without_transformers  # noqa: E402

# first match wins; the names are our Triton kernels' function names, cuBLAS's and torch.compile's families
PARTS = [
    ("routing", r"router|_route|topk|radix"),  # before attention: _router_partial_kernel is no attention kernel
    ("attention", r"^_partial_kernel|^_combine_kernel|^_write_block_kernel|flash|fmha|sdpa"),
    ("recurrence", r"gdn|trsm|triangular|_chunk_|getrs|trsv"),
    ("experts", r"_gate_up_kernel|_down_kernel|_gate_up_blocks_kernel|_down_tokens_kernel|_sum_slots|_align_kernel|"
                r"_block_rows|_chunk_ranks|moe"),
    ("projections", r"_wide_kernel|gemm|gemv|nvjet|cutlass|xmma|_rows_linear|_norm_gemv|sm90_|sm80_"),
    # _conv_kernel: the Gated DeltaNet convolution (reviewer_kernels/gdn_conv.py); norms.py's; attention_prep.py's
    ("glue", r"^triton_|^_conv_kernel|_rms_norm_kernel|^_attention_prep_kernel"),
]
MOE = re.compile(dict(PARTS)["experts"])


def part_of(name: str) -> str:
    for part, pattern in PARTS:
        if re.search(pattern, name):
            return part
    return "other"


def window_kernels(call, device) -> list[dict]:
    """The kernels one call launches (name, start, duration in us), in launch order."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize(device)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    return sorted(({"name": e["name"], "ts": e["ts"], "us": e["dur"]} for e in events if e.get("cat") == "kernel"),
                  key=lambda e: e["ts"])


def split_layers(kernels: list[dict], layers: int) -> list[list[dict]]:
    """Cut a forward's kernels into `layers` layers and the head after them: a layer ends with its MoE kernels."""
    out, current, in_moe = [], [], False
    for k in kernels:
        moe = bool(MOE.search(k["name"]))
        if in_moe and not moe and len(out) < layers:
            out.append(current)
            current = []
        current.append(k)
        in_moe = moe
    out.append(current)
    return out  # layers + 1 lists when the cut found every layer


def budget(windows: list[list[dict]], kinds: list[str]) -> dict:
    """Per layer kind (and the head): median us per part and per layer, and the kernel count, over the windows."""
    per = {}  # (kind, part) -> list of us per layer per window
    for kernels in windows:
        layers = split_layers(kernels, len(kinds))
        if len(layers) != len(kinds) + 1:
            raise RuntimeError(f"cut {len(layers) - 1} layers out of {len(kinds)}: the MoE kernel names changed?")
        for kind, layer in zip(kinds + ["head"], layers):
            sums = {}
            for k in layer:
                part = part_of(k["name"])
                sums[part] = sums.get(part, 0.0) + k["us"]
            for part, us in sums.items():
                per.setdefault((kind, part), []).append(us)
    out = {}
    for (kind, part), values in per.items():
        layers_of_kind = len(windows) * (kinds.count(kind) if kind != "head" else 1)
        # a part absent in some layers counts as zero there
        values = values + [0.0] * (layers_of_kind - len(values))
        out.setdefault(kind, {})[part] = round(statistics.median(values), 2)
    return out


def top_kernels(windows: list[list[dict]], top: int = 25) -> list[dict]:
    totals = {}
    for kernels in windows:
        for k in kernels:
            t = totals.setdefault(k["name"][:110], [0.0, 0])
            t[0] += k["us"]
            t[1] += 1
    rows = [{"kernel": n, "us_per_call": us / len(windows), "launches_per_call": c / len(windows),
             "part": part_of(n)} for n, (us, c) in totals.items()]
    return sorted(rows, key=lambda r: -r["us_per_call"])[:top]


def layer_bytes(model, tokens: int, context: int, distinct: float) -> dict:
    """Bytes a forward of `tokens` new tokens after `context` must move, per layer kind and part (weights once)."""
    c, es = model.config, model.embed.element_size()
    nbytes = lambda *ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    attn = next(layer for layer in model.layers if hasattr(layer.mixer, "wqkv"))
    gdn = next(layer for layer in model.layers if hasattr(layer.mixer, "w_in"))
    moe = attn.moe
    expert = nbytes(moe.gate_up[0], moe.down[0])
    experts = (c.top_k if tokens == 1 else distinct) * expert
    shared = nbytes(moe.shared_gate_proj, moe.shared_up_proj, moe.shared_down_proj, moe.shared_gate)
    kv = model.kv.nbytes_per_token() // model.num_attention_layers * (context + tokens)
    state = 2 * model.linear.nbytes_state() // model.num_linear_layers
    return {
        "full_attention": {"projections": nbytes(attn.mixer.wqkv, attn.mixer.wo), "attention": kv,
                           "experts": experts + shared},
        "linear_attention": {"projections": nbytes(gdn.mixer.w_in, gdn.mixer.w_out), "recurrence": state,
                             "experts": experts + shared},
        "head": {"projections": nbytes(model.lm_head) + tokens * c.hidden_size * es},
    }


def with_floor(measured: dict, bytes_: dict, bandwidth: float) -> dict:
    out = {}
    for kind, parts in measured.items():
        rows = {}
        for part, us in parts.items():
            b = bytes_.get(kind, {}).get(part)
            floor = b / bandwidth * 1e6 if b else None
            rows[part] = {"us": us, "bytes": b, "floor_us": round(floor, 2) if floor else None,
                          "over_floor": round(us / floor, 2) if floor else None}
        out[kind] = {"parts": rows, "us": round(sum(parts.values()), 2)}
    return out


def measure_context(fast, model, context: int, args, bandwidth: float, distinct: float) -> dict:
    """Decode, verify, accept and a prefill piece after `context` random tokens."""
    dev = fast.device
    g = torch.Generator().manual_seed(context)
    fast.reset()
    fast.prefill(torch.randint(0, fast.vocab_size, (context,), generator=g).to(dev))
    block = torch.randint(0, fast.vocab_size, (16,), generator=g).to(dev)
    kinds = list(model.config.layer_types)
    start = fast.snapshot()
    fast.decode(7)  # graphs captured outside the windows
    fast.verify(block)
    fast.accept(1)
    fast.restore(start)
    windows = {"decode": [], "verify16": [], "accept": [], "prefill": []}  # one list of kernels per call
    for _ in range(args.reps):
        windows["decode"].append(window_kernels(lambda: fast.decode(7), dev))
        fast.restore(start)
        windows["verify16"].append(window_kernels(lambda: fast.verify(block), dev))
        windows["accept"].append(window_kernels(lambda: fast.accept(1), dev))
        fast.restore(start)
    piece = torch.randint(0, fast.vocab_size, (args.prefill,), generator=g).to(dev)
    for _ in range(max(1, args.reps // 3)):
        windows["prefill"].append(window_kernels(lambda: fast.prefill(piece), dev))
        fast.restore(start)
    out = {"context": context}
    for name, calls in windows.items():
        out[name] = {"kernel_us": statistics.median(sum(k["us"] for k in ks) for ks in calls),
                     "launches": statistics.median(len(ks) for ks in calls), "top_kernels": top_kernels(calls)}
    for name, tokens in [("decode", 1), ("verify16", 16)]:
        out[name]["per_layer"] = with_floor(budget(windows[name], kinds), layer_bytes(model, tokens, context, distinct),
                                            bandwidth)
    out["prefill"]["tokens"] = args.prefill
    out["prefill"]["pieces"] = math.ceil(args.prefill / fast.prefill_chunk)
    out["prefill"]["wall_ms"] = round(call_wall_us(lambda: fast.prefill(piece), fast, start, 3) / 1e3, 2)
    out["decode"]["wall_us"] = call_wall_us(lambda: fast.decode(7), fast, start, args.reps)
    # abandon() only resets the cache's length (no kernel), so the wall is the verify's own
    out["verify16"]["wall_us"] = call_wall_us(lambda: (fast.verify(block), fast.abandon()), fast, start, args.reps)
    return out


def call_wall_us(call, fast, start, reps: int) -> float:
    """A call (decode step, verify, prefill piece) as FastModel's caller meets it, without the profiler: host wall
    from the call to the device's end (launches from Python included), median of `reps`, the caches restored after
    each."""
    walls = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e6)
        fast.restore(start)
    return round(statistics.median(walls), 1)


def compare(a: dict, b: dict, call: str = "decode", top: int = 25) -> str:
    """Two step_budget records side by side, context by context: the call's kernel and wall totals, its per-layer parts
    by layer kind, and its kernels (each record keeps its top 25 by time; a kernel outside one record's list shows
    "-" there). For pairs taken in one call on one machine; other pairs are labelled so, since kernel times move
    between machines of one kind too."""
    lines = []
    ma, mb = a.get("machine", {}).get("gpu"), b.get("machine", {}).get("gpu")
    if ma != mb:
        lines.append(f"machines differ: A {ma}, B {mb} (not a side-by-side pair)")
    if a.get("layers", 40) != b.get("layers", 40):
        lines.append(f"layer counts differ: A {a.get('layers', 40)}, B {b.get('layers', 40)} (totals do not compare)")
    lines.append(f"A: {a.get('numerics')} ({a.get('date')})")
    lines.append(f"B: {b.get('numerics')} ({b.get('date')})")
    by_context = {c["context"]: c for c in b["contexts"]}
    for ca in a["contexts"]:
        cb = by_context.get(ca["context"])
        if cb is None:
            lines.append(f"context {ca['context']}: not in B")
            continue
        ra, rb = ca[call], cb[call]
        lines.append(f"context {ca['context']}, {call}: kernels {ra['kernel_us']:.0f} -> {rb['kernel_us']:.0f} us "
                     f"(B/A {rb['kernel_us'] / ra['kernel_us']:.3f}), launches {ra['launches']:.0f} -> "
                     f"{rb['launches']:.0f}" + (f", wall {ra['wall_us']:.0f} -> {rb['wall_us']:.0f} us"
                                                if "wall_us" in ra and "wall_us" in rb else ""))
        for kind in ra.get("per_layer", {}):
            pa, pb = ra["per_layer"][kind]["parts"], rb.get("per_layer", {}).get(kind, {}).get("parts", {})
            parts = sorted(set(pa) | set(pb), key=lambda p: -max(pa.get(p, {}).get("us", 0), pb.get(p, {}).get("us", 0)))
            cells = [f"{p} {pa.get(p, {}).get('us', 0):.1f} -> {pb.get(p, {}).get('us', 0):.1f}" for p in parts
                     if pa.get(p, {}).get("us", 0) or pb.get(p, {}).get("us", 0)]
            lines.append(f"  {kind} (us a layer): " + ", ".join(cells))
        ka = {k["kernel"]: k for k in ra["top_kernels"]}
        kb = {k["kernel"]: k for k in rb["top_kernels"]}
        names = sorted(set(ka) | set(kb), key=lambda n: -max(ka.get(n, {}).get("us_per_call", 0),
                                                             kb.get(n, {}).get("us_per_call", 0)))[:top]
        lines.append(f"  {'A us':>8} {'B us':>8} {'B - A':>8} {'A n':>5} {'B n':>5}  kernel")
        for n in names:
            ua, ub = ka.get(n, {}).get("us_per_call"), kb.get(n, {}).get("us_per_call")
            na, nb = ka.get(n, {}).get("launches_per_call"), kb.get(n, {}).get("launches_per_call")
            diff = f"{ub - ua:+8.1f}" if ua is not None and ub is not None else f"{'':8}"
            lines.append(f"  {_cell(ua, '8.1f'):>8} {_cell(ub, '8.1f'):>8} {diff} {_cell(na, '5.0f'):>5} "
                         f"{_cell(nb, '5.0f'):>5}  {n[:80]}")
    return "\n".join(lines)


def _cell(x: float | None, spec: str) -> str:
    """A number of one record's table, or "-" where that record does not list the kernel."""
    return "-" if x is None else f"{x:{spec}}"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, action="append", help="cached tokens before the measured calls "
                    "(repeatable; default 3000)")
    ap.add_argument("--prefill", type=int, default=1700, help="tokens of the timed prefill piece (an agent turn)")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--hot-experts", type=int, default=50)
    ap.add_argument("--route-in-matmul", action="store_true", help="route inside the router matmul's launch "
                    "(reviewer_kernels/moe_routing.py ROUTE_IN_MATMUL)")
    ap.add_argument("--glue-kernels", choices=["default", "on", "off"], default="default",
                    help="the padded steps' glue in our Triton kernels or in compiled PyTorch (QwenNumerics."
                         "glue_kernels; default: backend/models/numerics.py QWEN_GLUE_KERNELS)")
    ap.add_argument("--numerics", choices=["invariant", "one_token"], default="invariant",
                    help="invariant: the padded batch-invariant steps `reviewer serve` runs; one_token: the one-token "
                         "kernels (reviewer bench's 'plain (default kernels)', L_target): run both in one call to see, "
                         "kernel by kernel, what the invariant step costs over them (its verify is not serve's)")
    ap.add_argument("--experts", choices=list(QWEN_EXPERTS), default="tuned",
                    help="the invariant step's experts: the device's tuned grouped tiles, or every token through the "
                         "one-token kernels (gemv: fused_moe's gemv_tokens, the decode step's experts cost what "
                         "one-token decoding's do, the verify's what 16 tokens of them do; gemv_blocks: the same "
                         "programs with each expert's rows read once a verify, moe_decode.blocks_moe)")
    ap.add_argument("--layers", type=int, default=40,
                    help="layers of the shape to build (a multiple of 4; default all 40). 20 fits an 80 GB card; the "
                         "per-layer rows keep their meaning, the whole-step totals do not (the record says so)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print two records side by side (the decode "
                    "step, or --compare-call) and exit: no GPU needed")
    ap.add_argument("--compare-call", choices=["decode", "verify16", "accept", "prefill"], default="decode")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    return ap.parse_args()


def compare_files(paths: list[str], call: str) -> str:
    records = []
    for path in paths:
        try:
            records.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"--compare {path}: {exc}")
        if records[-1].get("benchmark") != "step_budget":
            raise SystemExit(f"--compare {path}: not a step_budget record")
    return compare(*records, call=call)


def print_context(r: dict) -> None:
    for name in ("decode", "verify16", "accept", "prefill"):
        wall = f", wall {r[name]['wall_us']:.0f} us" if "wall_us" in r[name] else ""
        print(f"  {name}: kernels {r[name]['kernel_us']:.0f} us, {r[name]['launches']:.0f} launches{wall}", flush=True)
    print(f"  prefill wall {r['prefill']['wall_ms']} ms in {r['prefill']['pieces']} piece(s)", flush=True)
    for name in ("decode", "verify16"):
        for kind, row in r[name]["per_layer"].items():
            parts = ", ".join(f"{p} {v['us']:.1f}" + (f" ({v['over_floor']}x)" if v["over_floor"] else "")
                              for p, v in row["parts"].items())
            print(f"  {name} {kind}: {row['us']:.1f} us/layer: {parts}", flush=True)
    for k in r["prefill"]["top_kernels"][:12]:
        print(f"  prefill {k['us_per_call']:9.1f} us {k['launches_per_call']:6.0f}x {k['part']:11s} "
              f"{k['kernel'][:70]}", flush=True)


def main() -> None:
    args = parse_args()
    if args.compare:
        print(compare_files(args.compare, args.compare_call))
        return
    if args.layers < 4 or args.layers > 40 or args.layers % 4:
        raise SystemExit(f"--layers {args.layers}: a multiple of 4 from 4 to 40 (the shape repeats 3 linear + 1 full)")
    if args.experts != "tuned" and args.numerics == "one_token":
        raise SystemExit(f"--experts {args.experts} chooses the invariant step's experts; the one-token kernels are "
                         "gemv already")
    if not torch.cuda.is_available():
        raise SystemExit("step_budget traces CUDA-graph replays: it needs a GPU")
    contexts = args.context or [3000]
    if args.route_in_matmul:
        routing.ROUTE_IN_MATMUL = True  # read at each call; set before the graphs are captured
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    model, fast_cls = random_qwen_without_transformers("qwen3.6-35b-a3b", dev, torch.bfloat16, layers=args.layers)
    if args.numerics == "one_token":
        numerics = Numerics("one_token", "bench/step_budget.py --numerics one_token: L_target's kernels", compile=True)
    else:
        numerics = invariant_numerics("bench/step_budget.py: the numerics `reviewer serve` runs on the GPU",
                                      compile=True)
    if args.glue_kernels != "default":
        numerics = replace(numerics, qwen=replace(numerics.qwen, glue_kernels=args.glue_kernels == "on"))
    numerics = replace(numerics, qwen=replace(numerics.qwen, experts=args.experts))
    fast = fast_cls(model, max(contexts) + args.prefill + 64, cuda_graphs=True, compile=True, numerics=numerics)
    distinct = trace_distinct_experts(install_routing_trace(fast, hot=args.hot_experts))
    record = {"benchmark": "step_budget",
              "model": "qwen3.6-35b-a3b shape, random weights (bf16)" + (
                  f", {args.layers} of its 40 layers (whole-step totals cover only those)" if args.layers != 40
                  else ""),
              "layers": args.layers,
              "experts": numerics.qwen.experts,
              "numerics": ("one-token kernels (L_target's; the verify is not serve's), glue compiled"
                           if args.numerics == "one_token" else "batch-invariant padded rows (serve's default), glue "
                           + ("in our kernels" if numerics.qwen.glue_kernels else "compiled")) + ", CUDA graphs",
              "glue_kernels": numerics.qwen.glue_kernels,
              "routing": f"synthetic trace, hot set {args.hot_experts}: {distinct:.1f} distinct experts per 16 "
                         "positions (a forced condition)",
              "copy_bandwidth_GBps": bandwidth / 1e9, "floor": "bytes / copy bandwidth (read + write counted)",
              "machine": {"gpu": torch.cuda.get_device_name(), "cpu": cpu_model()},
              "command": "python " + " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "contexts": []}
    for context in contexts:
        print(f"context {context}", flush=True)
        record["contexts"].append(measure_context(fast, model, context, args, bandwidth, distinct))
        print_context(record["contexts"][-1])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"step_budget_qwen3.6-35b-a3b-shape{args.label}_{datetime.date.today():%Y%m%d}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
