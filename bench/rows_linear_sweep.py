"""Time kernels/rows_linear.py at the SmolLM2-135M decode/verify shapes for a few tile choices, T = 1 and T = 16,
against kernels/norm_gemv.py / kernels/gemv.py's one-row programs (T = 1) and cuBLAS (F.linear), on CUDA.

    python bench/rows_linear_sweep.py --json bench/results/rows_linear_sweep_....json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench import machine_info  # noqa: E402
from kernels.gemv import gemv  # noqa: E402
from kernels.norm_gemv import norm_gemv  # noqa: E402
from kernels.rows_linear import rows_linear  # noqa: E402

SHAPES = {"qkv": (960, 576, "rope"), "gate_up": (3072, 576, "swiglu"), "o": (576, 576, "residual"),
          "down": (576, 1536, "residual"), "head": (49152, 576, "norm")}
TILES = [{"BN": 16, "BK": 64, "warps": 2, "stages": 4}, {"BN": 16, "BK": 64, "warps": 1, "stages": 4},
         {"BN": 16, "BK": 128, "warps": 2, "stages": 3}, {"BN": 32, "BK": 64, "warps": 2, "stages": 4},
         {"BN": 16, "BK": 32, "warps": 1, "stages": 6}]


def args_for(kind, n, k, rows):
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    kw = {}
    if kind in ("rope", "swiglu", "norm"):
        kw["norm"] = (nw, 1e-5)
    if kind == "rope":
        cos = torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16)
        kw["rope"] = (cos, cos.clone(), torch.arange(100, 100 + rows, device="cuda"), 15 * 64 - 3 * 64)
    kw["swiglu"] = kind == "swiglu"
    if kind == "residual":
        kw["residual"] = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    return x, w, kw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    out = {"benchmark": "rows_linear_sweep", "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "machine": machine_info("cuda"), "us": {}}
    for name, (n, k, kind) in SHAPES.items():
        row = out["us"][name] = {}
        for rows in (1, 16):
            x, w, kw = args_for(kind, n, k, rows)
            for i, tiles in enumerate(TILES):
                try:
                    row[f"rows_linear_t{i}_T{rows}"] = 1e3 * triton.testing.do_bench(
                        lambda: rows_linear(x, w, tiles=tiles, **kw), return_mode="median")
                except Exception as exc:  # a tile that does not fit this shape
                    row[f"rows_linear_t{i}_T{rows}"] = repr(exc)[:80]
            row[f"cublas_T{rows}"] = 1e3 * triton.testing.do_bench(lambda: F.linear(x, w), return_mode="median")
        x, w, kw = args_for(kind, n, k, 1)
        if kind == "residual":
            row["one_row_gemv_T1"] = 1e3 * triton.testing.do_bench(
                lambda: gemv(x, w, residual=kw["residual"]), return_mode="median")
        else:
            nk = {"swiglu": kw["swiglu"]} if kind == "swiglu" else ({"rope": kw["rope"]} if kind == "rope" else {})
            row["one_row_norm_gemv_T1"] = 1e3 * triton.testing.do_bench(
                lambda: norm_gemv(x, kw["norm"][0], w, 1e-5, **nk), return_mode="median")
        print(name, {key: (round(v, 2) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
    out["tiles"] = TILES
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
