"""Where `reviewer train`'s data preparation spends its time: response generation and feature extraction (GPU).

A random-weight model of the SmolLM2-135M shape (no weights needed) runs backend/train_data.py's own
generate_responses and extract_features on random prompts with the length spread of the built-in prompt set, at a
few batch sizes and dtypes; a torch.profiler table of one generation batch says which operators dominate.

    python bench/train_gen_speed.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.train_data import extract_features, generate_responses  # noqa: E402


def smollm2_shape(dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


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
    args = ap.parse_args()
    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    prompts = prompts_like_builtin(args.prompts)
    rows = []
    for dtype, batch, gen_tokens in ((torch.float32, 1536, 786432), (torch.bfloat16, 1536, 786432),
                                     (torch.bfloat16, 512, 786432)):
        model = smollm2_shape(dtype, device)
        sync()
        t0 = time.perf_counter()
        made = generate_responses(model, prompts, max_new_tokens=args.new_tokens, stops=(), batch_size=batch,
                                  batch_tokens=gen_tokens, temperature=0.7, log=lambda *_: None)
        sync()
        secs = time.perf_counter() - t0
        tokens = sum(map(len, made))
        rows.append(dict(stage="generate", dtype=str(dtype), batch=batch, prompts=len(prompts), new_tokens=tokens,
                         seconds=round(secs, 2), tokens_per_s=round(tokens / secs)))
        print(rows[-1], flush=True)
        if dtype == torch.bfloat16 and batch == 1536:
            with tempfile.TemporaryDirectory() as tmp:
                seqs = [p + r for p, r in zip(prompts[:512], made[:512])]
                t0 = time.perf_counter()
                extract_features(model, seqs, [len(p) for p in prompts[:512]], [1, 8, 15, 22, 29], Path(tmp),
                                 log=lambda *_: None)
                secs = time.perf_counter() - t0
                rows.append(dict(stage="features", dtype=str(dtype), sequences=len(seqs),
                                 positions=sum(map(len, seqs)), seconds=round(secs, 2)))
                print(rows[-1], flush=True)
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            with profile(activities=acts) as prof:
                generate_responses(model, prompts[:256], max_new_tokens=min(16, args.new_tokens), stops=(),
                                   batch_size=256, temperature=0.7, log=lambda *_: None)
                sync()
            by = "cuda_time_total" if device == "cuda" else "cpu_time_total"
            table = prof.key_averages().table(sort_by=by, row_limit=20)
            cpu_table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=12)
            print(table, cpu_table, sep="\n", flush=True)
            rows.append(dict(stage="profile 256 prompts x 16 tokens", cuda_table=table, cpu_table=cpu_table))
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
