"""Running one command for a persona: baseline isolation.

Every command runs under `bash -c` with the workspace as its working directory, a scrubbed environment (an allowlist:
no API keys, no tokens, none of the user's own variables), in its own process group that is killed when the timeout
expires — and also when the command returns, so a forgotten background process can neither outlive the command nor
disturb the next persona's measurements. Output is stdout and stderr merged, capped to head + tail.

Given a `sandbox` (reviewer.sandbox.isolation.Sandbox), the command runs confined instead: bubblewrap, the allowlisting
network proxy and the resource limits (docs/sandbox.md), and what they blocked comes back as `events`. Without one,
this is the bare baseline above, which is not a security boundary (`--isolation none` still goes through the sandbox
module, with its limits, and says so in an event).
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

# Variables a build needs to find tools, registries and certificates. Values are passed through unchanged; anything
# not listed here (including every API key and token in the user's environment) never reaches a command.
PASSTHROUGH = (
    "LANG", "LC_ALL", "LC_CTYPE", "TZ",
    "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_CERT",
    "PIP_DEFAULT_TIMEOUT", "PIP_CONSTRAINT", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL",
    "NPM_CONFIG_REGISTRY", "npm_config_registry", "YARN_REGISTRY", "GOPROXY", "GOFLAGS", "GOTOOLCHAIN",
    "CARGO_REGISTRIES_CRATES_IO_PROTOCOL", "RUSTUP_TOOLCHAIN",
)
# Even an allowlisted name is dropped if it looks like it carries a secret.
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)


@dataclass
class CommandResult:
    exit_code: int | None  # None when killed by the timeout
    output: str  # stdout + stderr merged, capped: head + "[... N characters left out ...]" + tail
    seconds: float
    timed_out: bool
    truncated: bool
    events: list = field(default_factory=list)  # reviewer.sandbox.limits.Event: what the sandbox blocked or contained


def system_path(venv: Path | None) -> str:
    """The caller's PATH minus the reviewer's own virtual environment, with the workspace's venv first."""
    own_bins = {str(Path(sys.prefix) / "bin")}
    if os.environ.get("VIRTUAL_ENV"):
        own_bins.add(str(Path(os.environ["VIRTUAL_ENV"]) / "bin"))
    parts = [p for p in os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep) if p and p not in own_bins]
    if venv is not None:
        parts.insert(0, str(venv / "bin"))
    return os.pathsep.join(dict.fromkeys(parts))  # keep order, drop duplicates


def sandbox_env(*, home: Path, tmp: Path, venv: Path | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a sandboxed command: an allowlist, never the user's variables or secrets."""
    env = {k: v for k, v in os.environ.items() if k in PASSTHROUGH and not SECRET_NAME.search(k)}
    env.setdefault("LANG", "C.UTF-8")
    env.update(
        PATH=system_path(venv),
        HOME=str(home),
        TMPDIR=str(tmp),
        TERM="dumb",
        PAGER="cat",
        GIT_PAGER="cat",
        GIT_TERMINAL_PROMPT="0",
        PYTHONUNBUFFERED="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
    )
    # rustup keeps its toolchains under the real home; without this `cargo` finds no toolchain once HOME moves.
    rustup = Path(os.environ.get("RUSTUP_HOME", Path.home() / ".rustup"))
    if rustup.is_dir():
        env["RUSTUP_HOME"] = str(rustup)
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
    env.update(extra or {})
    return env


def cap_output(text: str, limit: int, dropped: int = 0) -> tuple[str, bool]:
    """Keep the first and last limit/2 characters; say how many were left out in between."""
    if len(text) <= limit and not dropped:
        return text, False
    half = max(limit // 2, 1)
    head, tail = text[:half], text[-half:] if len(text) > half else ""
    left_out = len(text) - len(head) - len(tail) + dropped
    return f"{head}\n[... {left_out} characters left out ...]\n{tail}", True


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_command(command: str, *, cwd: Path, env: dict[str, str], timeout: float, max_output: int = 200_000,
                sandbox=None) -> CommandResult:
    """Run `command` with bash in `cwd`; kill its whole process group on timeout (or Ctrl-C) and when it returns.
    With `sandbox` (reviewer.sandbox.isolation.Sandbox): confined, limited, and with the events it recorded."""
    if sandbox is not None:
        from reviewer.sandbox.isolation import run_sandboxed

        box = replace(sandbox, limits=replace(sandbox.limits, timeout=timeout, keep_output=max_output))
        o = run_sandboxed(command, sandbox=box, cwd=cwd, env=env)
        return CommandResult(exit_code=o.exit_code, output=o.output, seconds=o.seconds, timed_out=o.timed_out,
                             truncated=o.truncated, events=o.events)
    start = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # own session and process group: killpg reaches every child, Ctrl-C does not
    )
    # Bytes are kept as head + tail while reading, so a runaway `yes` costs bounded memory.
    head, tail, dropped = bytearray(), bytearray(), 0
    byte_cap = max_output * 2  # characters are decoded later; utf-8 needs at most a few bytes each

    def keep(chunk: bytes) -> None:
        nonlocal tail, dropped
        room = byte_cap - len(head)
        if room > 0:
            head.extend(chunk[:room])
            chunk = chunk[room:]
        tail.extend(chunk)
        if len(tail) > byte_cap:
            dropped += len(tail) - byte_cap
            del tail[: len(tail) - byte_cap]

    timed_out = False
    deadline = start + timeout
    drain_until = None  # after the main process exits: a moment to read what is still in the pipe
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    try:
        while True:
            now = time.monotonic()
            if drain_until is None and now >= deadline:
                timed_out = True
                kill_group(proc.pid)
                drain_until = now + 1.0
            if drain_until is not None and now >= drain_until:
                break
            wait = min(0.1, max((drain_until or deadline) - now, 0.0))
            eof = False
            for _ in sel.select(wait):
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if chunk:
                    keep(chunk)
                else:
                    eof = True
            if eof:
                break
            if drain_until is None and proc.poll() is not None:
                # The command is done; whatever it left running in the background goes with it.
                kill_group(proc.pid)
                drain_until = time.monotonic() + 1.0
    except BaseException:  # Ctrl-C or an error here: never leave the command running behind us
        kill_group(proc.pid)
        proc.wait()
        raise
    finally:
        sel.close()
        proc.stdout.close()
    if drain_until is None:
        # End of output comes a moment before the shell exits (it closes the pipe, then exits): let it finish on its
        # own, or a kill here turns a clean exit into -9 (seen in the tests under load)
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:  # Ctrl-C while waiting: never leave the command running behind us
            kill_group(proc.pid)
            proc.wait()
            raise
    kill_group(proc.pid)
    proc.wait()
    seconds = time.monotonic() - start
    # Decoded apart when bytes were dropped between them, so a character cut in two spoils only one side.
    text = (head.decode("utf-8", "replace") + tail.decode("utf-8", "replace")) if dropped else (head + tail).decode(
        "utf-8", "replace")
    output, truncated = cap_output(text, max_output, dropped)
    if timed_out:
        output += f"\n[killed: the command ran past its {timeout:g} s timeout]"
    return CommandResult(
        exit_code=None if timed_out else proc.returncode,
        output=output,
        seconds=seconds,
        timed_out=timed_out,
        truncated=truncated,
    )
