"""The embedded LLM backend: `reviewer serve` as a subprocess, for the length of a review (`start_embedded`) or of a
whole `reviewer loop` (`EmbeddedBackend`): the one place that starts and stops it.

It gets a free port, logs to a file, and counts as started only once GET /health answers 200 (a spinner shows the
wait). If it dies first, or is not healthy within the deadline, LLMError names the log and quotes its tail. It is
always stopped at the end: SIGTERM to its process group, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from reviewer.llm.errors import LLMError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to the process group, then SIGKILL if it is still there after `grace` seconds."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass
class Launch:
    command: list[str]
    base: str  # http://127.0.0.1:PORT
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)


def embedded_launch(settings, command: list[str] | None = None, log_path: Path | None = None) -> Launch:
    """What to run: `reviewer serve` on a free port, or a given command where `{port}` is replaced."""
    port = free_port()
    if command:
        argv = [c.replace("{port}", str(port)) for c in command]
    else:
        argv = [sys.executable, "-m", "reviewer.cli", "serve", "--model", settings.embedded_model, "--port", str(port)]
    if log_path is None:
        folder = Path(settings.workdir) if settings.workdir else Path(tempfile.gettempdir())
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / f"reviewer-serve-{port}.log"
    env = dict(os.environ)
    if settings.api_key:  # through the environment, so it does not show in `ps`
        env["REVIEWER_SERVE_API_KEY"] = settings.api_key
    return Launch(argv, f"http://127.0.0.1:{port}", Path(log_path), env)


@contextlib.contextmanager
def start_embedded(settings, console=None, *, command: list[str] | None = None, log_path: Path | None = None,
                   ready_timeout: float = 900.0) -> Iterator[str]:
    """Run the local backend for the length of the `with` block; yields its base URL (…/v1). Its output goes to a
    log file; if it dies or is not healthy within `ready_timeout`, LLMError names the log and quotes its tail."""
    launch = embedded_launch(settings, command, log_path)
    with open(launch.log_path, "wb") as log:
        proc = subprocess.Popen(launch.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=launch.env, start_new_session=True)
    try:
        wait_healthy(proc, launch, ready_timeout, console)
        yield launch.base + "/v1"
    finally:
        stop_process(proc)


def wait_healthy(proc: subprocess.Popen, launch: Launch, ready_timeout: float, console=None) -> None:
    start = time.monotonic()
    status = console.status("starting the embedded LLM backend") if console is not None else contextlib.nullcontext()
    with status as spinner:
        while True:
            code = proc.poll()
            if code is not None:
                tail = log_tail(launch.log_path)
                raise LLMError(f"the embedded LLM backend exited with code {code} before it was ready "
                               f"(log: {launch.log_path})" + (f"; last lines:\n{tail}" if tail else ""))
            try:
                if httpx.get(launch.base + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            waited = time.monotonic() - start
            if waited > ready_timeout:
                raise LLMError(f"the embedded LLM backend was not ready after {ready_timeout:.0f} s "
                               f"(log: {launch.log_path})")
            if spinner is not None:
                spinner.update(f"starting the embedded LLM backend ({waited:.0f} s, log: {launch.log_path})")
            time.sleep(0.25)


class EmbeddedBackend:
    """`--llm embedded` for a `reviewer loop`'s whole life: the local backend is started once, on the first review that
    needs it (under the machine lock, so loading the model never disturbs another review), and started again only if
    it stopped answering; each review then talks to it by URL. Remote endpoints are opened by each review as usual, so
    an inference box that comes back is used again at the next review. `needed`: an LLM persona is selected and
    `embedded` is among the endpoints; `log(message, style)` says what happens in the loop's log."""

    def __init__(self, settings, console, *, needed: bool, log: Callable[..., None]):
        self.settings, self.console, self.log = settings, console, log
        self.stack: contextlib.ExitStack | None = None
        self.url: str | None = None
        self.needed = needed

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url.removesuffix("/v1") + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def settings_for_review(self):
        """The settings a review runs with: `embedded` replaced by the running backend's URL."""
        if not self.needed:
            return self.settings
        if self.url is not None and not self.healthy():
            self.log(f"the embedded LLM backend at {self.url} stopped answering: starting it again", "yellow")
            self.close()
        if self.url is None:
            stack = contextlib.ExitStack()
            try:
                self.url = stack.enter_context(start_embedded(self.settings, self.console))
            except BaseException:
                stack.close()
                raise
            self.stack = stack
            self.log(f"embedded LLM backend ready at {self.url}; it serves every review of this loop")
        return self.settings.model_copy(update={"llm": [self.url if s == "embedded" else s for s in self.settings.llm]})

    def close(self) -> None:
        if self.stack is not None:
            self.stack.close()
        self.stack, self.url = None, None
