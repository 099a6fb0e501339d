"""`reviewer serve` against a client that tries to starve it (issue 42), loopback only, on the embedded model (CPU):

    .venv/bin/python bench/serve_limits.py [--code-root DIR] [--out bench/results/serve_limits_cpu.json]

1. flood: `--max-connections` idle connections, then 2,000 more beyond the cap, held; /health is asked 20 times on
   fresh connections before and while they are held (latency of each, the status, what it says of saturation).
2. log: 10,000 connections opened and closed beyond the cap; how many lines and bytes the server's log grew by.
3. abort: a stream of 2,000 tokens is dropped after its fifth chunk and the next request (max_tokens 1) sent at once;
   its `timings.queue_ms` (how long it waited for the engine) against one decode step (the time per token of a
   finished request) and one speculative cycle; 10 times, with the shipped drafter (the default) and without.
4. memory: RSS of the server after a warm-up request, then during and after 300 over-long prompts (650 KB: under the
   1 MiB body cap, over the 8192-token window: refused with a 400), 20 at a time, as issue 42 sent them.

The server is a separate `serve` process (its own pid's RSS, from /proc; its stderr is the log). `--code-root DIR`
runs the server from another checkout (the commit before a fix) for a before/after pair: that code has none of the
connection limits, so the flood and log phases measure what it does without them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_hostile import machine, rss_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CAP = 256  # the bench's --max-connections: a flood beyond it costs the client as many sockets
FLOOD = 2000
REFUSED = 10_000


def start_server(code_root: Path, drafter: str, limits: bool) -> tuple[subprocess.Popen, str, Path]:
    args = dict(model="embedded", drafter=drafter, host="127.0.0.1", port=0, uds=None, device="cpu", dtype="auto",
                max_context=None)
    if limits:
        args["max_connections"] = CAP
    log = Path(tempfile.mkstemp(prefix="serve-limits-", suffix=".log")[1])
    code = "import json, sys; from backend.server.app import serve; serve(**json.loads(sys.argv[1]))"
    process = subprocess.Popen([sys.executable, "-c", code, json.dumps(args)], cwd=code_root, stdout=subprocess.PIPE,
                               stderr=log.open("w"), text=True, env={**os.environ, "PYTHONPATH": str(code_root)})
    url = re.search(r"listening on (\S+)", process.stdout.readline()).group(1)
    with httpx.Client(base_url=url, timeout=30) as http:
        while http.get("/health").status_code != 200:
            time.sleep(0.5)
    return process, url, log


def health_latencies(url: str, count: int = 20) -> dict:
    seconds, statuses, saturated = [], [], None
    for _ in range(count):
        start = time.monotonic()
        try:
            with httpx.Client(base_url=url, timeout=10) as http:  # a fresh connection each time, as a monitor's
                response = http.get("/health")
            statuses.append(response.status_code)
            saturated = response.json().get("saturated", saturated)
        except httpx.HTTPError as exc:
            statuses.append(type(exc).__name__)
        seconds.append(time.monotonic() - start)
        time.sleep(0.05)
    return {"median_ms": round(statistics.median(seconds) * 1e3, 1), "max_ms": round(max(seconds) * 1e3, 1),
            "statuses": sorted(set(map(str, statuses))), "saturated": saturated}


def flood(url: str) -> dict:
    port = int(url.rsplit(":", 1)[1])
    out = {"before": health_latencies(url)}
    held, failed = [], 0
    for _ in range(CAP + FLOOD):
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            failed += 1
    time.sleep(0.5)
    out["during"] = health_latencies(url)
    out["connections_opened"], out["connections_failed"] = len(held), failed
    for sock in held:
        sock.close()
    return out


def log_growth(url: str, log: Path) -> dict:
    port = int(url.rsplit(":", 1)[1])
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(CAP)]  # the cap is full: the rest refused
    time.sleep(0.5)
    lines, size, start = len(log.read_text().splitlines()), log.stat().st_size, time.monotonic()
    failed = 0
    for _ in range(REFUSED):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except OSError:
            failed += 1
    seconds = time.monotonic() - start
    time.sleep(11)  # past one log window: its summary line is written
    text = log.read_text()
    for sock in held:
        sock.close()
    return {"connections": REFUSED, "failed_to_connect": failed, "seconds": round(seconds, 2),
            "log_lines_added": len(text.splitlines()) - lines, "log_bytes_added": log.stat().st_size - size,
            "summary_lines": [ln for ln in text.splitlines()[lines:] if "left out of the log" in ln][:3]}


def aborted_streams(url: str, runs: int = 10) -> dict:
    body = {"model": "embedded", "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=300) as http:
        done = http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 64}).json()["timings"]
        step_ms = done["predicted_ms"] / max(done["predicted_n"], 1)
        cycle_ms = (done["draft_ms"] + done["verify_ms"]) / done["spec_cycles"] if done.get("spec_cycles") else None
        waits = []
        for _ in range(runs):
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                for _ in range(5):
                    next(lines)
            # the stream's connection is closed here; the next request goes out at once
            nxt = http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1}).json()
            waits.append(nxt["timings"]["queue_ms"])
    return {"queue_ms_after_abort": [round(w, 1) for w in waits], "median_queue_ms": round(statistics.median(waits), 1),
            "max_queue_ms": round(max(waits), 1), "decode_ms_per_token": round(step_ms, 1),
            "cycle_ms": round(cycle_ms, 1) if cycle_ms else None}


def refused_prompts(url: str, pid: int, count: int = 300, concurrent: int = 20) -> dict:
    with httpx.Client(base_url=url, timeout=300) as http:
        http.post("/v1/chat/completions", json={"model": "embedded", "max_tokens": 8,
                                                "messages": [{"role": "user", "content": "hi"}]})
    time.sleep(1)
    start_rss = rss_bytes(pid)
    words = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")
    prompt = " ".join(words[i % len(words)] + str(i % 97) for i in range(85_000))  # 649,979 chars, ~150k tokens
    statuses: dict[str, int] = {}
    peak, lock = start_rss, threading.Lock()

    def client(n: int) -> None:
        nonlocal peak
        with httpx.Client(base_url=url, timeout=300) as http:
            for _ in range(n):
                r = http.post("/v1/chat/completions", json={"model": "embedded", "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": prompt}]})
                with lock:
                    statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
                    peak = max(peak, rss_bytes(pid))

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(count // concurrent,)) for _ in range(concurrent)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - started
    time.sleep(3)
    end_rss = rss_bytes(pid)
    return {"prompts": count, "concurrent": concurrent, "prompt_chars": len(prompt), "statuses": statuses,
            "seconds": round(seconds, 1), "rss_start_mb": round(start_rss / 2**20), "rss_peak_mb": round(peak / 2**20),
            "rss_after_mb": round(end_rss / 2**20), "rss_growth_mb": round((end_rss - start_rss) / 2**20)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code-root", type=Path, default=ROOT)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/serve_limits_cpu.json")
    parser.add_argument("--phases", default="flood,log,abort,memory")
    args = parser.parse_args()
    phases = args.phases.split(",")
    limits = (args.code_root / "backend/server/limits.py").exists()
    record = {"benchmark": "serve_limits", "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "code_root": str(args.code_root), "connection_limits": limits,
              "inputs": f"embedded model on CPU; --max-connections {CAP} (when the code has it); flood: {CAP} + "
                        f"{FLOOD} idle sockets; log: {REFUSED} refused connections; abort: 2000-token greedy stream "
                        "dropped after 5 chunks, then a 1-token request; memory: 300 chat requests of a 650 KB "
                        "prompt (8 words and numbers repeated), 20 at a time"}
    process, url, log = start_server(args.code_root, "none", limits)
    try:
        if "flood" in phases:
            record["flood"] = flood(url)
        if "log" in phases:
            record["log"] = log_growth(url, log)
        if "memory" in phases:
            record["memory"] = refused_prompts(url, process.pid)
        if "abort" in phases:
            record["abort_plain"] = aborted_streams(url)
    finally:
        process.terminate()
        process.wait(30)
    if "abort" in phases:
        process, url, log = start_server(args.code_root, "auto", limits)
        try:
            record["abort_speculative"] = aborted_streams(url)
        finally:
            process.terminate()
            process.wait(30)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
