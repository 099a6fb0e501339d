"""Scripts that run Triton kernels under Triton's CPU interpreter, for the kernel tests (test_fused_moe, test_gemv,
test_norm_gemv, test_block_attention, test_fast_models). TRITON_INTERPRET=1 must be set before triton is imported and
must not leak into other tests, so each script is a subprocess; `run(script)` returns its CompletedProcess.

The interpreter is slow (minutes of single-threaded CPU per module on 2 cores: about a quarter of the suite's time)
while most other tests leave a core idle (servers, sandboxes, git, pip). So conftest.py queues the scripts of the
selected kernel modules at collection (`prestart`) and moves those modules to the end of the session; one background
process at a time runs them at the lowest CPU priority, on what the rest of the suite leaves idle, and `run` takes the
finished result. A script not yet started when a test asks runs at once, and one still running is waited for at normal
priority: the result is the same bytes, only when it is computed changes.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BACKGROUND_TIMEOUT = 3600  # a background run shares the CPU; a test's own wait keeps its timeout


class _Job:
    def __init__(self, script: str, args: tuple[str, ...]):
        self.script, self.args = script, args
        self.process: subprocess.Popen | None = None
        self.result: subprocess.CompletedProcess | None = None
        self.done = threading.Event()


_lock = threading.Lock()
_jobs: dict[tuple, _Job] = {}
_queue: list[_Job] = []
_worker: threading.Thread | None = None


def _start(job: _Job, nice: bool) -> subprocess.Popen:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", job.script, str(REPO), *job.args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=(lambda: os.nice(19)) if nice else None)


def _finish(job: _Job, timeout: float) -> subprocess.CompletedProcess:
    try:
        out, err = job.process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.process.kill()
        job.process.communicate()
        raise
    return subprocess.CompletedProcess(job.process.args, job.process.returncode, out, err)


def _background() -> None:
    while True:
        with _lock:
            if not _queue:
                return
            job = _queue.pop(0)
            job.process = _start(job, nice=True)
        try:
            job.result = _finish(job, BACKGROUND_TIMEOUT)
        except subprocess.TimeoutExpired:
            job.process = None  # run() starts it again in the foreground
        job.done.set()


def prestart(script: str, *args: str) -> None:
    """Queue a script for the background runner (once per script and arguments)."""
    global _worker
    with _lock:
        if (script, args) in _jobs:
            return
        job = _jobs[(script, args)] = _Job(script, args)
        _queue.append(job)
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_background, name="triton-interpreter", daemon=True)
            _worker.start()


def run(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The script's CompletedProcess: the background result if there is one, else run now (at normal priority)."""
    with _lock:
        job = _jobs.setdefault((script, args), _Job(script, args))
        if job in _queue:  # not started yet: run it here
            _queue.remove(job)
        if job.process is None and not job.done.is_set():
            job.process = _start(job, nice=False)
            foreground = True
        else:
            foreground = False
    if foreground:
        job.result = _finish(job, timeout)
        job.done.set()
        return job.result
    if job.process is not None and job.process.poll() is None:
        try:  # running in the background: back to normal priority, now that a test waits on it
            os.setpriority(os.PRIO_PROCESS, job.process.pid, 0)
        except OSError:  # finished meanwhile, or not allowed (not root): it finishes all the same
            pass
    if not job.done.wait(timeout):
        raise subprocess.TimeoutExpired(job.process.args, timeout)
    if job.result is None:  # the background run timed out: once more, here
        with _lock:
            job.done.clear()
            job.process = _start(job, nice=False)
        job.result = _finish(job, timeout)
        job.done.set()
    return job.result


def stop() -> None:
    """End the background runner's process, if any (end of the session)."""
    with _lock:
        _queue.clear()
        for job in _jobs.values():
            if job.process is not None and job.process.poll() is None:
                job.process.kill()
