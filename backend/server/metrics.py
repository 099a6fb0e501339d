"""Prometheus metrics for the server (text format at GET /metrics).

Each app gets its own registry, so several servers in one process (the tests) do not share counters. The speculative
counters follow vLLM's spec_decode metrics: drafts (verify cycles), drafted tokens, accepted tokens, accepted tokens per
block position; they stay at zero on the plain decoding path.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("reviewer_requests", "Finished requests by route and outcome "
                                "(stop, length, tool_calls, cancelled, error, rejected, timeout, busy)",
                                ["route", "outcome"], registry=r)
        self.prompt_tokens = Counter("reviewer_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_tokens = Counter("reviewer_cached_prompt_tokens", "Prompt tokens reused from the cache", registry=r)
        self.generated_tokens = Counter("reviewer_generated_tokens", "Tokens generated", registry=r)
        self.prefill_seconds = Counter("reviewer_prefill_seconds", "Seconds spent in prefill", registry=r)
        self.decode_seconds = Counter("reviewer_decode_seconds", "Seconds spent decoding", registry=r)
        self.generation_seconds = Histogram("reviewer_generation_seconds", "Prefill + decode seconds per request",
                                            buckets=_SECONDS_BUCKETS, registry=r)
        self.queue_seconds = Histogram("reviewer_queue_wait_seconds", "Seconds a request waited for the engine",
                                       buckets=_SECONDS_BUCKETS, registry=r)
        self.queue_depth = Gauge("reviewer_queue_depth", "Requests waiting for the engine", registry=r)
        self.queue_limit = Gauge("reviewer_queue_limit", "Requests that may wait for the engine (--max-queue)",
                                 registry=r)
        self.connections = Gauge("reviewer_connections", "Open client connections by tier (served: under "
                                 "--max-connections; overflow: beyond it, answered on /health and /metrics only)",
                                 ["tier"], registry=r)
        self.connection_limit = Gauge("reviewer_connection_limit", "Connections served at once (--max-connections)",
                                      registry=r)
        self.connections_refused = Counter("reviewer_connections_refused", "Connections turned away, by reason "
                                           "(over_cap: 503 at accept; overflow: 503 for a route other than /health "
                                           "and /metrics; header_timeout: 408)", ["reason"], registry=r)
        self.accept_errors = Counter("reviewer_accept_errors", "accept() failures (out of file descriptors or "
                                     "memory)", registry=r)
        self.log_suppressed = Counter("reviewer_log_lines_suppressed", "Repeated log lines left out (a summary line "
                                      "says how many), by logger", ["logger"], registry=r)
        for tier in ("served", "overflow"):  # listed at 0 from the start
            self.connections.labels(tier)
        for reason in ("over_cap", "overflow", "header_timeout"):
            self.connections_refused.labels(reason)
        self.model_ready = Gauge("reviewer_model_ready", "1 once the model is loaded", registry=r)
        self.spec_drafts = Counter("reviewer_spec_drafts", "Speculative cycles (draft + verify)", registry=r)
        self.spec_draft_tokens = Counter("reviewer_spec_draft_tokens", "Drafted tokens sent to verification", registry=r)
        self.spec_accepted_tokens = Counter("reviewer_spec_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.spec_accepted_per_pos = Counter("reviewer_spec_accepted_tokens_per_pos",
                                             "Cycles whose draft position k was accepted", ["position"], registry=r)
        self.spec_draft_seconds = Counter("reviewer_spec_draft_seconds", "Seconds spent drafting", registry=r)
        self.spec_verify_seconds = Counter("reviewer_spec_verify_seconds", "Seconds spent verifying", registry=r)

    def watch_captures(self, counts) -> None:
        """Export the engine's CaptureCounts (backend/models/captures.py, via Engine.captures), read at each scrape:
        CUDA graphs captured and kernels compiled, in all and after the ready line (which should stay 0)."""
        self.registry.register(_CaptureCollector(counts))

    def record_generation(self, stats) -> None:
        """Add one finished (or cancelled) generation's GenerationStats."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.generated_tokens.inc(stats.generated_tokens)
        self.prefill_seconds.inc(stats.prefill_seconds)
        self.decode_seconds.inc(stats.decode_seconds)
        self.generation_seconds.observe(stats.prefill_seconds + stats.decode_seconds)
        self.spec_drafts.inc(stats.cycles)
        self.spec_draft_tokens.inc(stats.draft_tokens)
        self.spec_accepted_tokens.inc(stats.accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position or []):
            self.spec_accepted_per_pos.labels(position=str(position)).inc(count)
        self.spec_draft_seconds.inc(stats.draft_seconds)
        self.spec_verify_seconds.inc(stats.verify_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CaptureCollector:
    def __init__(self, counts):
        self.counts = counts

    def collect(self):
        c = self.counts
        for name, doc, value in (
                ("reviewer_graph_captures", "CUDA graphs captured since start", c.captures),
                ("reviewer_graph_captures_after_ready", "CUDA graphs captured after the ready line (on the request "
                 "path)", c.captures_after_ready),
                ("reviewer_compilations", "torch.compile frames and Triton kernels compiled since start",
                 c.compilations),
                ("reviewer_compilations_after_ready", "Compilations after the ready line (on the request path)",
                 c.compilations_after_ready)):
            yield CounterMetricFamily(name, doc, value=value)
