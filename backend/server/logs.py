"""Logs that cannot flood (issue 42): a flood of connections once wrote 139,000 "socket.accept() out of system
resource" errors, 59 MB in 37 s. `RepeatFilter`, on every handler of the server's loggers, lets the first few
records of a kind through in each window and counts the rest; when the window closes, one summary line says how many
were left out, and reviewer_log_lines_suppressed counts them in /metrics. `count_accept_errors` is the event loop's
exception handler: it counts accept() failures (reviewer_accept_errors) and leaves the logging to asyncio's default
handler (which the filter then bounds). Imports nothing of the server but metrics.py.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

from backend.server.metrics import Metrics

WINDOW_SECONDS = 10.0
BURST = 3  # records of one kind let through per window
LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "asyncio")  # whose handlers get the filter


@dataclasses.dataclass
class Kind:
    logger: str
    level: int
    first_line: str
    window_start: float
    example: str = ""  # the first line of the window's first record, formatted (the template may read "%s")
    passed: int = 0
    suppressed: int = 0


class RepeatFilter(logging.Filter):
    """Per kind of record (logger, level, the message's first line before formatting): BURST records per window,
    then a count. The summary goes out through the same logger, at the same level, when the kind's window has closed
    (at its next record, or at the next `flush` from the timer thread)."""

    def __init__(self, metrics: Metrics | None, window: float = WINDOW_SECONDS, burst: int = BURST):
        super().__init__()
        self.metrics, self.window, self.burst = metrics, window, burst
        self.kinds: dict[tuple, Kind] = {}
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "repeat_summary", False):
            return True
        first_line = str(record.msg).split("\n", 1)[0][:200]
        key = (record.name, record.levelno, first_line)
        now = time.monotonic()
        with self.lock:
            kind = self.kinds.get(key)
            if kind is None:
                kind = self.kinds[key] = Kind(record.name, record.levelno, first_line, now)
            due = self._close_window(kind, now)
            if kind.passed < self.burst:
                if not kind.passed:
                    kind.example = record.getMessage().split("\n", 1)[0][:200]
                kind.passed += 1
                keep = True
            else:
                kind.suppressed += 1
                keep = False
        if due:
            self._summarize(*due)
        if not keep and self.metrics is not None:
            self.metrics.log_suppressed.labels(record.name or "root").inc()
        return keep

    def _close_window(self, kind: Kind, now: float) -> tuple | None:
        """Start a new window if this one is over; what to summarize, if anything was left out. Holds the lock."""
        if now - kind.window_start < self.window:
            return None
        due = (kind.logger, kind.level, kind.example or kind.first_line, kind.suppressed,
               now - kind.window_start) if kind.suppressed else None
        kind.window_start, kind.passed, kind.suppressed = now, 0, 0
        return due

    def _summarize(self, logger: str, level: int, first_line: str, count: int, seconds: float) -> None:
        logging.getLogger(logger).log(
            level, "(%d more like %r left out of the log in the last %.0f s; reviewer_log_lines_suppressed counts "
                   "them)", count, first_line, seconds, extra={"repeat_summary": True})

    def flush(self) -> None:
        """Summarize every kind whose window has closed (the timer thread calls this once a window)."""
        now = time.monotonic()
        with self.lock:
            due = [d for kind in self.kinds.values() if (d := self._close_window(kind, now))]
            # a kind quiet for a whole window is forgotten, so the table stays as small as what is being logged
            for key in [k for k, kind in self.kinds.items() if now - kind.window_start > 2 * self.window]:
                del self.kinds[key]
        for d in due:
            self._summarize(*d)


def install_log_limits(metrics: Metrics | None, window: float = WINDOW_SECONDS) -> RepeatFilter:
    """Put one RepeatFilter on every handler of the server's loggers (call after uvicorn has configured its own)
    and start the thread that writes the summaries of windows that closed in silence."""
    limiter = RepeatFilter(metrics, window)
    if not logging.getLogger().handlers:  # else asyncio's records reach logging.lastResort, which no filter guards
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for name in LOGGERS:
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(limiter)

    def summaries():
        while True:
            time.sleep(window)
            limiter.flush()

    threading.Thread(target=summaries, name="reviewer-log-summaries", daemon=True).start()
    return limiter


def count_accept_errors(metrics: Metrics):
    """An event-loop exception handler: counts accept() failures, then logs as asyncio would."""
    def handler(loop, context: dict) -> None:
        if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            metrics.accept_errors.inc()
        loop.default_exception_handler(context)
    return handler
