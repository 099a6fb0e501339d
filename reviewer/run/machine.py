"""The machine a review ran on, stored with the run: enough to tell two machines (or two container limits) apart when
their measurements are compared."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
from pathlib import Path


def machine_fingerprint(isolation_mode: str = "bwrap") -> dict:
    """What the measurements were taken on: enough to tell two machines (or two container limits) apart."""
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = round(int(line.split()[1]) / 1024 / 1024, 1)
    quota = None
    with contextlib.suppress(OSError, ValueError):
        q, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        quota = None if q == "max" else round(int(q) / int(period), 2)
    return {
        "hostname": socket.gethostname(),
        "cpu": cpu or platform.machine(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_quota": quota,
        "memory_gib": memory,
        "os": platform.platform(),
        "python": platform.python_version(),
        "isolation": isolation_mode,
    }
