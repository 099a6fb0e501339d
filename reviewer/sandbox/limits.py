"""Resource limits for one sandboxed command, and the events that say which of them bit.

Three layers, each for what it does best:
- setrlimit inside the sandbox (init.py): CPU seconds per process (SIGXCPU), file size (SIGXFSZ), data segment
  per process, number of processes (counted in the sandbox's user namespace; the kernel exempts root, see below);
- a cgroup (cgroups.py) when this machine lets us make one (v2, or v1's memory + pids hierarchies; typically when the
  reviewer runs as root): total memory of the command and all its children, and a pids.max that also holds for root —
  and its event counters say exactly when either limit was hit;
- the supervisor outside (supervisor.py): wall-clock timeout, output size (reading stops and the command is killed),
  disk usage of the writable folders (polled) and free space left on their filesystem, and a final kill of anything
  still in the cgroup.

Every limit that bites becomes an `Event` (kind + one line of detail) for the persona run's record.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

MiB = 1024 * 1024
GiB = 1024 * MiB


@dataclass
class Limits:
    timeout: float = 600.0  # wall clock, seconds
    cpu_seconds: int | None = 1200  # per process (RLIMIT_CPU)
    memory_bytes: int | None = 4 * GiB  # all processes together (cgroup); per process (RLIMIT_DATA) without one
    max_processes: int | None = 1024  # processes and threads (cgroup pids.max / RLIMIT_NPROC)
    disk_bytes: int | None = 10 * GiB  # what the writable folders may hold together
    min_free_bytes: int = 1 * GiB  # stop the command before their filesystem is this full
    max_files: int | None = 1_000_000  # files and folders in the workspace (empty files fill inodes, not bytes)
    min_free_inodes: int = 100_000  # stop the command before their filesystem runs out of inodes
    file_size_bytes: int | None = None  # largest single file (RLIMIT_FSIZE); default: disk_bytes
    max_output_bytes: int = 64 * MiB  # output read before the command is stopped
    keep_output: int = 200_000  # characters of output kept (head + tail)


@dataclass
class Event:
    """One blocked or contained action. `kind` is one of KINDS."""
    kind: str
    detail: str
    time: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    inferred: bool = False  # True when read from the command's output rather than observed by the sandbox


KINDS = (
    "network_refused", "timeout", "cpu_limit", "memory_limit", "pids_limit", "output_limit", "disk_limit",
    "file_size_limit", "escape_refused", "process_killed", "isolation_disabled", "env_withheld", "sandbox_error",
)


@dataclass
class Outcome:
    exit_code: int | None  # None when the supervisor killed the command (timeout, output, disk)
    output: str
    seconds: float
    timed_out: bool
    truncated: bool
    events: list[Event]
    reports: list[dict]  # what init.py said (exit status, leftover processes)


# ---------------------------------------------------------------------------------------- what the init reports

def group_names(names: list[str], show: int = 5) -> str:
    """'sleep 100; bash -c bomb() {...} (x61)' — identical command lines once, with a count."""
    counts: dict[str, int] = {}
    for n in names:
        n = n if len(n) <= 80 else n[:77] + "..."
        counts[n] = counts.get(n, 0) + 1
    items = [f"{n} (x{c})" if c > 1 else n for n, c in counts.items()]
    return "; ".join(items[:show]) + (f" (+{len(items) - show} more)" if len(items) > show else "")


def events_from_reports(reports: list[dict], limits: Limits) -> list[Event]:
    events = []
    for r in reports:
        kind = r.get("event")
        if kind == "exit":
            sig, code = r.get("signal"), r.get("code")
            # bash -c passes a killed child's signal on as 128 + signal.
            if sig == signal.SIGXCPU or code == 128 + signal.SIGXCPU:
                events.append(Event("cpu_limit", f"a process used its {limits.cpu_seconds} s of CPU time and was "
                                                 f"stopped (SIGXCPU)"))
            elif sig == signal.SIGXFSZ or code == 128 + signal.SIGXFSZ:
                size = limits.file_size_bytes or limits.disk_bytes
                events.append(Event("file_size_limit", f"a process wrote a file past the "
                                                       f"{(size or 0) // MiB} MiB file size limit (SIGXFSZ)"))
        elif kind == "leftover":
            listed = [p["command"] for p in r.get("processes", [])]
            more = r["count"] - len(listed)
            events.append(Event("process_killed", f"{r['count']} process(es) still running when the command ended "
                                                  f"were killed: {group_names(listed)}"
                                                  + (f" (+{more} not listed)" if more > 0 else "")))
        elif kind == "error":
            events.append(Event("sandbox_error", str(r.get("detail"))))
    return events


# ----------------------------------------------------------------------------------------- what the output gives away

# What the kernel refuses inside the sandbox (a read-only file system, no route) is invisible from outside; when a
# command prints the error, it is recorded as an inferred event. One event per kind and command, with the first line.
OUTPUT_HINTS = [
    ("escape_refused", re.compile(r"read-only file system", re.I)),
    ("network_refused", re.compile(r"network is unreachable|temporary failure in name resolution|"
                                   r"name or service not known|could not resolve host|getaddrinfo (?:ENOTFOUND|EAI_AGAIN)",
                                   re.I)),
    ("pids_limit", re.compile(r"fork: (?:retry: )?resource temporarily unavailable|can't fork|cannot fork|"
                              r"BlockingIOError: \[Errno 11\]", re.I)),
    # A process deeper down than the init's own child (pip's build backend, a test runner's worker) killed by the
    # CPU or file-size limit: bash says "CPU time limit exceeded", Python "died with <Signals.SIGXCPU: 24>", pip
    # "exit code: -24".
    ("cpu_limit", re.compile(r"CPU time limit exceeded|SIGXCPU|exit code:? -24\b", re.I)),
    ("file_size_limit", re.compile(r"File size limit exceeded|SIGXFSZ|exit code:? -25\b", re.I)),
    ("memory_limit", re.compile(r"\bMemoryError\b|cannot allocate memory|heap out of memory|std::bad_alloc", re.I)),
    # The workspace's own file system is full (reviewer/sandbox/diskcap.py): the kernel refused a write at the disk cap.
    ("disk_limit", re.compile(r"No space left on device|ENOSPC|Disk quota exceeded", re.I)),
]


def events_from_output(output: str, already: list[Event], hidden: list[Path] = (), shown: list[Path] = ()
                       ) -> list[Event]:
    """Inferred events from what the command printed. `hidden`: host paths the sandbox hides (the user's home, the
    reviewer's files) — a command naming one tried to reach it; `shown`: read-only paths inside those that are visible
    (the Python installation under ~/.pyenv), which are not attempts."""
    have = {e.kind for e in already if not e.inferred}
    events = []
    tried = []
    for base in hidden:
        for m in re.finditer(re.escape(str(base)) + r"(?:/[^\s'\"(),:;]*)?", output):
            path = m.group(0).rstrip(".")
            if not any(path == str(s) or path.startswith(str(s) + "/") for s in shown) and path not in tried:
                tried.append(path)
    if tried:
        more = f" (+{len(tried) - 3} more)" if len(tried) > 3 else ""
        events.append(Event("escape_refused", f"the command reached for paths the sandbox hides: "
                                              f"{', '.join(tried[:3])}{more}", inferred=True))
        have.add("escape_refused")
    for kind, pattern in OUTPUT_HINTS:
        if kind in have:
            continue
        lines = [ln.strip() for ln in output.splitlines() if pattern.search(ln)]
        if lines:
            more = f" (and {len(lines) - 1} more line(s))" if len(lines) > 1 else ""
            events.append(Event(kind, f"seen in the output: {lines[0][:300]}{more}", inferred=True))
    return events
