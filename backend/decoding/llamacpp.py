"""The CPU engine for GGUF models: llama.cpp's own runtime (the `xllamacpp` wheel, prebuilt for CPUs), behind the same
few calls the server makes of `Engine` (generate, last_stats, describe_decoding), so the routes, chat templates,
tool parsing, stop strings and timings stay ours.

Why: on a CPU decode is memory-bound, and llama.cpp reads the file's own quantized weights (Q4_1 for the embedded
model) with kernels written for that, where our torch engine reads fp32 (7x the bytes) on CPUs without AMX. Measured
side by side (bench/cpu_peer.py, bench/results/cpu_peer-*.json): the torch engine ran at 0.27x llama.cpp idle and
0.02x with two busy processes beside it; this engine serves at llama.cpp's speed in both. The DFlash drafter is a
torch model, so this engine decodes plainly; `reviewer serve --cpu-engine torch` keeps the torch engine (and its
speculation) where that is wanted.

Threads: llama.cpp's worker threads spin between ops by default, which on a shared machine takes cores from the
sandboxed installs and tests the reviewer runs beside the model, and stalls the model itself when its spinners are
descheduled. choose_threads() picks the count from the CPUs this process may use and the machine's load, with a
passive wait: ggml's `poll` 0 for its own thread pool, and OMP_WAIT_POLICY=PASSIVE (set by `serve` before the library
loads) for builds whose threads are OpenMP's, as the xllamacpp wheel's are. The choice is printed in the ready line.

Data flow: server worker thread -> LlamaCppEngine.generate(prompt_ids) -> xllamacpp.Server.handle_completions (token
ids in, one streamed chunk per token, its id from the chunk's logprobs) on a helper thread -> a queue -> token ids
yielded to the worker. Prefix reuse is llama.cpp's prompt cache (`cache_prompt`).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from backend.decoding.engine import GenerationStats, SamplingParams, check_request

log = logging.getLogger("reviewer.backend")

DIST = "xllamacpp"


def available() -> bool:
    """Whether llama.cpp's runtime is installed (found without importing it: the import loads a 100 MB library)."""
    return importlib.util.find_spec(DIST) is not None


@dataclass
class ThreadChoice:
    threads: int  # decode
    poll: int  # ggml's busy-wait level between ops: 0 = sleep at once (passive), 50 = llama.cpp's default
    why: str
    batch_threads: int = 0  # prefill (0: as many as `threads`)

    def describe(self) -> str:
        wait = "passive wait" if self.poll == 0 else f"spin-wait {self.poll}"
        batch = self.batch_threads or self.threads
        count = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        if batch != self.threads:
            count = f"{count} decoding, {batch} prefilling"
        return f"{count}, {wait} ({self.why})"


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_threads(threads: int | None = None, cpus: int | None = None, load: float | None = None) -> ThreadChoice:
    """Threads for decoding on this machine. One thread per usable CPU when the machine is idle; when other work
    already keeps cores busy (the 1-minute load average), fewer, leaving those cores to it, but never below one. Always
    a passive wait: measured on two shared cores, a spinning pool lost its time slices to the busy processes and decode
    fell several-fold (bench/results/cpu_peer-*.json), while the passive pool lost nothing when idle."""
    if threads is not None:
        return ThreadChoice(max(1, threads), 0, "asked for")
    cpus = usable_cpus() if cpus is None else cpus
    # Prefill is compute-bound and short: it takes every usable CPU whatever the load (fewer threads only gave the
    # busy processes a larger share of the cores while a 4,000-token prompt waited: bench/results/cpu_prefill-*.json).
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = 0.0
    free = max(1, int(cpus - load + 0.5))
    if free >= cpus:
        return ThreadChoice(cpus, 0, f"{cpus} usable CPUs, idle", cpus)
    return ThreadChoice(free, 0, f"{cpus} usable CPUs, load {load:.1f}", cpus)


def runtime_version() -> str:
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class LlamaCppEngine:
    """Batch-1 generation from a GGUF file on llama.cpp's CPU runtime. Not thread-safe: one worker thread drives it,
    as it does Engine."""

    fast = False
    lossless = True  # plain decoding: nothing to be lossless against
    drafter = None

    def __init__(self, gguf: Path, *, max_context: int, vocab_size: int, threads: ThreadChoice,
                 weights: str = "the file's own quantized weights"):
        import xllamacpp

        self.gguf, self.max_context, self.vocab_size = Path(gguf), max_context, vocab_size
        self.threads, self.weights = threads, weights
        params = xllamacpp.CommonParams()
        params.model.path = str(self.gguf)
        params.n_ctx = max_context
        params.n_parallel = 1  # batch 1, as our engine: the server queues requests in FIFO order
        params.n_gpu_layers = 0
        params.warmup = True
        for cpu, count in ((params.cpuparams, threads.threads),
                           (params.cpuparams_batch, threads.batch_threads or threads.threads)):
            cpu.n_threads = count
            cpu.poll = threads.poll
        params.verbosity = -1
        self.server = xllamacpp.Server(params)
        self.last_stats = GenerationStats()

    def describe_decoding(self) -> str:
        return (f"plain decoding on llama.cpp's CPU runtime (xllamacpp {runtime_version()}, {self.weights}; "
                f"{self.threads.describe()}); the DFlash drafter runs on the torch engine: --cpu-engine torch")

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 cancelled: Callable[[], bool] = lambda: False) -> Iterator[list[int]]:
        """Yield lists of newly committed token ids; afterwards self.last_stats holds the GenerationStats. Closing the
        generator early stops llama.cpp at its next token."""
        prompt = [int(t) for t in prompt_ids]
        check_request(prompt, params, self.max_context, self.vocab_size)
        stats = self.last_stats = GenerationStats(prompt_tokens=len(prompt))
        budget = min(params.max_tokens, self.max_context - len(prompt))
        if budget <= 0:
            return
        run = _Run(self.server, _request(prompt, params, budget), cancelled)
        stop = set(params.stop_token_ids)
        try:
            while (item := run.tokens.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                if item in stop:
                    stats.finish_reason = "stop"
                    run.stop = True
                    break
                stats.generated_tokens += 1
                yield [item]
        finally:
            run.stop = True
            run.thread.join()
        if stats.finish_reason != "stop":
            # llama.cpp itself ends at the vocabulary's end-of-generation tokens (they are in every stop list the
            # server sends; its own finish reason says so when they are not)
            ended = next((c.get("finish_reason") for c in run.final.get("choices") or ()), None)
            stats.finish_reason = ("cancelled" if run.cancelled_seen else "stop" if ended == "stop" else "length")
        _fill_timings(stats, run.final)


class _Run:
    """One handle_completions call on a helper thread: its chunks' token ids into a queue, ending with None."""

    def __init__(self, server, request: dict, cancelled: Callable[[], bool]):
        self.tokens: queue.Queue = queue.Queue()
        self.stop = False  # set by the consumer: the next chunk's callback ends the stream
        self.cancelled, self.cancelled_seen = cancelled, False
        self.final: dict = {}
        self.thread = threading.Thread(target=self._call, args=(server, request), name="llama.cpp", daemon=True)
        self.thread.start()

    def _on_chunk(self, chunk) -> bool:
        if isinstance(chunk, dict):
            if "timings" in chunk:
                self.final = chunk
            for choice in chunk.get("choices") or ():
                for entry in (choice.get("logprobs") or {}).get("content") or ():
                    self.tokens.put(int(entry["id"]))
            if "error" in chunk:
                self.tokens.put(RuntimeError(f"llama.cpp: {chunk['error']}"))
        if self.cancelled():
            self.cancelled_seen = True
        return self.stop or self.cancelled_seen

    def _call(self, server, request: dict) -> None:
        try:
            answer = server.handle_completions(request, self._on_chunk)
            if isinstance(answer, dict) and "error" in answer:
                self.tokens.put(RuntimeError(f"llama.cpp: {answer['error']}"))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it in the request
            self.tokens.put(exc)
        finally:
            self.tokens.put(None)


def _request(prompt: list[int], params: SamplingParams, budget: int) -> dict:
    """The completion request: our sampling (greedy, or temperature then top-p) and nothing of llama.cpp's own
    defaults (top-k 40, min-p 0.05); token ids from logprobs. llama.cpp ends at the vocabulary's end-of-generation
    tokens itself (its ignore_eos would forbid them, not pass them through); our stop ids end it at any others."""
    request = {"prompt": prompt, "max_tokens": budget, "stream": True, "logprobs": 1, "cache_prompt": True,
               "top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
               "temperature": params.temperature, "top_p": params.top_p,
               "seed": params.seed if params.seed is not None else -1}
    if params.temperature == 0:
        request.update(temperature=0.0, top_k=1)
    return request


def _fill_timings(stats: GenerationStats, final: dict) -> None:
    timings = final.get("timings") or {}
    stats.cached_tokens = int(timings.get("cache_n", 0))
    stats.prefill_seconds = float(timings.get("prompt_ms", 0.0)) / 1e3
    stats.decode_seconds = float(timings.get("predicted_ms", 0.0)) / 1e3
