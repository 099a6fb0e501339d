"""Is cuBLAS batch-invariant when every call is padded to 16 rows? (GPU; the question behind a lossless MoE verify.)

A verify block and a decode step give a position the same logits only if each projection computes a row the same
way for 1..16 rows. cuBLAS picks its algorithm by the row count M, so M = 1 and M = 16 differ; padded to M = 16
every time, one algorithm runs. This checks, per projection shape of the two served models (bf16, random weights):
  same_alone_padded   row 0 of a 16-row call == the row alone, padded with zeros to 16 rows
  same_any_position   the rows of a call == the same rows rolled to other positions (other neighbours)
  same_unpadded       row 0 of the 16-row call == an unpadded one-row call (expected False: another algorithm)
and the time per call (CUDA graph of back-to-back calls, each on its own weight) for M = 1 and padded M = 16.

    python bench/cublas_padded_rows.py --json bench/results/cublas_padded_rows_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_sweep import graph_time_us  # noqa: E402

SHAPES = {  # name: (N, K)
    "qwen3.6-35b deltanet in_proj": (12352, 2048),
    "qwen3.6-35b attention q/k/v/gate": (9216, 2048),
    "qwen3.6-35b out_proj": (2048, 4096),
    "qwen3.6-35b shared expert gate_up": (1024, 2048),
    "qwen3.6-35b router": (256, 2048),
    "smollm2 qkv": (960, 576),
    "smollm2 gate_up": (3072, 576),
    "smollm2 o": (576, 576),
    "smollm2 down": (576, 1536),
    "smollm2 lm_head": (49152, 576),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cublas_padded_rows.py needs a CUDA GPU")
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda").bfloat16() / k ** 0.5 for _ in range(args.inner)]
        w = ws[0]
        x = torch.randn(16, k, device="cuda").bfloat16()
        full = F.linear(x, w)
        alone = torch.zeros_like(x)
        alone[0] = x[0]
        rolled = F.linear(x.roll(5, 0), w).roll(-5, 0)
        state = {"n": 0}

        def weight():
            state["n"] += 1
            return ws[state["n"] % len(ws)]
        row = dict(case=name, N=n, K=k,
                   same_alone_padded=bool(torch.equal(full[:1], F.linear(alone, w)[:1])),
                   same_any_position=bool(torch.equal(full, rolled)),
                   same_unpadded=bool(torch.equal(full[:1], F.linear(x[:1], w))),
                   us_M1=round(graph_time_us(lambda: F.linear(x[:1], weight()), args.inner, args.reps), 2),
                   us_M16=round(graph_time_us(lambda: F.linear(x, weight()), args.inner, args.reps), 2))
        rows.append(row)
        print(row, flush=True)
    doc = {"benchmark": "cublas_padded_rows", "device": torch.cuda.get_device_name(),
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": "python bench/cublas_padded_rows.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
           "cublas": torch.backends.cuda.preferred_blas_library().name, "results": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print("wrote", args.json)


if __name__ == "__main__":
    main()
