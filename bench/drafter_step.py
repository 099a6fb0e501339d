"""What one GPU draft costs (backend/dflash/fast.py): the CUDA-graph replay of absorb + block forward + head, timed
with CUDA events, and where its time goes (torch.profiler over replays), for the embedded model's shipped drafter
(on a random target of SmolLM2-135M's shape: only the shapes matter here) and the released Qwen3.6 drafter's shape.

    python bench/drafter_step.py --shape smollm2 --json bench/results/drafter_step_....json
    python bench/drafter_step.py --shape qwen3.6 --profile
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench.report import machine_info  # noqa: E402
from backend.dflash.checkpoint import DRAFTERS_DIR, load_drafter  # noqa: E402
from backend.dflash.fast import FastDrafter  # noqa: E402


def build(shape: str):
    """(target, drafter) with random target weights at `shape`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if shape == "smollm2":
        import target_step

        target, _, _ = target_step.build("smollm2-135m", "cuda", torch.bfloat16)
        drafter = load_drafter(DRAFTERS_DIR / "SmolLM2-135M-Instruct-DFlash")
    else:
        from backend.bench.shapes import released_shape_drafter, shape_model

        target = shape_model("qwen3.6-35b-a3b-shape", "cuda")
        drafter = released_shape_drafter(target)
    drafter.check_target(target)
    return target, drafter


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2", choices=["smollm2", "qwen3.6"])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sdpa", default=None, choices=["cudnn", "efficient", "flash", "math"],
                    help="force one scaled_dot_product_attention backend for the drafter's layers (default: torch's "
                         "choice); with --attention sdpa")
    ap.add_argument("--attention", default="kernel", choices=["kernel", "sdpa"],
                    help="the drafter's attention: reviewer_kernels/block_attention.py (FastDrafter's default on "
                         "CUDA) or SDPA with a device-built mask (what it ran before 2026-12-02)")
    a = ap.parse_args(argv)
    if a.sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[a.sdpa]
        sdpa_kernel([backend]).__enter__()  # for the whole run: the graphs capture the forced backend
    target, drafter = build(a.shape)
    fd = FastDrafter(drafter, max_context=4096)
    fd.block_kernel = fd.block_kernel and a.attention == "kernel"
    width = len(drafter.target_layer_ids) * drafter.cfg.hidden_size
    fd.add_pending(torch.randn(1, a.context, width, device="cuda", dtype=fd.dtype))
    feats = torch.randn(16, width, device="cuda", dtype=fd.dtype)
    keep, token = torch.ones(1, dtype=torch.long, device="cuda"), torch.tensor([5], device="cuda")

    def draft():
        fd.launch(features=feats, rows=16, keep=keep, token=token, upper_length=a.context + 16)

    for _ in range(3):
        draft()
    fd.set_length(a.context)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(a.reps):
        fd.set_length(a.context)
        start.record()
        draft()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    out = {"benchmark": "drafter_step", "shape": a.shape, "context": a.context, "command": " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info("cuda"),
           "attention": "kernel" if fd.block_kernel else "sdpa", "sdpa": a.sdpa or "default",
           "draft_ms_median": times[len(times) // 2], "draft_ms_min": times[0],
           "drafter_params_m": sum(p.numel() for p in drafter.parameters()) / 1e6}
    print(f"{a.shape}: one draft (absorb 16 rows + block of 16 + head) {out['draft_ms_median']:.3f} ms median, "
          f"{out['draft_ms_min']:.3f} ms min", flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fd.set_length(a.context)
                draft()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        print(table)
        out["profile"] = table
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
