"""The prefill's attention on CUDA: cuDNN's (SDPA's default with a bool mask, what prefill ran until 2026-12-03)
against FlashAttention with a lower-right causal bias (backend/models/llama.attention now), at agent-turn sizes of the
two served models: a new shape's first call (cuDNN builds a plan per shape on the host) and the steady time.

    python bench/prefill_attention.py [--out bench/results]      (H200)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.models.llama import attention, causal_mask  # noqa: E402

SHAPES = {"qwen3.6-35b-a3b": (16, 2, 256), "smollm2-135m": (9, 3, 64)}
SIZES = [(850, 2898), (1500, 4400), (1611, 7001), (1700, 30000)]  # (new tokens, context after them)


def cudnn_masked(q, k, v, positions, L):
    """Before: the bool mask over the columns, SDPA's own choice of kernel (cuDNN on the H200)."""
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=causal_mask(positions, L),
                                         enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)


def ours(q, k, v, positions, L):
    return attention(q, k, v, causal_mask(positions, L, lower_right=True))


def first_and_steady(fn, reps: int = 5) -> tuple[float, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return out, first * 1e3, sorted(times)[reps // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_attention times CUDA attention kernels")
    rows = []
    for model, (heads, kv_heads, D) in SHAPES.items():
        k = torch.randn(kv_heads, 32768, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for T, L in SIZES:
            q = torch.randn(heads, T, D, device="cuda", dtype=torch.bfloat16)
            positions = torch.arange(L - T, L, device="cuda")
            row = {"model": model, "new_tokens": T, "context": L}
            outs = {}
            for name, fn in (("cudnn_masked", cudnn_masked), ("flash_lower_right", ours)):
                outs[name], row[f"{name}_first_ms"], row[f"{name}_steady_ms"] = first_and_steady(
                    lambda: fn(q, k[:, :L], v[:, :L], positions, L))
            row["max_abs_diff"] = (outs["cudnn_masked"].float() - outs["flash_lower_right"].float()).abs().max().item()
            rows.append(row)
            print(json.dumps(row), flush=True)
    record = {"benchmark": "prefill_attention", "machine": {"gpu": torch.cuda.get_device_name()},
              "command": "python " + " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "timing": "host wall with a device sync; first: the call that meets a new "
              "shape (the first row of the run also pays one-off library start-up); steady: median of 5",
              "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"prefill_attention_h200_{datetime.date.today():%Y%m%d}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
