"""Is the process that made something still that process? Runs in the database (reviewer/store/deadruns.py) and
folders in the temporary folder (reviewer/sandbox/orphans.py) carry their owner's pid; after a kill -9 or a reboot
the pid may be gone, or reused by an unrelated process, and these two functions tell which.

Standard library only; imports nothing from the reviewer, so the store and the sandbox, which import nothing else of
it, may both use it.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path


def process_start_time(pid: int) -> float | None:
    """When a process started (seconds since the epoch), from /proc; None where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def owner_alive(pid: int | None, since: datetime | None) -> bool:
    """Is the process that started something at `since` still alive? (A pid can be reused after a crash or a reboot:
    a process that started after `since` is not its owner.)"""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    started = process_start_time(pid)
    if started is None or since is None:
        return True
    since_epoch = (since if since.tzinfo else since.replace(tzinfo=timezone.utc)).timestamp()
    return started <= since_epoch + 1.0
