"""Benchmark (not a test): tiles and block mode of the grouped MoE experts for batch-invariant steps, under a real
router's locality. Issue 26.

A speculative engine runs every decode step and verify block of the Qwen3.5/3.6-MoE target through
`Qwen35Moe._padded_rows`, whose experts take one tile set for every call of 1..16 tokens (so a row's bits cannot
depend on the call's size). That tile set came from the tuner's 16-token entry, tuned under random routing, where 16
tokens wake ~100 experts and a block per (token, expert) slot ("direct" mode) costs nothing extra. A real router
wakes ~48 (the seed's trace): 16 tokens then share each expert ~2.7 times, and direct mode reads each expert once per
slot, where "sorted" mode (slots grouped by expert, a block per expert of <= BM slots) reads it once.

For each candidate (gate_up tiles with K-split, down tiles) and both modes: microseconds per layer at 1..16 tokens
(CUDA-graph replay of --layers distinct layers back to back, so weights come from HBM), routing among a hot set of
--hot experts per layer (as backend/bench/routing.py does), and whether every row of each call is bitwise the row
computed alone in direct mode: the condition under which the mode may change with the token count. Last, the best
tiles with the slots summed inside the down kernel (`sum_in_down`: one launch fewer a layer): the entry takes it if
its output is bitwise the slot sum's and it is faster over the entry's own token counts. And the one-token kernels
for every token count ("gemv": `gemv_tokens` 16; "gemv_blocks": the same arithmetic, each expert's rows read once a
call), recorded beside the entry's curve but never chosen here (a faster
plain step against a slower verify is `reviewer bench`'s and the replay's to weigh).

    python bench/moe_invariant_tiles.py --out bench/results          # H200: ~2 minutes

It prints the table entry to copy into reviewer_kernels/fused_moe_configs.json under the device's name
(`E256_H2048_I512_K8_S1_invariant`; reviewer_kernels.fused_moe.invariant_config reads it). bench/fused_moe.py --tune
writes a fresh table without it: merge, do not overwrite.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backend.models.numerics import QWEN_EXPERTS  # noqa: E402
from reviewer_kernels import SharedExpert  # noqa: E402
fm = importlib.import_module("reviewer_kernels.fused_moe")

E, H, I, K = 256, 2048, 512, 8  # Qwen3.6-35B-A3B


def time_graph_us(fn, trials: int = 7, inner: int = 10) -> float:
    """Median time of one call of fn, replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    samples = []
    for _ in range(trials):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(inner):
            graph.replay()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) / inner * 1e6)
    return statistics.median(samples)


def make_layers(n: int, device) -> list[dict]:
    layers = []
    for _ in range(n):
        w = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16) * 0.02  # noqa: E731
        layers.append({"gate_up": w(E, 2 * I, H), "down": w(E, H, I),
                       "shared": SharedExpert(w(I, H), w(I, H), w(H, I), w(1, H))})
    return layers


def routing(n_layers: int, tokens: int, hot: int | None, g: torch.Generator, device):
    """Per layer: (weights, ids) [tokens, K]; ids top-K among a hot set of `hot` experts (None: among all)."""
    out = []
    for _ in range(n_layers):
        pool = torch.randperm(E, generator=g)[:hot or E]
        ids = torch.stack([pool[torch.randperm(pool.numel(), generator=g)[:K]] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, K, generator=g), -1)
        out.append((weights.to(device, torch.bfloat16), ids.to(device)))
    return out


def run_layers(layers, x, routes, config, m: int):
    def run():
        for layer, (w, ids) in zip(layers, routes):
            fm.fused_moe(x[:m], layer["gate_up"], layer["down"], w[:m], ids[:m], layer["shared"], config=config)
    return run


def rows_alone_equal(layer, x, w, ids, config, m: int) -> bool:
    """Every row of an m-token call equals that token computed alone (one-token call, direct mode)."""
    together = fm.fused_moe(x[:m], layer["gate_up"], layer["down"], w[:m], ids[:m], layer["shared"], config=config)
    alone_cfg = dict(config, direct=True, direct_tokens=16)
    alone = torch.cat([fm.fused_moe(x[t:t + 1], layer["gate_up"], layer["down"], w[t:t + 1], ids[t:t + 1],
                                    layer["shared"], config=alone_cfg) for t in range(m)])
    return bool(torch.equal(together, alone))


# Unsplit gate_up sets with more bytes in flight per SM than the entry's (BN 32, BK 256, 3 stages: 2 x 40 KB of
# loads ahead, 80 KB of shared memory). At one token the entry moves 37.7 MB in 16.7 us a layer (2.3 TB/s), 144
# programs of 256 KB streaming one after the other's latency: deeper pipelines or narrower tiles (more programs an SM)
# are the untried way to cover it. Each fits the H200's shared memory and spills nothing in an sm_90 build
# specialised as a launch (checked on 2026-12-05 without a GPU; not timed).
MORE_IN_FLIGHT = [(16, 256, 4, 4, 1), (16, 256, 4, 5, 1), (16, 512, 4, 3, 1), (32, 128, 4, 6, 1), (32, 256, 4, 4, 1),
                  (16, 128, 4, 8, 1)]


def candidates() -> list[dict]:
    """(today's entry, gate_up candidates, down candidates). Today's is the shipped invariant entry (until 2026-12-04
    the 16-token tuned entry stood in for it, whose gate_up BK differs). The gate_up K splits give a decode step's 9
    active experts ~600-2,300 short programs instead of ~144 long ones, finished by the last program of a tile
    (reviewer_kernels/fused_moe.py). Measured on 2026-12-04 (with down splits too, since removed): none beat the entry
    (bench/results/moe_invariant_tiles_split_finish_h200_20261204_170057.json). The unsplit 8-warp sets below
    were added on 2026-12-04 for register spills read from an sm_90 build without a launch's specialisation; built as a
    launch builds it, the entry's gate_up uses 128 registers in 4 warps and spills nothing (docs/kernels.md), so they
    are plain candidates."""
    base = fm.invariant_config(torch.cuda.get_device_name(), fm.shape_key(E, H, I, K, True), K)
    gate_up = [dict(base["gate_up"])] + [
        dict(BN=bn, BK=bk, warps=wp, stages=st, split=sp) for bn, bk, wp, st, sp in [
            (32, 256, 4, 1, 8), (32, 256, 4, 2, 4), (64, 256, 4, 1, 8), (16, 256, 4, 1, 8), (32, 128, 4, 2, 8),
            (32, 512, 8, 1, 4), (64, 128, 4, 3, 4), (32, 256, 8, 3, 1), (32, 256, 8, 2, 1), (64, 256, 8, 3, 1),
            *MORE_IN_FLIGHT]]
    down = [dict(base["down"])] + [dict(BN=bn, BK=bk, warps=wp, stages=st) for bn, bk, wp, st in [
        (32, 128, 4, 3), (128, 64, 4, 3), (64, 256, 4, 3), (32, 256, 4, 3), (128, 128, 8, 3), (32, 512, 4, 1),
        (64, 128, 4, 4), (32, 64, 4, 8)]]
    return base, gate_up, down


def entry_us(direct: dict, sorted_: dict, direct_tokens: int, tokens: list[int]) -> float:
    """us per layer summed over the token counts, each in the mode the entry takes for it."""
    return sum((direct if m <= direct_tokens else sorted_)[f"us_{m}"] for m in tokens)


def summed_bits_match(layer, x, route, entry: dict) -> bool:
    """Whether the slots summed inside the down kernel give the slot sum's bits, at 1, 5 and 16 tokens in both modes."""
    w, ids = route

    def run(m: int, mode: str, summed: bool) -> torch.Tensor:
        config = dict(entry, decode=False, direct=mode == "direct", sum_in_down=summed)
        return fm.fused_moe(x[:m], layer["gate_up"], layer["down"], w[:m], ids[:m], layer["shared"], config=config)

    return all(torch.equal(run(m, mode, True), run(m, mode, False)) for m in (1, 5, 16) for mode in ("direct", "sorted"))


def choose_sum_in_down(summed: dict, same_bits: bool, curves: dict, direct_tokens: int,
                       tokens: list[int]) -> tuple[bool, dict]:
    """Whether the entry sums the slots inside the down kernel (one launch fewer a layer): only if it builds, gives
    the slot sum's bits, and is faster over the entry's own curve. summed: its curves by mode ("direct", "sorted")."""
    record = {"summed": summed, "same_bits": same_bits}
    if any("error" in r for r in summed.values()):
        return False, record
    plain = entry_us(curves["best_direct_traced"], curves["best_sorted_traced"], direct_tokens, tokens)
    fused = entry_us(summed["direct"], summed["sorted"], direct_tokens, tokens)
    return same_bits and fused < plain, dict(record, entry_us=plain, summed_us=fused)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hot", type=int, default=50, help="hot experts per layer (the trace's locality)")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    layers = make_layers(args.layers, device)
    x = torch.randn(16, H, device=device, dtype=torch.bfloat16)
    traced = routing(args.layers, 16, args.hot, g, device)
    uniform = routing(args.layers, 16, None, g, device)
    distinct = statistics.mean(ids.unique().numel() for _, ids in traced)
    print(f"hot set {args.hot}: {distinct:.1f} distinct experts per 16 tokens", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    base, gate_up, down = candidates()
    base = {k: v for k, v in base.items() if k != "decode"}

    def measure(gu, dn, mode: str, ms, routes, sum_in_down: bool = False) -> dict:
        cfg = dict(base, gate_up=gu, down=dn, decode=False, direct=mode == "direct",
                   direct_tokens=16 if mode == "direct" else 1, sum_in_down=sum_in_down)
        if mode.startswith("gemv"):  # every token through the one-token programs (gu, dn unused); gemv_blocks:
            # moe_decode.blocks_moe, each expert's rows read once a call (backend/models/numerics.py QWEN_EXPERTS)
            cfg = dict(base, decode=None, **QWEN_EXPERTS[mode])
        row = {"gate_up": gu, "down": dn, "mode": mode, "sum_in_down": sum_in_down}
        try:
            for m in ms:
                row[f"us_{m}"] = time_graph_us(run_layers(layers, x, routes, cfg, m)) / args.layers
            row["rows_bitwise_alone"] = all(rows_alone_equal(layers[0], x, *routes[0], cfg, m) for m in (2, 5, 16))
        except Exception as exc:  # a tile set that does not compile or fit
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        print(json.dumps(row), flush=True)
        return row

    rows = []
    # gate_up tiles (today's down tiles), both modes, 1 and 16 tokens; then down tiles for the best gate_up
    for gu in gate_up:
        for mode in ("direct", "sorted"):
            rows.append(measure(gu, base["down"], mode, [1, 16], traced))
    ok = [r for r in rows if "error" not in r and r["rows_bitwise_alone"]]
    best_gu = min(ok, key=lambda r: r["us_16"] + r["us_1"])["gate_up"]
    for dn in down[1:]:
        for mode in ("direct", "sorted"):
            rows.append(measure(best_gu, dn, mode, [1, 16], traced))
    ok = [r for r in rows if "error" not in r and r["rows_bitwise_alone"]]
    best = min(ok, key=lambda r: r["us_16"] + r["us_1"])
    today = rows[0]  # today's tiles, direct
    curves = {}
    for name, gu, dn in [("today", today["gate_up"], today["down"]), ("best", best["gate_up"], best["down"])]:
        for mode in ("direct", "sorted"):
            curves[f"{name}_{mode}_traced"] = measure(gu, dn, mode, tokens, traced)
            curves[f"{name}_{mode}_uniform"] = measure(gu, dn, mode, [16], uniform)
    # the table entry: direct blocks while they are no slower than sorted ones (the row bits are the same either way)
    direct_tokens = 0
    for m in tokens:
        if curves["best_direct_traced"].get(f"us_{m}", float("inf")) > curves["best_sorted_traced"].get(f"us_{m}", 0):
            break
        direct_tokens = m
    entry = {"direct": direct_tokens > 0, "direct_tokens": max(direct_tokens, 1), "BM": base["BM"],
             "gate_up": best["gate_up"], "down": best["down"]}
    # the one-token kernels for every token count (gemv_tokens): a decode step at the one-token path's cost, a verify
    # at whatever 16 tokens of one-token programs cost. Recorded, never chosen here: it trades the plain step against
    # the verify, which `reviewer bench` and the replay weigh
    curves["gemv_traced"] = measure(None, None, "gemv", tokens, traced)
    curves["gemv_blocks_traced"] = measure(None, None, "gemv_blocks", tokens, traced)
    summed = {mode: measure(best["gate_up"], best["down"], mode, tokens, traced, sum_in_down=True)
              for mode in ("direct", "sorted")}
    entry["sum_in_down"], curves["best_sum_in_down"] = choose_sum_in_down(
        summed, summed_bits_match(layers[0], x, traced[0], entry), curves, direct_tokens, tokens)
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"benchmark": "moe_invariant_tiles", "device": torch.cuda.get_device_name(), "date": now.isoformat(),
              "command": "python " + " ".join(sys.argv), "torch": torch.__version__,
              "shape": {"experts": E, "hidden": H, "intermediate": I, "top_k": K, "shared": True},
              "routing": f"per layer top-{K} among {args.hot} hot experts ({distinct:.1f} distinct per 16 tokens); "
                         f"'uniform' rows: among all {E}",
              "timing": f"us per layer, CUDA-graph replay of {args.layers} distinct layers, median",
              "score": "us_1 + us_16 among candidates whose rows are bitwise the row alone",
              "rows": rows, "curves": curves, "best": best,
              "entry": {fm.shape_key(E, H, I, K, True) + "_invariant": entry}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name().lower().replace("nvidia ", "")).strip("_")
    path = out / f"moe_invariant_tiles_{gpu}_{now.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    for name in ("best_direct_traced", "best_sorted_traced", "gemv_traced", "gemv_blocks_traced"):
        print(f"{name}: " + ", ".join(f"{m} tokens {curves[name].get(f'us_{m}', float('nan')):.1f} us"
                                      for m in tokens), flush=True)
    print("table entry (reviewer_kernels/fused_moe_configs.json, under this device):", json.dumps(result["entry"]),
          "\nwrote", path, flush=True)


if __name__ == "__main__":
    main()
