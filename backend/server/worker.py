"""The one engine thread, and the bridge between it and the event loop.

The engine is blocking and not thread-safe, so a single EngineWorker thread runs it, one Job at a time, in the order the
jobs were queued (FIFO). The worker applies the job's stop policy (stops.py) as the engine yields: it turns token ids
into text deltas (incremental detokenizer, stop strings with their held-back tail) and closes the engine's generator
at a stop string, so the reply ends there with "stop". Text deltas travel back to the request's event loop through
`call_soon_threadsafe` into an asyncio.Queue. The request side sets `job.cancelled` (client gone, waited too long) and
the engine checks it between steps. Generation is the request side's view: the deltas, the finish reason and
llama-server-style timings.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from backend.server.metrics import Metrics
from backend.server.stops import StopPolicy, StopText

if TYPE_CHECKING:
    from backend.decoding.engine import GenerationStats, SamplingParams

log = logging.getLogger("reviewer.backend")


@dataclasses.dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams  # its stop_token_ids are stop.ids
    stop: StopPolicy
    tokenizer: object  # the loaded model's (transformers) tokenizer, for the reply's text
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    started: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    enqueued_at: float = dataclasses.field(default_factory=time.perf_counter)
    queue_seconds: float = 0.0
    # Set on the event loop, read by the engine thread between steps; a plain attribute is enough under the GIL.
    cancelled: bool = False


class EngineWorker:
    """Runs the (blocking, not thread-safe) engine on one dedicated thread, one job at a time, in FIFO order."""

    def __init__(self, engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="reviewer-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        self.metrics.queue_depth.inc()
        self.jobs.put(job)

    def stop(self) -> None:
        self.jobs.put(None)

    def _call(self, job: Job, fn, *args) -> None:
        """Run fn(*args) on the job's event loop (asyncio objects are not thread-safe)."""
        try:
            job.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening any more
            job.cancelled = True

    def _send(self, job: Job, item) -> None:
        self._call(job, job.events.put_nowait, item)

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            self.metrics.queue_depth.dec()
            if job.cancelled:  # its client left (or timed out) while it waited
                continue
            job.queue_seconds = time.perf_counter() - job.enqueued_at
            self.metrics.queue_seconds.observe(job.queue_seconds)
            self._call(job, job.started.set)
            try:
                self._run(job)
            except Exception as exc:  # never let one request kill the only engine thread
                log.exception("engine worker error")
                self._send(job, ("error", exc))

    def _run(self, job: Job) -> None:
        """Generate, applying the job's stop policy here (stop ids end it in the engine, a stop string closes the
        engine at the yield that completed it), and send the text deltas, then the Outcome."""
        text = StopText(job.stop, job.tokenizer)
        generator = self.engine.generate(job.prompt_ids, job.params, cancelled=lambda: job.cancelled)
        try:
            for token_ids in generator:
                self._send_text(job, text.push(list(token_ids)))
                if text.matched is not None:
                    generator.close()  # the engine stops at this yield, consistent (as any early close leaves it)
                    break
        except Exception as exc:  # the engine resets itself; report it to this request and keep serving
            log.exception("generation failed")
            generator.close()
            self._send(job, ("error", exc))
            return
        self._send_text(job, text.flush())
        stats = dataclasses.replace(self.engine.last_stats)
        if text.matched is not None:
            stats.finish_reason = "stop"  # the policy ended it (the closed engine never saw an end of its own)
        self.metrics.record_generation(stats)
        self._send(job, ("done", Outcome(stats, text.matched)))

    def _send_text(self, job: Job, delta: str) -> None:
        if delta:
            self._send(job, ("text", delta))


@dataclasses.dataclass
class Outcome:
    """How a job ended: the engine's GenerationStats (finish_reason "stop" | "length" | "cancelled") and the stop
    string that ended it, if one did."""

    stats: GenerationStats
    stop_string: str | None = None


class Generation:
    """One job's output on the request's event loop: the text deltas the worker sends (already cut at stop strings),
    then its Outcome."""

    def __init__(self, job: Job):
        self.job = job
        self.stats: GenerationStats | None = None
        self.stop_string: str | None = None  # the stop string that ended the reply, once it is done
        self.failed = False

    async def deltas(self):
        try:
            while True:
                kind, payload = await self.job.events.get()
                if kind == "text":
                    yield payload
                elif kind == "done":
                    self.stats, self.stop_string = payload.stats, payload.stop_string
                    break
                else:
                    raise payload
        finally:
            if self.stats is None:
                self.job.cancelled = True  # the consumer went away early (client disconnected): stop at once

    @property
    def finish_reason(self) -> str:
        """"stop" | "length" | "cancelled" (a stop id or a stop string: "stop")."""
        return self.stats.finish_reason if self.stats else "cancelled"

    def timings(self) -> dict:
        """Per-response timings, named like llama-server's `timings`, plus the speculative counters."""
        s = self.stats
        if s is None:
            return {}
        prefilled = max(s.prompt_tokens - s.cached_tokens, 0)
        return {
            "prompt_n": s.prompt_tokens, "cache_n": s.cached_tokens,
            "prompt_ms": s.prefill_seconds * 1e3,
            "prompt_per_second": prefilled / s.prefill_seconds if s.prefill_seconds else 0.0,
            "predicted_n": s.generated_tokens, "predicted_ms": s.decode_seconds * 1e3,
            "predicted_per_second": s.generated_tokens / s.decode_seconds if s.decode_seconds else 0.0,
            "queue_ms": self.job.queue_seconds * 1e3,
            "spec_cycles": s.cycles, "draft_n": s.draft_tokens, "draft_n_accepted": s.accepted_tokens,
            "draft_accepted_per_position": list(s.accepted_per_position or []),
            "draft_ms": s.draft_seconds * 1e3, "verify_ms": s.verify_seconds * 1e3,
        }

