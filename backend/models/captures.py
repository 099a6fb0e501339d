"""What the fast path captured or compiled, and how much of it came after the server said ready.

A CUDA-graph capture or a compilation (torch.compile, a Triton kernel's JIT) on the request path costs a user
seconds: `reviewer serve` captures every graph before its ready line (Engine.warm_up) and then calls mark_ready();
from then on each capture or compilation is logged at debug level and counted, and /metrics shows the counts
(`reviewer_graph_captures_after_ready_total`, `reviewer_compilations_after_ready_total`). The counts are process-wide
because the hooks of torch.compile and Triton are.

    from backend.models.captures import COUNTS, note_capture, mark_ready
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

log = logging.getLogger("reviewer.backend")


@dataclass
class CaptureCounts:
    captures: int = 0  # CUDA graphs captured (target steps and verifies, drafter cycles, Gated DeltaNet accepts)
    compilations: int = 0  # torch.compile frames and Triton kernels compiled or loaded for a new specialisation
    captures_after_ready: int = 0
    compilations_after_ready: int = 0
    ready: bool = False
    # what was captured or compiled after ready (the first MAX_NAMED), for a benchmark's record to say which
    after_ready: list = field(default_factory=list)


MAX_NAMED = 50


COUNTS = CaptureCounts()
_lock = threading.Lock()
_hooks_installed = False


def note_capture(what: str, key) -> None:
    """One CUDA graph captured (`what`: which graphs, `key`: its shape key)."""
    with _lock:
        COUNTS.captures += 1
        if COUNTS.ready:
            COUNTS.captures_after_ready += 1
            _name(f"graph {what} {key}")
            log.debug("CUDA graph captured after the ready line: %s %s", what, key)


def note_compilation(what: str) -> None:
    with _lock:
        COUNTS.compilations += 1
        if COUNTS.ready:
            COUNTS.compilations_after_ready += 1
            _name(what)
            log.debug("compiled after the ready line: %s", what)


def _name(what: str) -> None:
    if len(COUNTS.after_ready) < MAX_NAMED:
        COUNTS.after_ready.append(what)


def mark_ready() -> None:
    """From now on captures and compilations are on the request path."""
    install_compile_hooks()
    with _lock:
        COUNTS.ready = True


def install_compile_hooks() -> None:
    """Count torch.compile's frames and Triton's kernel compilations (once per process; a missing hook API in another
    torch or Triton version only means those are not counted)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    try:
        from torch._dynamo.callback import on_compile_start

        on_compile_start(lambda *args, **kwargs: note_compilation("torch.compile frame"))
    except (ImportError, AttributeError):
        pass
    try:
        import triton

        runtime = triton.knobs.runtime
        previous = runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            # repr: the specialisation (signature and constants), which says why a kernel compiled again
            name = getattr(kwargs.get("fn"), "name", "?")
            note_compilation(f"Triton kernel {name} {str(kwargs.get('repr', ''))[:1200]}")
            return previous(*args, **kwargs) if previous else None

        runtime.jit_post_compile_hook = hook
    except (ImportError, AttributeError):
        pass
