"""Launch-shape sweeps for the small kernels of a decode step / block verify, and the GEMVs around them (GPU).

Each case is timed as a CUDA graph of `--inner` back-to-back calls (as the fast path replays them), median over
`--reps` replays, per call. What it measures:

  gdn        reviewer_kernels/gdn_state.gdn_recurrent at the Qwen3.6-35B-A3B shape (32 value heads, 128 x 128 state),
             T = 1 (decode) and 16 (verify, every position), over block_v x num_warps x prefetch
  route      reviewer_kernels/moe_routing.route_topk, 256 experts, top-8, T = 1 and 16, over block_t x num_warps
  attention  reviewer_kernels/block_attention.block_attention at the SmolLM2 and 35B-A3B head shapes, T = 1 and 16
  gemv       x [M, K] @ W^T for the step's projection shapes, M = 1 and 16: F.linear (cuBLAS as torch picks it),
             F.linear with torch's cuBLASLt preference, and a pre-transposed weight (another cuBLAS kernel choice)
  moe_decode reviewer_kernels/moe_decode.py's tiles (one token, 35B-A3B experts, weights from HBM) vs the grouped path
  gemv_fused reviewer_kernels/gemv.py's tiles (the 35B-A3B output projections with their gated norm / sigmoid gate, one
             weight per call) vs the eager prologue + F.linear
  llama_one_token  reviewer_kernels/norm_gemv.py's and reviewer_kernels/gemv.py's tiles at the SmolLM2-135M decode
             step's five projections (one weight per call) vs F.linear alone
  rows       reviewer_kernels/rows_linear.py's launch shapes against those kernels, calls of 1..16 rows
  rows_35b   reviewer_kernels/rows_linear.py against cuBLAS (and gemv) at the 35B-A3B dense projections
  wide       reviewer_kernels/wide_linear.py's launch shapes at the 35B-A3B dense projections, 16 padded rows, against
             cuBLAS; row invariance and error checked
  gdn_prefill reviewer_kernels/gdn_state.gdn_chunked (the chunk terms, the solve and the walk) at the 35B-A3B shape,
             prefill pieces of 1,700 and 1,024 tokens, over the walk's form (fused / split), its warps, columns
             and pipeline stages, the split outputs' tiles (GDN_PREFILL_CASES); error against the fp32 PyTorch loop
  glue       the padded steps' glue kernels (QwenNumerics.glue_kernels) at the 35B-A3B shape: the gated norm over rows
             a program x warps against the compiled glue, the slot sum (with / without the next norm) over warps, the
             router with the norm from partial sums over its K step; every candidate checked row for row

    python bench/kernel_sweep.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reviewer_kernels.block_attention import block_attention  # noqa: E402
from reviewer_kernels.gdn_state import gdn_recurrent  # noqa: E402
from reviewer_kernels.moe_routing import route_topk  # noqa: E402


def graph_time_us(fn, inner: int, reps: int) -> float:
    """Median microseconds per call of fn() over `reps` replays of a CUDA graph holding `inner` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / inner)
    return statistics.median(times)


def cycling(ws: list) -> callable:
    """A function returning the next of ws on each call: every call of a sweep reads its own weight (not from L2)."""
    state = {"n": 0}

    def weight():
        state["n"] += 1
        return ws[state["n"] % len(ws)]
    return weight


def sweep_gdn(inner, reps):
    rows = []
    hk, hv, dk, dv = 16, 32, 128, 128
    for T in (1, 16):
        q, k = torch.randn(T, hk, dk, device="cuda").bfloat16(), torch.randn(T, hk, dk, device="cuda").bfloat16()
        v = torch.randn(T, hv, dv, device="cuda").bfloat16()
        g, beta = -torch.rand(T, hv, device="cuda"), torch.rand(T, hv, device="cuda").bfloat16()
        state = torch.randn(hv, dk, dv, device="cuda")
        snaps = torch.empty(T, hv, dk, dv, device="cuda")
        every = T > 1
        out_state = snaps if every else state.clone()
        ref = None
        for block_v, warps, prefetch in itertools.product((8, 16, 32, 64), (1, 2, 4, 8), (False, True)):
            s_in = state.clone()
            run = lambda: gdn_recurrent(q, k, v, g, beta, s_in, out_state, every, block_v=block_v,  # noqa: E731
                                        num_warps=warps, prefetch=prefetch)
            out = run()
            if ref is None:
                ref = out.float().clone()
            err = (out.float() - ref).abs().max().item()
            rows.append(dict(kernel="gdn_recurrent", T=T, block_v=block_v, num_warps=warps, prefetch=prefetch,
                             us=round(graph_time_us(run, inner, reps), 2), max_diff_vs_first=err))
            print(rows[-1], flush=True)
    return rows


# gdn_prefill's candidates: gdn_state's launch settings each case sets (the rest keep the shipped values)
# (the solve's choices were swept on 2026-12-04: kernel_sweep_gdn_prefill_solve_h200_20261204.json); the fused walk
# as shipped, then the split walk over its launch shapes
GDN_PREFILL_CASES = [dict(WALK="fused"), dict(WALK="split"), dict(WALK="split", CHUNK_WARPS=4),
                     dict(WALK="split", WALK_K=32), dict(WALK="split", CHUNK_V=32),
                     dict(WALK="split", CHUNK_DOT="3xtf32"), dict(WALK="split", CHUNK_DOT="3xtf32", CHUNK_V=32),
                     dict(WALK="split", CHUNK_DOT="tf32"), dict(WALK="split", OUT_DOT="ieee"),
                     dict(WALK="split", OUT_V=128, OUT_WARPS=8), dict(WALK="split", OUT_V=32)]


def sweep_gdn_prefill(inner, reps):
    from reviewer_kernels import gdn_state

    rows = []
    hk, hv, dk, dv = 16, 32, 128, 128
    names = sorted({name for case in GDN_PREFILL_CASES for name in case})
    saved = {n: getattr(gdn_state, n) for n in names}
    for T in (1700, 1024):  # an agent turn (one prefill piece on CUDA), the largest piece before 2026-12-04
        q, k = torch.randn(T, hk, dk, device="cuda").bfloat16(), torch.randn(T, hk, dk, device="cuda").bfloat16()
        v = torch.randn(T, hv, dv, device="cuda").bfloat16()
        g, beta = -torch.rand(T, hv, device="cuda") * 0.5, torch.rand(T, hv, device="cuda").bfloat16()
        state = torch.randn(hv, dk, dv, device="cuda") * 0.1
        ref_state = state.clone()
        ref = gdn_state.gdn_chunked(q, k, v, g, beta, ref_state, use_triton=False).float()
        # ("tf32x3" for the walk's products hit an illegal memory access on the H200, Triton 3.6: not swept)
        for case in GDN_PREFILL_CASES:
            for name in names:
                setattr(gdn_state, name, case.get(name, saved[name]))
            row = dict(kernel="gdn_chunked", T=T, **{n.lower(): getattr(gdn_state, n) for n in names})
            try:
                s_out = state.clone()
                out = gdn_state.gdn_chunked(q, k, v, g, beta, s_out, use_triton=True).float()
                row["max_diff_vs_fp32_loop"] = dict(
                    out=(out - ref).abs().max().item(), out_scale=ref.abs().max().item(),
                    state=(s_out - ref_state).abs().max().item(), state_scale=ref_state.abs().max().item())
                s_run = state.clone()
                run = lambda: gdn_state.gdn_chunked(q, k, v, g, beta, s_run, use_triton=True)  # noqa: E731
                row["us"] = round(graph_time_us(run, inner, reps), 1)
            except Exception as e:  # a launch shape that does not fit (shared memory) is a row, not a crash
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(rows[-1], flush=True)
    for name, value in saved.items():
        setattr(gdn_state, name, value)
    return rows


def sweep_route(inner, reps):
    rows = []
    for T in (1, 16):
        logits = torch.randn(T, 256, device="cuda").bfloat16()
        for block_t, warps in itertools.product((1, 16), (1, 2, 4)):
            run = lambda: route_topk(logits, 8, True, block_t=block_t, num_warps=warps)  # noqa: E731
            rows.append(dict(kernel="route_topk", T=T, block_t=block_t, num_warps=warps,
                             us=round(graph_time_us(run, inner, reps), 2)))
            print(rows[-1], flush=True)
    return rows


def sweep_attention(inner, reps):
    rows = []
    for name, heads, kv_heads, d in (("smollm2-135m", 9, 3, 64), ("qwen3.6-35b-a3b", 16, 2, 256)):
        for T in (1, 16):
            start, span = 512, 768
            q = torch.randn(heads, T, d, device="cuda").bfloat16()
            kn, vn = (torch.randn(kv_heads, T, d, device="cuda").bfloat16() for _ in range(2))
            kc, vc = (torch.randn(kv_heads, 2048, d, device="cuda").bfloat16() for _ in range(2))
            st = torch.tensor([start], device="cuda")
            run = lambda: block_attention(q, kn, vn, kc, vc, st, span)  # noqa: E731
            rows.append(dict(kernel="block_attention", shape=name, T=T, start=start, span=span,
                             us=round(graph_time_us(run, inner, reps), 2)))
            print(rows[-1], flush=True)
    return rows


GEMV_SHAPES = {  # (N, K): output features, input features
    "qwen35b router": (256, 2048), "qwen35b deltanet in": (12352, 2048), "qwen35b deltanet out": (2048, 4096),
    "qwen35b attention qkv": (17408, 2048), "qwen35b attention out": (2048, 8192),
    "smollm2 qkv": (960, 576), "smollm2 o": (576, 576), "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
}


def sweep_gemv(inner, reps):
    rows = []
    for (name, (n, k)), m in itertools.product(GEMV_SHAPES.items(), (1, 16)):
        w = torch.randn(n, k, device="cuda").bfloat16() / k ** 0.5
        wt = w.t().contiguous()
        x = torch.randn(m, k, device="cuda").bfloat16()
        variants = {"F.linear": lambda: F.linear(x, w), "x @ W^T stored transposed": lambda: x @ wt}
        row = dict(kernel="gemv", shape=name, M=m, N=n, K=k, weight_MB=round(n * k * 2 / 1e6, 2))
        for label, fn in variants.items():
            row[label] = round(graph_time_us(fn, inner, reps), 2)
        try:
            torch.backends.cuda.preferred_blas_library("cublaslt")
            row["F.linear cublaslt"] = round(graph_time_us(lambda: F.linear(x, w), inner, reps), 2)
        finally:
            torch.backends.cuda.preferred_blas_library("cublas")
        rows.append(row)
        print(row, flush=True)
    return rows


def sweep_moe_decode(inner, reps):
    """reviewer_kernels/moe_decode.py's tiles at the 35B-A3B shape (256 experts, H 2048, I 512, top-8 + shared expert),
    one token, against the grouped path at one token. Each of the `inner` calls routes to different random experts of
    one layer's weights (1.5 GB), so the weights come from HBM as they do in a 40-layer step."""
    from reviewer_kernels.fused_moe import fused_moe
    from reviewer_kernels.moe_reference import SharedExpert
    e, h, i, k = 256, 2048, 512, 8
    gate_up = torch.randn(e, 2 * i, h, device="cuda").bfloat16() / h ** 0.5
    down = torch.randn(e, h, i, device="cuda").bfloat16() / i ** 0.5
    shared = [SharedExpert(*(torch.randn(*s, device="cuda").bfloat16() / s[1] ** 0.5
                             for s in ((i, h), (i, h), (h, i), (1, h)))) for _ in range(inner)]
    x = torch.randn(1, h, device="cuda").bfloat16()
    calls = [(torch.randperm(e, device="cuda")[:k][None],
              torch.softmax(torch.randn(1, k, device="cuda"), -1).bfloat16()) for _ in range(inner)]
    state = {"n": 0}

    def run(decode):
        ids, w = calls[state["n"] % inner]
        sh = shared[state["n"] % inner]
        state["n"] += 1
        return fused_moe(x, gate_up, down, w, ids, sh, config={**fm_default(), "decode": decode})

    rows = []
    ref = run(False).float()
    state["n"] = 0
    base = dict(kernel="moe_decode", weights_MB_per_call=round(9 * 3 * i * h * 2 / 1e6, 1))
    rows.append(dict(base, variant="grouped path (fused_moe.py at M=1)", us=round(graph_time_us(
        lambda: run(False), inner, reps), 2)))
    print(rows[-1], flush=True)
    best_gu = {"BN": 2, "warps": 4}
    best_dn = {"BH": 2, "warps": 4}
    for part in ("gate_up", "down"):
        grid = ([{"BN": bn, "warps": wp} for bn, wp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8))]
                if part == "gate_up" else
                [{"BH": bh, "warps": wp} for bh, wp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8))])
        best_us = float("inf")
        for tile in grid:
            tiles = {"gate_up": tile if part == "gate_up" else best_gu, "down": tile if part == "down" else best_dn}
            state["n"] = 0
            err = ((run(tiles).float() - ref).norm() / ref.norm()).item()
            us = graph_time_us(lambda: run(tiles), inner, reps)
            rows.append(dict(base, variant=f"decode, sweeping {part}", tiles=tiles, us=round(us, 2),
                             rel_err_vs_grouped=err))
            print(rows[-1], flush=True)
            if us < best_us and err < 1e-2:
                best_us = us
                best_gu, best_dn = tiles["gate_up"], tiles["down"]
    rows.append(dict(base, variant="best", tiles={"gate_up": best_gu, "down": best_dn}))
    print(rows[-1], flush=True)
    return rows


def fm_default():
    """The tuned grouped-path config for one token at the 35B-A3B shape (what fused_moe picks on this device)."""
    from reviewer_kernels.fused_moe import get_config, shape_key
    return dict(get_config(torch.cuda.get_device_name(), shape_key(256, 2048, 512, 8, True), 1, 8))


def sweep_gemv_fused(inner, reps):
    """reviewer_kernels/gemv.py at the 35B-A3B output projections (2048 x 4096), one token, each call on its own weight
    (as in a 40-layer step: not L2-resident), against the eager prologue + F.linear and against F.linear alone."""
    from backend.models.qwen3_5_moe import gated_rms_norm
    from reviewer_kernels.gemv import gemv
    n, kdim, d = 2048, 4096, 128
    ws = [torch.randn(n, kdim, device="cuda").bfloat16() / kdim ** 0.5 for _ in range(inner)]
    x, z = torch.randn(1, kdim, device="cuda").bfloat16(), torch.randn(1, kdim, device="cuda").bfloat16()
    nw = (torch.rand(d, device="cuda") + 0.5).bfloat16()
    weight = cycling(ws)
    rows = []
    base = dict(kernel="gemv_fused", N=n, K=kdim, weight_MB=round(n * kdim * 2 / 1e6, 1))
    baselines = {
        "F.linear alone": lambda: F.linear(x, weight()),
        "gated_rms_norm (eager) + F.linear": lambda: F.linear(
            gated_rms_norm(x.view(-1, d), z.view(-1, d), nw, 1e-6).view(1, -1), weight()),
        "x * sigmoid(g) (eager) + F.linear": lambda: F.linear(x * torch.sigmoid(z), weight()),
    }
    for label, fn in baselines.items():
        rows.append(dict(base, variant=label, us=round(graph_time_us(fn, inner, reps), 2)))
        print(rows[-1], flush=True)
    for prologue in ("gated_norm", "sigmoid_gate"):
        kw = {"gate": z, "norm_weight": nw, "eps": 1e-6} if prologue == "gated_norm" else {"gate": z}
        for bn, wp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16)):
            tiles = {"BN": bn, "warps": wp}
            rows.append(dict(base, variant=f"gemv {prologue}", tiles=tiles, us=round(graph_time_us(
                lambda: gemv(x, weight(), use_triton=True, tiles=tiles, **kw), inner, reps), 2)))
            print(rows[-1], flush=True)
    return rows


def sweep_llama_one_token(inner, reps):
    """The SmolLM2-135M decode step's projections through reviewer_kernels/norm_gemv.py (norm + q/k/v + RoPE, norm +
    gate/up + SwiGLU, norm + LM head) and reviewer_kernels/gemv.py (output and down projections + residual), over tiles,
    each call on its own weight (a 30-layer step does not stay in L2), against F.linear alone on the same weights
    (cuBLAS: what the compiled-glue path runs for the matmul, before its norm / RoPE / SiLU / residual kernels)."""
    from backend.models.llama import rope_tables
    from reviewer_kernels.gemv import gemv
    from reviewer_kernels.norm_gemv import norm_gemv
    h, heads, kv_heads, d, inter, vocab = 576, 9, 3, 64, 1536, 49152
    cos, sin = rope_tables(1.0 / (100000 ** (torch.arange(0, d, 2, device="cuda").float() / d)), 1.0, 2048,
                           torch.bfloat16)
    pos = torch.tensor([700], device="cuda")
    x = torch.randn(1, h, device="cuda").bfloat16()
    nw = (torch.rand(h, device="cuda") + 0.5).bfloat16()
    a_o, a_down = torch.randn(1, heads * d, device="cuda").bfloat16(), torch.randn(1, inter, device="cuda").bfloat16()
    cases = {  # name: (rows N, columns K, the call taking (weight, tiles), its activation row for F.linear)
        "qkv norm+rope": ((heads + 2 * kv_heads) * d, h, lambda w, t: norm_gemv(
            x, nw, w, 1e-5, rope=(cos, sin, pos, (heads + kv_heads) * d), use_triton=True, tiles=t), x),
        "gate_up norm+swiglu": (2 * inter, h, lambda w, t: norm_gemv(x, nw, w, 1e-5, swiglu=True, use_triton=True,
                                                                     tiles=t), x),
        "o + residual": (h, heads * d, lambda w, t: gemv(a_o, w, residual=x, use_triton=True, tiles=t), a_o),
        "down + residual": (h, inter, lambda w, t: gemv(a_down, w, residual=x, use_triton=True, tiles=t), a_down),
        "lm_head norm": (vocab, h, lambda w, t: norm_gemv(x, nw, w, 1e-5, use_triton=True, tiles=t), x),
    }
    rows = []
    for name, (n, k, call, inp) in cases.items():
        count = 2 if name == "lm_head norm" else inner  # the LM head: one per step, 57 MB, never in L2
        ws = [torch.randn(n, k, device="cuda").bfloat16() / k ** 0.5 for _ in range(count)]
        weight = cycling(ws)
        base = dict(kernel="llama_one_token", case=name, N=n, K=k, weight_MB=round(n * k * 2 / 1e6, 2))
        rows.append(dict(base, variant="F.linear alone", us=round(graph_time_us(
            lambda: F.linear(inp, weight()), inner, reps), 2)))
        print(rows[-1], flush=True)
        for bn, wp in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8, 16)):
            tiles = {"BN": bn, "warps": wp}
            rows.append(dict(base, variant="ours", tiles=tiles, us=round(graph_time_us(
                lambda: call(weight(), tiles), inner, reps), 2)))
            print(rows[-1], flush=True)
        best = min((r for r in rows if r.get("case") == name and r["variant"] == "ours"), key=lambda r: r["us"])
        rows.append(dict(base, variant="best", tiles=best["tiles"], us=best["us"]))
        print(rows[-1], flush=True)
    return rows


def sweep_rows(inner, reps):
    """reviewer_kernels/rows_linear.py (tensor cores, split-K in a fixed order) over launch shapes, against
    reviewer_kernels/norm_gemv.py and reviewer_kernels/gemv.py at their tiles, at the SmolLM2-135M step's five
    projections (and gemv at the 35B-A3B output projections), for calls of T = 1..16 input rows (a decode step and
    verify blocks), each call on its own weight; and whether row 0 of a 16-row call equals the one-row call bit for bit
    (batch invariance). (A first version also swept rows per program of the CUDA-core kernels, 1..16 rows looped inside
    one program over a tile loaded once: no faster at any T, bench/results/kernel_sweep_20261201_144447.json, and
    removed.)"""
    from backend.models.llama import rope_tables
    from reviewer_kernels.gemv import GEMV_TILES, gemv
    from reviewer_kernels.norm_gemv import LARGE_TILES, NORM_GEMV_TILES, norm_gemv
    h, heads, kv_heads, d, inter, vocab = 576, 9, 3, 64, 1536, 49152
    cos, sin = rope_tables(1.0 / (100000 ** (torch.arange(0, d, 2, device="cuda").float() / d)), 1.0, 2048,
                           torch.bfloat16)
    pos = torch.arange(700, 716, device="cuda")
    nw = (torch.rand(h, device="cuda") + 0.5).bfloat16()
    nw_q = (torch.rand(128, device="cuda") + 0.5).bfloat16()
    act = lambda k: torch.randn(16, k, device="cuda").bfloat16()  # noqa: E731
    x, a_o, a_down, x2, z2, r2 = act(h), act(heads * d), act(inter), act(4096), act(4096), act(2048)
    qkv = (heads + kv_heads) * d
    cases = {  # name: (N, K, tiles, call(weight, tiles, T))
        "llama qkv norm+rope": ((heads + 2 * kv_heads) * d, h, NORM_GEMV_TILES, lambda w, t, T: norm_gemv(
            x[:T], nw, w, 1e-5, rope=(cos, sin, pos, qkv), use_triton=True, tiles=t)),
        "llama gate_up norm+swiglu": (2 * inter, h, NORM_GEMV_TILES, lambda w, t, T: norm_gemv(
            x[:T], nw, w, 1e-5, swiglu=True, use_triton=True, tiles=t)),
        "llama o + residual": (h, heads * d, GEMV_TILES, lambda w, t, T: gemv(a_o[:T], w, residual=x[:T],
                                                                              use_triton=True, tiles=t)),
        "llama down + residual": (h, inter, GEMV_TILES, lambda w, t, T: gemv(a_down[:T], w, residual=x[:T],
                                                                             use_triton=True, tiles=t)),
        "llama lm_head norm": (vocab, h, LARGE_TILES, lambda w, t, T: norm_gemv(x[:T], nw, w, 1e-5, use_triton=True,
                                                                                tiles=t)),
        "35b out gated_norm + residual": (2048, 4096, GEMV_TILES, lambda w, t, T: gemv(
            x2[:T], w, gate=z2[:T], norm_weight=nw_q, eps=1e-6, residual=r2[:T], use_triton=True, tiles=t)),
        "35b o sigmoid_gate + residual": (2048, 4096, GEMV_TILES, lambda w, t, T: gemv(
            x2[:T], w, gate=z2[:T], residual=r2[:T], use_triton=True, tiles=t)),
    }
    from reviewer_kernels.rows_linear import rows_linear
    mma = {  # the same projections through reviewer_kernels/rows_linear.py (tensor cores, split-K in a fixed order)
        "mma qkv norm+rope": ((heads + 2 * kv_heads) * d, h, lambda w, t, T: rows_linear(
            x[:T], w, nw, 1e-5, rope=(cos, sin, pos, qkv), use_triton=True, tiles=t)),
        "mma gate_up norm+swiglu": (2 * inter, h, lambda w, t, T: rows_linear(
            x[:T], w, nw, 1e-5, swiglu=True, use_triton=True, tiles=t)),
        "mma o + residual": (h, heads * d, lambda w, t, T: rows_linear(a_o[:T], w, residual=x[:T], use_triton=True,
                                                                       tiles=t)),
        "mma down + residual": (h, inter, lambda w, t, T: rows_linear(a_down[:T], w, residual=x[:T],
                                                                      use_triton=True, tiles=t)),
        "mma lm_head norm": (vocab, h, lambda w, t, T: rows_linear(x[:T], w, nw, 1e-5, use_triton=True, tiles=t)),
    }
    out = []
    for name, (n, k, call) in mma.items():
        count = 2 if "lm_head" in name else inner
        ws = [torch.randn(n, k, device="cuda").bfloat16() / k ** 0.5 for _ in range(count)]
        weight = cycling(ws)

        def split(bk, splits, **kw):  # K in `splits` ranges of whole BK steps
            return dict(kw, BK=bk, SPLITS=splits, KS=-(-(-(-k // bk)) // splits) * bk)
        # stages 0: the K loop unrolled (the first sweep, kernel_sweep_20261201_145720.json, where 4 warps won
        # nearly everywhere); 3: software-pipelined
        variants = [None]
        for bn, bk, splits, stages in itertools.product((16, 32), (64, 128, 256), (1, 2), (0, 3)):
            if "lm_head" in name and splits > 1:
                continue
            variants.append(split(bk, splits, BN=bn, warps=4, stages=stages))
        if "lm_head" in name:
            variants += [split(bk, 1, BN=bn, warps=wp, stages=st) for bn, bk, wp, st in itertools.product(
                (64, 128), (64, 128), (4, 8), (0, 3))]
        for tiles in variants:
            invariant = bool(torch.equal(call(ws[0], tiles, 16)[:1], call(ws[0], tiles, 1)))
            row = dict(kernel="rows", case=name, N=n, K=k, tiles=tiles or "plan()", row0_of_16_equals_alone=invariant)
            for T in (1, 16):
                row[f"us_T{T}"] = round(graph_time_us(lambda: call(weight(), tiles, T), inner, reps), 2)
            out.append(row)
            print(row, flush=True)
    for name, (n, k, tiles0, call) in cases.items():
        count = 2 if "lm_head" in name else inner
        ws = [torch.randn(n, k, device="cuda").bfloat16() / k ** 0.5 for _ in range(count)]
        weight = cycling(ws)
        for tiles in (tiles0,):  # the one-row-per-program kernels at their tiles, for comparison
            # row 0 of a 16-row call against the one-row call (the tests check every row at the default tiles)
            invariant = bool(torch.equal(call(ws[0], tiles, 16)[:1], call(ws[0], tiles, 1)))
            row = dict(kernel="rows", case=name, N=n, K=k, tiles=tiles, row0_of_16_equals_alone=invariant)
            for T in (1, 2, 4, 8, 16):
                row[f"us_T{T}"] = round(graph_time_us(lambda: call(weight(), tiles, T), inner, reps), 2)
            out.append(row)
            print(row, flush=True)
    return out


def sweep_rows_35b(inner, reps):
    """reviewer_kernels/rows_linear.py at the Qwen3.6-35B-A3B dense projections (bandwidth-bound sizes, unlike
    SmolLM2's) against cuBLAS (F.linear) and reviewer_kernels/gemv.py, T = 1 and 16, each call on its own weight."""
    from reviewer_kernels.gemv import gemv
    from reviewer_kernels.rows_linear import rows_linear
    cases = {  # name: (N, K, norm before it, residual after it)
        "deltanet in_proj (norm)": (12352, 2048, True, False),
        "attention q/k/v/gate (norm)": (9216, 2048, True, False),
        "out_proj + residual": (2048, 4096, False, True),
        "lm_head (norm)": (248320, 2048, True, False),
    }
    out = []
    for name, (n, k, norm, residual) in cases.items():
        count = 2 if "lm_head" in name else min(inner, 10)
        ws = [torch.randn(n, k, device="cuda").bfloat16() / k ** 0.5 for _ in range(count)]
        weight = cycling(ws)
        x, r = torch.randn(16, k, device="cuda").bfloat16(), torch.randn(16, n, device="cuda").bfloat16()
        nw = (torch.rand(k, device="cuda") + 0.5).bfloat16()
        calls = {
            "F.linear": lambda T: F.linear(x[:T], weight()),
            "rows_linear plan()": lambda T: rows_linear(x[:T], weight(), nw if norm else None, 1e-6,
                                                        residual=r[:T] if residual else None, use_triton=True),
        }
        if residual:
            calls["gemv"] = lambda T: gemv(x[:T], weight(), residual=r[:T], use_triton=True)
        for label, fn in calls.items():
            row = dict(kernel="rows_35b", case=name, N=n, K=k, weight_MB=round(n * k * 2 / 1e6, 1), variant=label)
            for T in (1, 2, 4, 16):
                row[f"us_T{T}"] = round(graph_time_us(lambda: fn(T), min(inner, 10), reps), 2)
            out.append(row)
            print(row, flush=True)
    return out


# (BN, BK, SPLITS, stages): 16 or 32 weight rows a tile and K unsplit. The out-projections' tuned split-K shape runs
# at ~2x its bytes in the step (8.2 us a layer against 4.0, step_budget 2026-12-05), and a split's finish (an atomic,
# then the partials read back) is a chain of round trips on every tile's path; 2048 / 16 = 128 tiles fill the SMs
# without it (mma.sync instead of wgmma at 16 rows, 40-75 KB of shared memory: several programs an SM).
NARROW_WIDE_TILES = [(16, 256, 1, 4), (16, 256, 1, 6), (16, 256, 1, 8), (16, 128, 1, 8), (16, 512, 1, 4),
                     (32, 256, 1, 4), (32, 256, 1, 6), (32, 128, 1, 8)]


def sweep_wide(inner, reps):
    """reviewer_kernels/wide_linear.py at the Qwen3.6-35B-A3B shape's dense projections on 16 padded rows, as the
    invariant steps call them, against cuBLAS (F.linear, what those steps ran before), each call on its own weight.
    Every variant is checked: its rows equal the same rows computed among other neighbours (row invariance), and it is
    within bf16 rounding of the float32 product."""
    from reviewer_kernels.wide_linear import wide_linear
    cases = {"deltanet in_proj": (12352, 2048), "attention q/k/v/gate": (9216, 2048), "out_proj": (2048, 4096)}
    out = []
    for name, (n, k) in cases.items():
        count = min(inner, 10)
        ws = [torch.randn(n, k, device="cuda").bfloat16() / k ** 0.5 for _ in range(count)]
        weight = cycling(ws)
        x = torch.randn(16, k, device="cuda").bfloat16()
        row = dict(kernel="wide", case=name, N=n, K=k, weight_MB=round(n * k * 2 / 1e6, 1), variant="F.linear",
                   us_T16=round(graph_time_us(lambda: F.linear(x, weight()), count, reps), 2))
        out.append(row)
        print(row, flush=True)
        ref = x.float() @ ws[0].float().t()
        others = torch.randn_like(x)
        others[5] = x[5]
        splits = (1, 2, 4) if n > 4096 else (2, 4, 8)
        shapes = list(itertools.product((64, 128), (128, 256), splits, (3, 4, 5))) + NARROW_WIDE_TILES
        for bn, bk, split, stages in shapes:
            tiles = {"BN": bn, "BK": bk, "SPLITS": split, "stages": stages, "warps": 4}
            try:
                y = wide_linear(x, ws[0], use_triton=True, tiles=tiles)
                y5 = wide_linear(others, ws[0], use_triton=True, tiles=tiles)[5]
                us = round(graph_time_us(lambda: wide_linear(x, weight(), use_triton=True, tiles=tiles), count,
                                         reps), 2)
                row = dict(kernel="wide", case=name, N=n, K=k, variant="wide_linear", tiles=tiles, us_T16=us,
                           rel_err=round(float((y.float() - ref).norm() / ref.norm()), 6),
                           row_invariant=bool(torch.equal(y[5], y5)), GB_s=round(n * k * 2 / us / 1e3, 1))
            except Exception as e:  # a launch shape that does not fit (shared memory) is a row, not a crash
                row = dict(kernel="wide", case=name, variant="wide_linear", tiles=tiles, error=str(e)[:200])
            out.append(row)
            print(row, flush=True)
    return out


def sweep_glue(inner, reps):
    """The padded steps' glue kernels (QwenNumerics.glue_kernels, off by default) at the 35B-A3B shape over their
    launch shapes: the gated norm against the compiled glue it replaces, the slot sum with and without the next
    layer's norm, the router matmul with the norm from partial sums over its K step. Each candidate is checked: a
    row's (token's) result computed among other rows is the same bits as with other neighbours or alone."""
    return glue_gated_norm(inner, reps) + glue_slot_sum(inner, reps) + glue_router_norm(inner, reps)


def glue_gated_norm(inner, reps):
    """The Gated DeltaNet's gated norm of a padded step: 16 rows x 32 value heads of 128, the gate a slice of the
    in-projection's rows (as the model passes it)."""
    from backend.models.llama import glue
    from backend.models.qwen3_5_moe import deltanet_gate
    from reviewer_kernels.norms import PADDED_GATED_NORM, gated_rms_norm
    T, H, N = 16, 32, 128
    core = torch.randn(T, H, N, device="cuda").bfloat16()
    z = torch.randn(T, 12352, device="cuda").bfloat16()[:, 8192:8192 + H * N].view(T, H, N)
    w = (torch.rand(N, device="cuda") + 0.5).bfloat16()
    ref = gated_rms_norm(core, z, w, 1e-6, use_triton=False)
    others = torch.randn_like(core)
    others[5] = core[5]
    compiled = glue(deltanet_gate, True)
    rows = [dict(kernel="gated_norm", variant="compiled glue (the default)", rows=T * H,
                 us=round(graph_time_us(lambda: compiled(core, z, w, 1e-6), inner, reps), 2))]
    print(rows[-1], flush=True)
    for br, warps in itertools.product((1, 2, 4, 8, 16, 32), (1, 2, 4)):
        launch = dict(rows_per_program=br, num_warps=warps)
        y = gated_rms_norm(core, z, w, 1e-6, use_triton=True, **launch)
        y5 = gated_rms_norm(others, z, w, 1e-6, use_triton=True, **launch)[5]
        rows.append(dict(kernel="gated_norm", variant="norms.gated_rms_norm", launch=launch,
                         shipped=launch == PADDED_GATED_NORM, row_invariant=bool(torch.equal(y[5], y5)),
                         rel_err=round(float((y.float() - ref.float()).norm() / ref.float().norm()), 6),
                         us=round(graph_time_us(lambda: gated_rms_norm(core, z, w, 1e-6, use_triton=True, **launch),
                                                inner, reps), 2)))
        print(rows[-1], flush=True)
    return rows


def glue_slot_sum(inner, reps):
    """The experts' slot sum (8 routed + the shared slot, fp32 rows of 2,048, residual added) for 1 and 16 tokens,
    without and with the next layer's norm, over num_warps; token 3 of 16 against token 3 summed alone."""
    from reviewer_kernels.fused_moe import sum_slots
    hidden, k = 2048, 8
    out = []
    for T, with_norm in itertools.product((1, 16), (False, True)):
        rows = torch.randn(T * k + T, hidden, device="cuda")
        res = torch.randn(T, hidden, device="cuda").bfloat16()
        y = torch.empty_like(res)
        nw = torch.rand(hidden, device="cuda") + 0.5
        normed = torch.empty_like(res)
        t = min(3, T - 1)
        alone_rows = torch.cat([rows[t * k:(t + 1) * k], rows[T * k + t:T * k + t + 1]])
        for warps in (None, 1, 2, 4, 8, 16):
            norm = (nw, 1e-6, normed) if with_norm else None
            run = lambda: sum_slots(rows, T, k, True, y, res, norm, warps)  # noqa: E731
            block = run().clone()
            alone = sum_slots(alone_rows, 1, k, True, torch.empty_like(res[:1]), res[t:t + 1],
                              (nw, 1e-6, torch.empty_like(res[:1])) if with_norm else None, warps)
            out.append(dict(kernel="slot_sum", T=T, norm=with_norm, num_warps=warps or "shipped",
                            row_invariant=bool(torch.equal(alone[0], block[t])),
                            us=round(graph_time_us(run, inner, reps), 2)))
            print(out[-1], flush=True)
    return out


def glue_router_norm(inner, reps):
    """The router matmul (256 experts, hidden 2,048, top-8) for 1 and 16 tokens: plain (the default numerics) and
    with the norm from 32 partial sums of squares (the glue kernels), over the K step of a slice."""
    from reviewer_kernels.moe_routing import ROUTER_NORM_BLOCK_K, route_topk_from_hidden
    from reviewer_kernels.wide_linear import sumsq_partials_torch
    H, E = 2048, 256
    router = torch.randn(E, H, device="cuda").bfloat16() / H ** 0.5
    nw = torch.rand(H, device="cuda") + 0.5
    out = []
    for T in (1, 16):
        x = torch.randn(T, H, device="cuda").bfloat16()
        normed = torch.empty_like(x)
        ss = sumsq_partials_torch(x, 32)
        plain = lambda: route_topk_from_hidden(x, router, 8)  # noqa: E731
        out.append(dict(kernel="router", T=T, variant="no norm (default numerics)",
                        us=round(graph_time_us(plain, inner, reps), 2)))
        print(out[-1], flush=True)
        t = T - 1
        for bk in (64, 128, 256, 512):
            run = lambda: route_topk_from_hidden(x, router, 8, rms_norm=(nw, 1e-6), normed_out=normed,  # noqa: E731
                                                 sumsq=ss, block_k=bk)
            w_block, ids_block = (v.clone() for v in run())
            w1, ids1 = route_topk_from_hidden(x[t:t + 1], router, 8, rms_norm=(nw, 1e-6),
                                              normed_out=torch.empty_like(x[:1]),
                                              sumsq=sumsq_partials_torch(x[t:t + 1], 32), block_k=bk)
            out.append(dict(kernel="router", T=T, variant="norm from partials", block_k=bk,
                            shipped=bk == ROUTER_NORM_BLOCK_K,
                            row_invariant=bool(torch.equal(w1[0], w_block[t]) and torch.equal(ids1[0], ids_block[t])),
                            us=round(graph_time_us(run, inner, reps), 2)))
            print(out[-1], flush=True)
    return out


SWEEPS = {"gdn": sweep_gdn, "route": sweep_route, "attention": sweep_attention, "gemv": sweep_gemv,
          "moe_decode": sweep_moe_decode, "gemv_fused": sweep_gemv_fused, "llama_one_token": sweep_llama_one_token,
          "rows": sweep_rows, "rows_35b": sweep_rows_35b, "wide": sweep_wide,
          "gdn_prefill": sweep_gdn_prefill, "glue": sweep_glue}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=sorted(SWEEPS), help="run these sweeps (default: all)")
    ap.add_argument("--inner", type=int, default=30, help="calls per captured graph (a model's layers)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_sweep.py needs a CUDA GPU")
    torch.manual_seed(0)
    results = {name: SWEEPS[name](args.inner, args.reps) for name in (args.only or SWEEPS)}
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    doc = {"benchmark": "kernel_sweep", "device": torch.cuda.get_device_name(), "date": stamp,
           "command": "python bench/kernel_sweep.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
           "inner": args.inner, "reps": args.reps, "results": results}
    out = Path(args.out) / f"kernel_sweep_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
