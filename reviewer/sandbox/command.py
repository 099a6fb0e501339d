"""Running one command for a persona: baseline isolation.

Every command runs under `bash -c` with the workspace as its working directory, a scrubbed environment (an allowlist:
no API keys, no tokens, none of the user's own variables), in its own process group that is killed when the timeout
expires — and also when the command returns, so a forgotten background process can neither outlive the command nor
disturb the next persona's measurements. Output is stdout and stderr merged, capped to head + tail.

Given a `sandbox` (reviewer.sandbox.isolation.Sandbox), the command runs confined instead: bubblewrap, the allowlisting
network proxy and the resource limits (docs/sandbox.md), and what they blocked comes back as `events`. Without one,
this is the bare baseline above, which is not a security boundary (`--isolation none` still goes through the sandbox
module, with its limits, and says so in an event). Both run under the one supervisor, reviewer/sandbox/supervisor.py.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from reviewer.sandbox.isolation import run_sandboxed
from reviewer.sandbox.limits import Limits
from reviewer.sandbox.supervisor import run_supervised

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


def run_shell(command: str, *, cwd: Path, env: dict[str, str], timeout: float, max_output: int = 200_000,
              sandbox=None) -> CommandResult:
    """Run `command` with bash in `cwd`; kill its whole process group on timeout (or Ctrl-C) and when it returns.
    With `sandbox` (reviewer.sandbox.isolation.Sandbox): confined, limited, and with the events it recorded. Without,
    the bare baseline runs under the same supervisor with only the timeout and the output cap: no init, no cgroup, no
    disk watch, no output size limit."""
    if sandbox is not None:
        box = replace(sandbox, limits=replace(sandbox.limits, timeout=timeout, keep_output=max_output))
        o = run_sandboxed(command, sandbox=box, cwd=cwd, env=env)
    else:
        bare = Limits(timeout=timeout, keep_output=max_output, max_output_bytes=sys.maxsize, disk_bytes=None,
                      max_files=None)
        o = run_supervised(["bash", "-c", command], cwd=cwd, env=env, limits=bare, watch=[], count_leftovers=False)
    return CommandResult(exit_code=o.exit_code, output=o.output, seconds=o.seconds, timed_out=o.timed_out,
                         truncated=o.truncated, events=o.events)
