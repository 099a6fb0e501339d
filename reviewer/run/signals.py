"""SIGTERM handled like Ctrl-C, for `reviewer run` and `reviewer loop`: `kill PID` marks the rows interrupted, removes
the workspace and releases the lock."""

from __future__ import annotations

import contextlib
import signal
import threading

_sigterm_received = threading.Event()


def stop_requested() -> bool:
    """True once SIGTERM has arrived under sigterm_as_interrupt. Its KeyboardInterrupt can be lost on the way: raised
    in the middle of a database call, it leaves the connection busy, and a library's cleanup that then fails raises an
    ordinary error in its place (SQLAlchemy's pool pre-ping restoring psycopg's autocommit: "can't change 'autocommit'
    now: connection in transaction status ACTIVE"). Code that handles an error and carries on asks this first."""
    return _sigterm_received.is_set()


def _on_sigterm(signum, frame):
    _sigterm_received.set()  # first: the exception below may not survive, the flag does
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt():
    """`kill PID` stops a review like Ctrl-C does: rows marked interrupted, workspace removed, lock released."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        _sigterm_received.clear()  # the outermost command of this process: a signal from an earlier one is done with
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
