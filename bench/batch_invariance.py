"""Is a position's logits row the same, bit for bit, when the target computes it in a plain decode step and inside a
verify block of each size 2..16? That is what greedy speculative decoding needs to be token-identical to plain
decoding in bf16 (backend/models/llama.py `_rows`, reviewer_kernels/norm_gemv.py, reviewer_kernels/gemv.py,
reviewer_kernels/block_attention.py).

    python bench/batch_invariance.py --model embedded --device cuda --json bench/results/batch_invariance_....json
    python bench/batch_invariance.py --model smollm2-135m --device cuda      # random weights at that shape
    python bench/batch_invariance.py --model qwen3.6-35b-a3b --device cuda   # the MoE target's shape

Prints, per block size, how many of its positions match the decode step exactly, the largest difference, and
whether the argmax agrees; the JSON holds the command, date and machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from backend.bench.report import machine_info  # noqa: E402
from backend.models import load_fast  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded", help="embedded, smollm2-135m, qwen3.6-35b-a3b, qwen3.5-moe-small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    import target_step

    model, _, label = target_step.build(a.model, a.device, torch.bfloat16)
    fm = load_fast(model, max_context=4096, compile=a.device == "cuda")
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (a.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    fm.reset()
    logits, _ = fm.prefill(prompt)
    start = fm.snapshot()  # the prompt's end: every block below is verified from here
    tokens, steps = [], []
    for _ in range(16):
        tokens.append(int(logits.argmax()))
        logits, _ = fm.decode(tokens[-1])
        steps.append(logits.float())
    rows = []
    for size in range(2, 17):
        fm.restore(start)
        block, _ = fm.verify(tokens[:size])
        fm.accept(1)
        block = block.float()
        same = sum(bool(torch.equal(block[j], steps[j])) for j in range(size))
        diff = max(float((block[j] - steps[j]).abs().max()) for j in range(size))
        argmax = sum(int(block[j].argmax()) == int(steps[j].argmax()) for j in range(size))
        rows.append({"block": size, "bitwise_equal": same, "max_abs_diff": diff, "argmax_equal": argmax})
        print(f"block {size:2d}: {same:2d}/{size} positions bitwise equal to the decode step, max |diff| {diff:.3g}, "
              f"argmax equal {argmax}/{size}", flush=True)
    out = {"benchmark": "batch_invariance", "model": label, "command": " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(a.device), "rows": rows,
           "all_bitwise_equal": all(r["bitwise_equal"] == r["block"] for r in rows)}
    print(f"all positions bitwise equal: {out['all_bitwise_equal']}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
