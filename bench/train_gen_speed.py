"""Where `reviewer train`'s data preparation spends its time: response generation and feature extraction (GPU).

A random-weight model of the SmolLM2-135M shape (no weights needed) runs backend/train/data.py's own
generate_responses on random prompts with the length spread of the built-in prompt set: the KV cache dynamic or
static (generate_responses(cache=...)), torch's own SDPA kernel or the memory-efficient one, fp32 and bf16
(`reviewer train --dtype`); --profile adds a torch.profiler table of one generation batch.

    python bench/train_gen_speed.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.train.data import generate_responses  # noqa: E402


def smollm2_shape(dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def attention_backends(which: str):
    """"auto": torch's own pick of SDPA kernel (cuDNN on Hopper, whose per-call host cost dominated generation in
    the first profile); "efficient": the memory-efficient kernel (masks allowed) or the math one."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return nullcontext() if which == "auto" else sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def prompts_like_builtin(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(100, 650, (n,), generator=g)  # the built-in set: ~370 tokens on average
    return [torch.randint(100, 49000, (int(n_),), generator=g).tolist() for n_ in lengths]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=1536)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--profile", action="store_true", help="also a torch.profiler table of the static cache's run")
    args = ap.parse_args()
    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    prompts = prompts_like_builtin(args.prompts)
    rows = []
    configs = [(torch.float32, 1536, "dynamic", "auto"), (torch.float32, 1536, "static", "auto"),
               (torch.float32, 1536, "dynamic", "efficient"), (torch.float32, 1536, "static", "efficient"),
               (torch.bfloat16, 1536, "static", "auto")]
    for dtype, batch, cache, attention in configs:
        model = smollm2_shape(dtype, device)
        sync()
        t0 = time.perf_counter()
        with attention_backends(attention):
            made = generate_responses(model, prompts, max_new_tokens=args.new_tokens, stops=(), batch_size=batch,
                                      batch_tokens=786432, temperature=0.7, cache=cache, log=lambda *_: None)
        sync()
        secs = time.perf_counter() - t0
        tokens = sum(map(len, made))
        rows.append(dict(stage="generate", dtype=str(dtype), batch=batch, cache=cache, attention=attention,
                         prompts=len(prompts), new_tokens=tokens, seconds=round(secs, 2),
                         tokens_per_s=round(tokens / secs)))
        print(rows[-1], flush=True)
        if args.profile and (cache, attention) == ("static", "auto"):
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            with profile(activities=acts) as prof:
                generate_responses(model, prompts[:256], max_new_tokens=min(16, args.new_tokens), stops=(),
                                   batch_size=256, temperature=0.7, cache=cache, log=lambda *_: None)
                sync()
            by = "cuda_time_total" if device == "cuda" else "cpu_time_total"
            table = prof.key_averages().table(sort_by=by, row_limit=20)
            print(table, flush=True)
            rows.append(dict(stage=f"profile 256 prompts x 16 tokens, {dtype}, {cache} cache", table=table))
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    doc = {"benchmark": "train_gen_speed", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "date": stamp, "model": "SmolLM2-135M shape, random weights",
           "command": "python bench/train_gen_speed.py " + " ".join(sys.argv[1:]), "rows": rows}
    out = Path(args.out) / f"train_gen_speed_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
