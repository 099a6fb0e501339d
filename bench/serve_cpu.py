"""End-to-end decoding speed of `reviewer serve` over HTTP on the embedded model, beside transformers' `generate` and
the engine called directly, on the same prompts in one run (greedy, batch 1, CPU).

    .venv/bin/python bench/serve_cpu.py [--max-tokens 128] [--prompts 4] [--out bench/results/serve_cpu.json]

Modes: `hf_generate` (model.generate, do_sample=False), `engine` (backend.decoding.engine.Engine in this process), `http` (the
server as a separate `serve` process, OpenAI SDK, non-streamed) and `http_stream` (same, streamed; also time to first
token). tok/s = generated tokens / wall seconds of the request (prefill included, as a client sees it). Each prompt goes
through every mode in turn, so other load on the machine hits all modes alike. The answers of all modes are compared
as text (greedy decoding must agree).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROMPTS = [  # /work/shared/probes/prompts.json, the CPU anchor's prompts
    "Write a Python function that reverses the words in a sentence.",
    "Explain what a virtual environment is in Python and why it is useful.",
    "Review this code for bugs:\n\ndef first(xs):\n    return xs[1]\n",
    "How do I run only one test with pytest?",
]


def start_server(threads: int) -> tuple[subprocess.Popen, str]:
    args = dict(model="embedded", drafter="none", host="127.0.0.1", port=0, uds=None, device="cpu", dtype="auto",
                max_context=None)
    code = (f"import torch, json, sys; torch.set_num_threads({threads}); from backend.server.app import serve; "
            "serve(**json.loads(sys.argv[1]))")
    process = subprocess.Popen([sys.executable, "-c", code, json.dumps(args)], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    url = re.search(r"listening on (\S+)", process.stdout.readline()).group(1)
    return process, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_cpu.json")
    opts = ap.parse_args()

    import httpx
    import openai
    import torch
    import transformers

    from backend import chat
    from backend.decoding.engine import Engine, SamplingParams
    from backend.loading import load_model

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(opts.threads)
    prompts = PROMPTS[:opts.prompts]
    server, url = start_server(opts.threads)  # loads in its own process while we load here
    loaded = load_model("embedded", device="cpu")
    tok, model = loaded.tokenizer, loaded.model
    stops = chat.stop_token_ids(tok, model.generation_config)
    rendered = [chat.render_chat(tok, [{"role": "user", "content": p}])[1] for p in prompts]
    engine = Engine(model, max_context=loaded.max_context)
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=0.0, stop_token_ids=stops)
    with httpx.Client(base_url=url, timeout=600) as http:
        while http.get("/health").status_code != 200:
            time.sleep(0.2)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)

    def hf_generate(i):
        ids = rendered[i]
        t = time.perf_counter()
        out = model.generate(torch.tensor([ids]), max_new_tokens=opts.max_tokens, do_sample=False,
                             eos_token_id=list(stops), pad_token_id=tok.pad_token_id)
        seconds = time.perf_counter() - t
        new = [x for x in out[0, len(ids):].tolist() if x not in stops]
        return tok.decode(new), len(new), seconds, None

    def direct_engine(i):  # reuses the shared system-prompt prefix across requests, as the server's engine does
        t = time.perf_counter()
        new = [x for chunk in engine.generate(rendered[i], params) for x in chunk]
        return tok.decode(new), len(new), time.perf_counter() - t, None

    def http(i):
        t = time.perf_counter()
        r = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": prompts[i]}],
                                           max_tokens=opts.max_tokens, temperature=0)
        return r.choices[0].message.content, r.usage.completion_tokens, time.perf_counter() - t, None

    def http_stream(i):
        t, parts, ttft, n = time.perf_counter(), [], None, 0
        for chunk in client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": prompts[i]}],
                                                    max_tokens=opts.max_tokens, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage:
                n = chunk.usage.completion_tokens
        return "".join(parts), n, time.perf_counter() - t, ttft

    modes = {"hf_generate": hf_generate, "engine": direct_engine, "http": http, "http_stream": http_stream}
    for run in modes.values():  # warm-up, not timed
        run(0)
    # Interleaved (each prompt through every mode in turn), so load from other processes hits all modes alike.
    runs = {mode: [] for mode in modes}
    for i in range(len(prompts)):
        for mode, run in modes.items():
            runs[mode].append(run(i))
    server.send_signal(signal.SIGINT)
    server.wait(60)

    results, outputs = {}, {}
    for mode, rs in runs.items():  # rs: [(text, generated tokens, seconds, time to first token or None)]
        tokens, seconds = sum(r[1] for r in rs), sum(r[2] for r in rs)
        results[mode] = {"tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 2)}
        if rs[0][3] is not None:
            results[mode]["mean_ttft_s"] = round(sum(r[3] for r in rs) / len(rs), 3)
        outputs[mode] = [r[0].strip() for r in rs]  # the chat API trims surrounding whitespace
        print(mode, json.dumps(results[mode]), flush=True)

    def same(a, b):
        return outputs[a] == outputs[b]

    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "torch_threads": opts.threads, "torch": torch.__version__, "transformers": transformers.__version__,
                    "load_average": os.getloadavg()},
        # More runnable processes than cores: absolute tok/s then say more about the neighbours than about us (the
        # modes are interleaved, so their ratios and the identical-output checks still hold).
        "contended": os.getloadavg()[0] > (os.cpu_count() or 1),
        "model": loaded.name, "dtype": loaded.dtype, "prompts": len(prompts), "max_tokens": opts.max_tokens,
        "results": results,
        "identical_output": {f"{m}_vs_hf_generate": same(m, "hf_generate") for m in ("engine", "http", "http_stream")},
        "http_over_engine": round(results["http"]["tok_s"] / results["engine"]["tok_s"], 3),
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
