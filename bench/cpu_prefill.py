"""Prefill of a long prompt through `reviewer serve` on the CPU: ms per prompt token for the default engine (on a GGUF
model: llama.cpp's runtime) and the torch engine with the default drafter and with `--drafter none`, side by side.

    .venv/bin/python bench/cpu_prefill.py [--tokens 4000] [--rounds 1] [--out bench/results/cpu_prefill-DATE.json]

The prompt is this repository's own source (backend/decoding/engine.py, then speculative.py, target.py), cut to
`--tokens` tokens of the embedded model's tokenizer and sent as one user message (an agent's context is mostly
files it has read), with max_tokens 1, so the request is its prefill. Each round puts a different number in front,
so no server reuses a cached prefix. ms/token = the server's own `timings.prompt_ms / prompt_n` (llama-server's
fields, which `reviewer serve` reports too); the wall seconds of the request are recorded beside it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.cpu_peer import cpu_flags, cpu_name, start_ours  # noqa: E402

SOURCES = ["backend/decoding/engine.py", "backend/decoding/speculative.py", "backend/decoding/target.py"]


def long_prompt(tokens: int) -> str:
    from transformers import AutoTokenizer

    from backend.loading import EMBEDDED_NAME, convert_gguf, embedded_gguf_path

    tokenizer = AutoTokenizer.from_pretrained(str(convert_gguf(embedded_gguf_path(), EMBEDDED_NAME)))
    text = "\n\n".join((ROOT / s).read_text() for s in SOURCES)
    ids = tokenizer(text)["input_ids"][:tokens]
    assert len(ids) == tokens, f"the sources hold only {len(ids)} tokens"
    return tokenizer.decode(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ours", action="append", help="as in bench/cpu_peer.py (default: auto, torch, "
                                                    "torch:DRAFTER=none)")
    ap.add_argument("--request-timeout", type=float, default=1200.0)
    ap.add_argument("--out", type=Path)
    opts = ap.parse_args()
    import httpx

    logs = ROOT / "build" / "cpu_peer"
    logs.mkdir(parents=True, exist_ok=True)
    text = long_prompt(opts.tokens)
    servers = [start_ours(spec, logs) for spec in (opts.ours or ["auto", "torch", "torch:DRAFTER=none"])]
    rows = []
    try:
        with httpx.Client() as http:
            for server in servers:
                server.wait_ready(http)
            for round_ in range(opts.rounds):
                for server in servers:
                    body = {"model": "embedded", "max_tokens": 1, "temperature": 0,
                            "messages": [{"role": "user", "content": f"{round_}\n{text}"}]}
                    t0 = time.perf_counter()
                    answer = http.post(server.url + "/v1/chat/completions", json=body,
                                       timeout=opts.request_timeout).json()
                    wall = time.perf_counter() - t0
                    timings = answer["timings"]
                    row = {"server": server.label, "round": round_, "prompt_n": timings["prompt_n"],
                           "cache_n": timings["cache_n"], "prompt_ms": round(timings["prompt_ms"], 1),
                           "ms_per_token": round(timings["prompt_ms"] / max(1, timings["prompt_n"] -
                                                                            timings["cache_n"]), 3),
                           "wall_seconds": round(wall, 2)}
                    rows.append(row)
                    print(row, flush=True)
    finally:
        for server in servers:
            server.stop()
    record = {"benchmark": "cpu_prefill", "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "cpu_flags": cpu_flags()},
              "inputs": f"{opts.tokens} tokens of {', '.join(SOURCES)} as one user message, max_tokens 1, "
                        f"{opts.rounds} round(s), a round number in front",
              "servers": {s.label: s.ready_line.split("ready:", 1)[-1].strip() for s in servers}, "requests": rows}
    out = opts.out or ROOT / "bench" / "results" / f"cpu_prefill-{datetime.now():%Y%m%d_%H%M%S}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print("->", out)


if __name__ == "__main__":
    main()
