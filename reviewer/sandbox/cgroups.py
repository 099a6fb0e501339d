"""The cgroup of one sandboxed command, where this machine lets us make one (v2, or v1's memory + pids hierarchies;
typically when the reviewer runs as root): the command's total memory and a pids.max that also holds for root, event
counters that say exactly when either limit was hit, and a final kill of everything in it."""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from reviewer.sandbox.limits import Event, Limits, MiB

_serial = itertools.count()


def read_or_empty(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _counter(text: str, name: str) -> int:
    m = re.search(rf"^{name} (\d+)$", text, re.M)
    return int(m.group(1)) if m else 0


def cgroup_mounts() -> dict[str, Path]:
    """'unified' -> the cgroup2 mount; 'memory' / 'pids' -> their v1 mounts."""
    mounts: dict[str, Path] = {}
    for line in read_or_empty(Path("/proc/self/mounts")).splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        mountpoint, fstype, options = Path(parts[1]), parts[2], parts[3].split(",")
        if fstype == "cgroup2":
            mounts.setdefault("unified", mountpoint)
        elif fstype == "cgroup":
            for controller in ("memory", "pids", "cpu"):
                if controller in options:
                    mounts[controller] = mountpoint
    return mounts


def own_cgroups() -> dict[str, str]:
    """controller ('' for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    for line in read_or_empty(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


@dataclass
class Cgroup:
    version: int
    dirs: list[Path]  # v2: one; v1: one per controller
    memory_dir: Path | None
    pids_dir: Path | None
    cpu_dir: Path | None = None  # the whole sandbox is one scheduling entity: a fork bomb cannot starve the reviewer

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs]

    def events(self, limits: Limits) -> list[Event]:
        events = []
        if self.memory_dir is not None:
            name = "memory.events" if self.version == 2 else "memory.oom_control"
            kills = _counter(read_or_empty(self.memory_dir / name), "oom_kill")
            if kills:
                events.append(Event("memory_limit", f"the kernel killed {kills} process(es) at the "
                                                    f"{limits.memory_bytes // MiB} MiB memory limit"))
        if self.pids_dir is not None:
            refused = _counter(read_or_empty(self.pids_dir / "pids.events"), "max")
            if refused:
                events.append(Event("pids_limit", f"{refused} fork(s) refused at the {limits.max_processes} "
                                                  f"process limit"))
        return events

    def pids(self) -> set[int]:
        return {int(x) for f in self.procs_files for x in read_or_empty(f).split()}

    def kill_all(self) -> int:
        """SIGKILL everything still in the cgroup; returns how many processes there were."""
        killed: set[int] = set()
        for _ in range(50):
            pids = self.pids()
            if not pids:
                break
            killed |= pids
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        return len(killed)

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def sweep_stale(parent: Path) -> None:
    """Remove empty reviewer-<pid>-<n> cgroups whose reviewer is gone (it was SIGKILLed before it could)."""
    try:
        entries = list(parent.glob("reviewer-*-*"))
    except OSError:
        return
    for d in entries:
        pid = d.name.split("-")[1]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            try:
                d.rmdir()  # fails (EBUSY) while anything is still inside, which is what we want
            except OSError:
                pass


def create_cgroup(limits: Limits) -> tuple[Cgroup | None, str]:
    """A fresh cgroup with the memory and process limits, below this process's own; (None, why not) when this
    machine does not let us (no delegation, read-only cgroupfs, no controllers)."""
    if not limits.memory_bytes and not limits.max_processes:
        return None, "no memory or process limit asked for"
    mounts, own = cgroup_mounts(), own_cgroups()
    name = f"reviewer-{os.getpid()}-{next(_serial)}"
    # cgroup v2 when it carries the controllers; else v1's two hierarchies.
    if "unified" in mounts and "" in own:
        parent = mounts["unified"] / own[""].lstrip("/")
        available = set(read_or_empty(parent / "cgroup.controllers").split())
        if {"memory", "pids"} <= available:
            wanted = {"memory", "pids"} | ({"cpu"} & available)
            sweep_stale(parent)
            try:
                enabled = set(read_or_empty(parent / "cgroup.subtree_control").split())
                if not wanted <= enabled:
                    (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))
                d = parent / name
                d.mkdir()
            except OSError as e:
                return None, f"cgroup v2 at {parent} is not writable or not delegated: {e.strerror or e}"
            try:
                if limits.memory_bytes:
                    (d / "memory.max").write_text(str(limits.memory_bytes))
                    (d / "memory.swap.max").write_text("0") if (d / "memory.swap.max").exists() else None
                if limits.max_processes:
                    (d / "pids.max").write_text(str(limits.max_processes))
            except OSError as e:
                d.rmdir()
                return None, f"cannot set limits in {d}: {e.strerror or e}"
            return Cgroup(2, [d], d, d, d if "cpu" in wanted else None), f"cgroup v2 ({parent})"
    dirs: dict[str, Path] = {}
    errors = []
    for controller, setting, value in (("memory", "memory.limit_in_bytes", limits.memory_bytes),
                                       ("pids", "pids.max", limits.max_processes), ("cpu", None, None)):
        if controller not in mounts or (setting and not value):
            continue
        d = mounts[controller] / own.get(controller, "/").lstrip("/") / name
        sweep_stale(d.parent)
        try:
            d.mkdir()
        except OSError as e:
            errors.append(f"{controller}: {e.strerror or e}")
            continue
        try:
            if setting:
                (d / setting).write_text(str(value))
            dirs[controller] = d
        except OSError as e:
            errors.append(f"{controller}: {e.strerror or e}")
            d.rmdir()
    if not dirs.keys() & {"memory", "pids"}:
        for d in dirs.values():
            d.rmdir()
        return None, "no writable cgroup hierarchy with memory or pids (" + ("; ".join(errors) or "none mounted") + ")"
    cg = Cgroup(1, list(dirs.values()), dirs.get("memory"), dirs.get("pids"), dirs.get("cpu"))
    return cg, "cgroup v1 (" + ", ".join(dirs) + ")" + (f"; not: {'; '.join(errors)}" if errors else "")


def enter_cgroup_argv(cgroup: Cgroup | None, argv: list[str]) -> list[str]:
    """Prefix argv with a shell that moves itself into the cgroup and then execs argv, so the command is inside from
    its first instruction (a preexec_fn would do the same but is unsafe next to the proxy's thread)."""
    if cgroup is None:
        return argv
    script = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
    return ["/bin/sh", "-c", script, "sh", *map(str, cgroup.procs_files), "--", *argv]
