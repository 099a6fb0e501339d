"""Memory and responsiveness of `reviewer serve` under hostile requests, and where its idle memory goes.

    .venv/bin/python bench/serve_hostile.py [--code-root DIR] [--out bench/results/serve_hostile_cpu.json]

Load (issue 29's, loopback only): 4 concurrent 20 MB /v1/chat/completions bodies, then one 20 MB /v1/completions
while /health is polled every 50 ms (its slowest answer is the freeze), then 4 concurrent 20 MB /v1/messages. The
server is a separate `serve` process on the embedded model (plain decoding); its RSS is sampled every 20 ms from
/proc. Reported: idle RSS, peak RSS, RSS 3 s after the load, the statuses, the slowest /health.
`--max-body-mb 64` raises the server's body cap so that the 20 MB bodies are parsed, rendered and tokenized (the
bounded path behind the cap). `--code-root DIR` runs the server from another checkout (e.g. the commit before a fix)
for a before/after pair.

`--idle` instead measures, in this process, RSS after each step of a server's start: interpreter, `import torch`,
`import transformers`, the weights loaded, the engine made (its static caches), one short generation, and
the same after giving freed heap back to the system (malloc_trim); and the sizes of the weights, the fast path's KV
cache and its fused weight copies; then a real `serve` process's RSS (anonymous and file-backed) when ready and after
one request, with the shipped drafter and without.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB20 = 20 * 1000 * 1000


def rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / 2**20, 1), "os": platform.platform(),
            "python": platform.python_version(), "load_1min": os.getloadavg()[0]}


class Sampler(threading.Thread):
    """RSS of one process every 20 ms; `peak` since the last reset."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except (OSError, ValueError):
                return


def start_server(code_root: Path, max_body_mb: float | None, drafter: str = "none") -> tuple[subprocess.Popen, str]:
    args = dict(model="embedded", drafter=drafter, host="127.0.0.1", port=0, uds=None, device="cpu", dtype="auto",
                max_context=None)
    if max_body_mb:
        args["max_body_bytes"] = int(max_body_mb * 2**20)
    code = "import json, sys; from backend.server.app import serve; serve(**json.loads(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    process = subprocess.Popen([sys.executable, "-c", code, json.dumps(args)], cwd=code_root, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, env=env)
    url = re.search(r"listening on (\S+)", process.stdout.readline()).group(1)
    return process, url


class ServerDied(Exception):
    pass


async def hostile(url: str, process: subprocess.Popen, phases: list[str]) -> dict:
    import httpx

    pid = process.pid
    sampler = Sampler(pid)
    sampler.start()
    out: dict = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        while (await http.get("/health")).status_code != 200:
            await asyncio.sleep(0.2)
        await asyncio.sleep(2)
        out["idle_rss_mb"] = round(rss_bytes(pid) / 2**20)

        async def post(path: str, body: dict) -> int | str:
            try:
                return (await http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
                        ).status_code
            except httpx.HTTPError as exc:  # a server that closes early, or died (OOM-killed: see server_exit)
                return type(exc).__name__

        def phase(name: str, statuses, started: float) -> None:
            out[name] = {"statuses": statuses, "seconds": round(time.monotonic() - started, 2),
                         "peak_rss_mb": round(sampler.peak / 2**20)}
            if process.poll() is None:
                out[name]["rss_after_mb"] = round(rss_bytes(pid) / 2**20)
            else:
                out["server_exit"] = f"{process.returncode} during {name}" + (
                    " (SIGKILL: out of memory?)" if process.returncode == -9 else "")
                raise ServerDied

        try:
            await load_phases(http, url, pid, sampler, post, phase, out, phases)
        except ServerDied:
            pass
    out["peak_rss_mb"] = max(v["peak_rss_mb"] for v in out.values() if isinstance(v, dict))
    sampler.done.set()
    return out


async def load_phases(http, url: str, pid: int, sampler: Sampler, post, phase, out: dict, phases: list[str]) -> None:
    big = "a " * (MB20 // 2)
    if "chat" in phases:
        sampler.peak = rss_bytes(pid)
        t = time.monotonic()
        chat = {"model": "embedded", "max_tokens": 4, "messages": [{"role": "user", "content": big}]}
        phase("chat_4x20MB", list(await asyncio.gather(*[post("/v1/chat/completions", chat) for _ in range(4)])), t)
    if "completions" in phases:
        await completions_phase(http, url, pid, sampler, post, phase, out, big)
    if "messages" in phases:
        sampler.peak = rss_bytes(pid)
        t = time.monotonic()
        messages = {"model": "embedded", "max_tokens": 4, "messages": [{"role": "user", "content": big}]}
        phase("messages_4x20MB", list(await asyncio.gather(*[post("/v1/messages", messages) for _ in range(4)])), t)
    await asyncio.sleep(3)
    out["after_rss_mb"] = round(rss_bytes(pid) / 2**20)
    ok = await http.post("/v1/chat/completions", json={"model": "embedded", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}]})
    out["served_afterwards"] = ok.status_code


async def completions_phase(http, url: str, pid: int, sampler: Sampler, post, phase, out: dict, big: str) -> None:
    import httpx

    sampler.peak = rss_bytes(pid)
    t, slowest, stop = time.monotonic(), 0.0, asyncio.Event()

    async def probe() -> None:
        nonlocal slowest
        async with httpx.AsyncClient(base_url=url, timeout=600) as h:
            while not stop.is_set():
                s = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    await h.get("/health")
                slowest = max(slowest, time.monotonic() - s)
                await asyncio.sleep(0.05)

    prober = asyncio.create_task(probe())
    status = await post("/v1/completions", {"model": "embedded", "max_tokens": 4, "prompt": big})
    stop.set()
    await prober
    phase("completions_20MB", [status], t)
    out["completions_20MB"]["slowest_health_ms"] = round(slowest * 1e3, 1)


def memory_split(pid: int | str) -> dict:
    status = dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in ln)
    return {k: round(int(status[k].split()[0]) / 1024) for k in ("VmRSS", "RssAnon", "RssFile")}


def idle_servers(code_root: Path) -> dict:
    """A real `serve` process, with the shipped drafter (the default) and without: MB when /health turns 200 and
    after one short chat request (the first forward touches every weight page)."""
    import httpx

    out = {}
    for drafter in ("auto", "none"):
        process, url = start_server(code_root, None, drafter)
        try:
            with httpx.Client(base_url=url, timeout=300) as http:
                while http.get("/health").status_code != 200:
                    time.sleep(0.5)
                ready = memory_split(process.pid)
                http.post("/v1/chat/completions", json={"model": "embedded", "max_tokens": 32, "messages": [
                    {"role": "user", "content": "hi"}]})
                time.sleep(1)
                out[f"drafter_{drafter}"] = {"ready_mb": ready, "after_one_request_mb": memory_split(process.pid)}
        finally:
            process.terminate()
            process.wait(30)
    return out


def idle_breakdown() -> dict:
    """RSS after each step of a server start, in this process (MB)."""
    import ctypes

    steps = {"python": rss_bytes()}
    import torch

    steps["import torch"] = rss_bytes()
    import transformers  # noqa: F401

    steps["import transformers"] = rss_bytes()
    from backend.decoding.engine import Engine, SamplingParams
    from backend.loading import load_model

    steps["import backend.decoding.engine"] = rss_bytes()
    loaded = load_model("embedded", "cpu", "auto", None)
    steps["weights loaded"] = rss_bytes()
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    engine = Engine(loaded.model, drafter=None, max_context=loaded.max_context)
    steps["engine made"] = rss_bytes()
    # What the engine's fast path holds beside the transformers model: its KV cache (allocated up front for the
    # whole window) and the fused projections (wqkv, w_gate_up: new tensors; the originals stay in the HF model).
    fast = getattr(getattr(getattr(engine, "target", None), "fast", None), "model", None)
    hf_storages = {p.untyped_storage().data_ptr() for p in loaded.model.parameters()}
    kv = getattr(fast, "kv", None)
    held = {"kv_cache_mb": round((kv.k.nbytes + kv.v.nbytes) / 2**20) if kv is not None else None,
            "fused_weight_copies_mb": round(sum(p.nbytes for p in fast.parameters()
                                                if p.untyped_storage().data_ptr() not in hf_storages) / 2**20)
            if fast is not None else None}
    list(engine.generate(loaded.tokenizer("Hello there")["input_ids"], SamplingParams(max_tokens=8, temperature=0)))
    steps["one generation"] = rss_bytes()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    steps["after malloc_trim"] = rss_bytes()
    status = dict(ln.split(":", 1) for ln in Path("/proc/self/status").read_text().splitlines() if ":" in ln)
    # file-backed pages are the safetensors weights mapped from the cache: clean, the kernel can drop them
    held["rss_anon_mb"], held["rss_file_mb"] = (round(int(status[k].split()[0]) / 1024) for k in ("RssAnon", "RssFile"))
    mb = {k: round(v / 2**20) for k, v in steps.items()}
    names = list(mb)
    return {"rss_mb": mb, "delta_mb": {names[i]: mb[names[i]] - mb[names[i - 1]] for i in range(1, len(names))},
            "weights_mb": round(weights / 2**20), **held, "dtype": str(loaded.model.dtype),
            "max_context": loaded.max_context,
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--code-root", type=Path, default=ROOT, help="checkout whose backend/ the server runs")
    ap.add_argument("--max-body-mb", type=float, help="the server's body cap (default: its own); 64 lets the 20 MB "
                    "bodies through to parsing, rendering and tokenizing")
    ap.add_argument("--phases", default="chat,completions,messages", help="which loads, in this order")
    ap.add_argument("--idle", action="store_true", help="the idle breakdown instead of the hostile load")
    ap.add_argument("--label", default="", help="name of this record in the results file, e.g. before / after")
    ap.add_argument("--note", default="", help="stored with the record (e.g. the memory cgroup it ran in)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_hostile_cpu.json")
    opts = ap.parse_args()
    record = {"benchmark": "serve_hostile", "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "note": opts.note}
    if opts.idle:
        sys.path.insert(0, str(opts.code_root))
        record["idle"] = idle_breakdown()
        record["idle_servers"] = idle_servers(opts.code_root)
    else:
        process, url = start_server(opts.code_root, opts.max_body_mb)
        try:
            record["load"] = asyncio.run(hostile(url, process, opts.phases.split(",")))
        finally:
            process.terminate()
            process.wait(30)
    print(json.dumps(record, indent=2))
    results = json.loads(opts.out.read_text()) if opts.out.exists() else {}
    results[opts.label or ("idle" if opts.idle else "load")] = record
    opts.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
