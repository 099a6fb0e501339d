"""Resource limits for one sandboxed command, and the loop that supervises it.

Three layers, each for what it does best:
- setrlimit inside the sandbox (init.py): CPU seconds per process (SIGXCPU), file size (SIGXFSZ), data segment
  per process, number of processes (counted in the sandbox's user namespace; the kernel exempts root, see below);
- a cgroup when this machine lets us make one (v2, or v1's memory + pids hierarchies; typically when the reviewer runs
  as root): total memory of the command and all its children, and a pids.max that also holds for root — and its event
  counters say exactly when either limit was hit;
- this supervisor, outside: wall-clock timeout, output size (reading stops and the command is killed), disk usage of
  the writable folders (polled) and free space left on their filesystem, and a final kill of anything still in the
  cgroup.

Every limit that bites becomes an `Event` (kind + one line of detail) for the persona run's record.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import selectors
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from reviewer.sandbox import diskcap

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


# ------------------------------------------------------------------------------------------------------------ cgroups

_serial = itertools.count()


def _read(path: Path) -> str:
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
    for line in _read(Path("/proc/self/mounts")).splitlines():
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
    for line in _read(Path("/proc/self/cgroup")).splitlines():
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
            kills = _counter(_read(self.memory_dir / name), "oom_kill")
            if kills:
                events.append(Event("memory_limit", f"the kernel killed {kills} process(es) at the "
                                                    f"{limits.memory_bytes // MiB} MiB memory limit"))
        if self.pids_dir is not None:
            refused = _counter(_read(self.pids_dir / "pids.events"), "max")
            if refused:
                events.append(Event("pids_limit", f"{refused} fork(s) refused at the {limits.max_processes} "
                                                  f"process limit"))
        return events

    def pids(self) -> set[int]:
        return {int(x) for f in self.procs_files for x in _read(f).split()}

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
        available = set(_read(parent / "cgroup.controllers").split())
        if {"memory", "pids"} <= available:
            wanted = {"memory", "pids"} | ({"cpu"} & available)
            sweep_stale(parent)
            try:
                enabled = set(_read(parent / "cgroup.subtree_control").split())
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


# --------------------------------------------------------------------------------------------------------------- disk

def disk_usage(paths: list[Path]) -> int:
    """Bytes allocated under paths (sparse files count what they hold, hard links once, symlinks not followed)."""
    return disk_usage_and_files(paths)[0]


def disk_usage_and_files(paths: list[Path]) -> tuple[int, int]:
    """(bytes allocated, number of entries) under paths."""
    seen: set[tuple[int, int]] = set()
    total = files = 0
    stack = [str(p) for p in paths]
    while stack:
        top = stack.pop()
        try:
            st = os.lstat(top)
        except OSError:
            continue
        total += st.st_blocks * 512
        if not os.path.isdir(top) or os.path.islink(top):
            continue
        try:
            with os.scandir(top) as it:
                for entry in it:
                    files += 1
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                        continue
                    if st.st_nlink > 1:
                        key = (st.st_dev, st.st_ino)
                        if key in seen:
                            continue
                        seen.add(key)
                    total += st.st_blocks * 512
        except OSError:
            continue
    return total, files


class DiskWatch:
    """Polls the writable folders' size (each walk at most ~5% of the time) and their filesystem's free space.
    `pause`: a context manager that stops the command while an urgent walk measures (see check)."""

    def __init__(self, paths: list[Path], limits: Limits, pause=None):
        self.paths = [p for p in paths if p.exists()]
        self.limits = limits
        self.pause = pause
        self.next_walk = 0.0
        self.next_free = 0.0
        self.last_usage = 0
        self.free_at_walk: int | None = None  # the filesystem's free bytes at the last walk

    def check(self, now: float) -> str | None:
        """None while within limits, else what was exceeded."""
        if not self.paths:
            return None
        urgent = False
        if now >= self.next_free:
            self.next_free = now + 0.1
            for p in self.paths:
                try:
                    # A disk-capped workspace is its own small file system; the free space that matters here (the
                    # host's, which its image draws on) is that of the folder holding it.
                    st = os.statvfs(diskcap.host_folder(p))
                except OSError:
                    continue
                free = st.f_bavail * st.f_frsize
                # A fast writer can fill gigabytes between two walks: a drop in free space larger than the room left
                # under the limit brings the next walk forward (statvfs is cheap; the walk is the exact measure).
                room = (self.limits.disk_bytes or 0) - self.last_usage
                if self.free_at_walk is not None and self.free_at_walk - free > min(128 * MiB, max(room, 0)):
                    self.next_walk, urgent = now, True
                if free < self.limits.min_free_bytes:
                    return (f"the filesystem of {p} has {free // MiB} MiB left (the sandbox keeps "
                            f"{self.limits.min_free_bytes // MiB} MiB free)")
                if st.f_files and st.f_favail < self.limits.min_free_inodes:  # f_files 0: no inode limit (btrfs)
                    return (f"the filesystem of {p} has {st.f_favail} inodes left (the sandbox keeps "
                            f"{self.limits.min_free_inodes} free)")
        if (self.limits.disk_bytes or self.limits.max_files) and now >= self.next_walk:
            t0 = time.monotonic()
            # An urgent walk (free space fell by more than the room left) runs with the command stopped: under load
            # a walk of a workspace with a virtual environment takes long enough for a fast writer to add hundreds
            # of MiB while it runs (the hostile disk_fill test overshot a 100 MiB limit by ~350 MiB that way).
            # free space is read before the walk: bytes written while it runs then count as a drop against the
            # room the walk leaves, so the next statvfs poll sees them (read after, they were silently forgiven)
            try:
                self.free_at_walk = min(os.statvfs(diskcap.host_folder(p)).f_bavail *
                                        os.statvfs(diskcap.host_folder(p)).f_frsize for p in self.paths)
            except OSError:
                self.free_at_walk = None
            with self.pause() if urgent and self.pause is not None else contextlib.nullcontext():
                self.last_usage, files = disk_usage_and_files(self.paths)
            took = time.monotonic() - t0
            self.next_walk = now + max(1.0, 20 * took)  # at most ~5% of a core; RLIMIT_FSIZE caps one file meanwhile
            if self.limits.disk_bytes and self.last_usage > self.limits.disk_bytes:
                return (f"the workspace grew to {self.last_usage // MiB} MiB, over its "
                        f"{self.limits.disk_bytes // MiB} MiB limit")
            if self.limits.max_files and files > self.limits.max_files:
                return f"the workspace holds {files} files, over its limit of {self.limits.max_files}"
        return None

    def final_check(self) -> str | None:
        """Once more when the command has ended (it may have finished between two polls)."""
        self.next_walk = self.next_free = 0.0
        return self.check(time.monotonic())


# ------------------------------------------------------------------------------------------------------------ running

class OutputBuffer:
    """Head + tail of a byte stream, bounded memory, with a count of everything seen."""

    def __init__(self, keep_bytes: int):
        self.half = max(keep_bytes // 2, 1)
        self.head = bytearray()
        self.tail: deque[bytes] = deque()
        self.tail_len = 0
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail.append(chunk)
            self.tail_len += len(chunk)
            while self.tail_len - len(self.tail[0]) >= self.half:
                self.tail_len -= len(self.tail.popleft())

    def text(self, keep_chars: int) -> tuple[str, bool]:
        tail = b"".join(self.tail)[-self.half:]
        dropped = self.total - len(self.head) - len(tail)
        if dropped <= 0:
            text = (self.head + tail).decode("utf-8", "replace")
            if len(text) <= keep_chars:
                return text, False
            half = keep_chars // 2
            return f"{text[:half]}\n[... {len(text) - 2 * half} characters left out ...]\n{text[-half:]}", True
        head_text = self.head.decode("utf-8", "replace")[: keep_chars // 2]
        tail_text = tail.decode("utf-8", "replace")[-(keep_chars // 2):]
        return f"{head_text}\n[... {dropped} bytes left out ...]\n{tail_text}", True


def descendant_pids(pid: int) -> list[int]:
    """Every process below pid as the host sees them (PID namespaces included), from /proc/PID/stat alone."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _read(Path(f"/proc/{name}/stat"))
        if ")" in stat:
            fields = stat[stat.rindex(")") + 2:].split()
            children.setdefault(int(fields[1]), []).append(int(name))
    out, stack = [], list(children.get(pid, []))
    while stack:
        p = stack.pop()
        out.append(p)
        stack += children.get(p, [])
    return sorted(out)


def command_line(pid: int) -> str:
    cmd = " ".join(_read(Path(f"/proc/{pid}/cmdline")).replace("\0", " ").split())
    if cmd:
        return cmd[:200]
    stat = _read(Path(f"/proc/{pid}/stat"))
    return f"[{stat[stat.index('(') + 1:stat.rindex(')')]}]" if ")" in stat else ""


def stop_and_name(pids: list[int], budget: float = 1.0) -> list[tuple[int, str]]:
    """SIGSTOP the processes, then read their command lines: reading /proc/PID/cmdline of a process that keeps
    forking waits on its memory map lock (seconds, in a fork bomb); stopped, it answers at once. Names past the time
    budget are left blank."""
    _signal_all(pids, signal.SIGSTOP)
    end = time.monotonic() + budget
    return [(p, command_line(p) if time.monotonic() < end else "") for p in pids]


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below pid (they are stopped: call this just before killing them)."""
    return stop_and_name(descendant_pids(pid))


SANDBOX_PLUMBING = re.compile(r"^(?:/bin/sh -c while|\S*bwrap |\S*python\S* -I -S \S*(?:sandbox_)?init\.py)")


def killed_summary(procs: list[tuple[int, str]]) -> str:
    """'3 processes: pip install ., sleep 1001' — the command's own processes, not the sandbox's plumbing."""
    names = [c for _, c in procs if c and not SANDBOX_PLUMBING.match(c)]
    if not names:
        return ""
    return f"; killed {len(names)} process(es): {group_names(names)}"


def group_names(names: list[str], show: int = 5) -> str:
    """'sleep 100; bash -c bomb() {...} (x61)' — identical command lines once, with a count."""
    counts: dict[str, int] = {}
    for n in names:
        n = n if len(n) <= 80 else n[:77] + "..."
        counts[n] = counts.get(n, 0) + 1
    items = [f"{n} (x{c})" if c > 1 else n for n, c in counts.items()]
    return "; ".join(items[:show]) + (f" (+{len(items) - show} more)" if len(items) > show else "")


@contextlib.contextmanager
def paused(proc: subprocess.Popen, cgroup: Cgroup | None):
    """SIGSTOP the command's processes for the duration, SIGCONT them after (kill_tree works on stopped processes
    too, so an exception in between leaves nothing running that the caller does not kill)."""
    pids = sorted(cgroup.pids()) if cgroup is not None else [proc.pid] + descendant_pids(proc.pid)
    _signal_all(pids, signal.SIGSTOP)
    try:
        yield
    finally:
        _signal_all(pids, signal.SIGCONT)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(proc: subprocess.Popen, cgroup: Cgroup | None) -> int:
    """Kill the command's process group and everything in its cgroup; returns how many were in the cgroup."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return cgroup.kill_all() if cgroup is not None else 0


def run_supervised(argv: list[str], *, cwd: Path, env: dict[str, str], limits: Limits, watch: list[Path],
                   cgroup: Cgroup | None = None, report_fd: int | None = None,
                   pass_fds: tuple[int, ...] = (), count_leftovers: bool = True) -> Outcome:
    """Run argv (already wrapped in bwrap and the cgroup shim), enforce the supervisor's limits, collect events.
    `report_fd` is the read end of the pipe init.py writes its JSON lines to; this function closes it and
    `pass_fds` (the write end) in every case. `count_leftovers`: report processes found in the cgroup after the
    command as killed leftovers (for --isolation none; under bwrap init.py does that, exactly)."""
    start = time.monotonic()
    events: list[Event] = []
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, pass_fds=pass_fds)
    except BaseException:
        if report_fd is not None:
            os.close(report_fd)
        raise
    finally:
        for fd in pass_fds:
            os.close(fd)  # the child has its copy; ours would keep the report pipe from ever reaching EOF
    out = OutputBuffer(limits.keep_output * 2)
    report = bytearray()
    disk = DiskWatch(watch, limits, pause=lambda: paused(proc, cgroup))
    sel = selectors.DefaultSelector()
    stdout_fd = proc.stdout.fileno()
    os.set_blocking(stdout_fd, False)
    sel.register(stdout_fd, selectors.EVENT_READ, "out")
    if report_fd is not None:
        os.set_blocking(report_fd, False)
        sel.register(report_fd, selectors.EVENT_READ, "report")
    deadline = start + limits.timeout
    stopped: str | None = None  # why the supervisor killed it
    drain_until: float | None = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if drain_until is None:
                reason = None
                if now >= deadline:
                    stopped, reason = "timeout", f"ran past its {limits.timeout:g} s timeout"
                elif out.total > limits.max_output_bytes:
                    stopped, reason = "output_limit", (f"printed over {limits.max_output_bytes // MiB} MiB of output; "
                                                       f"stopped reading")
                else:
                    reason = disk.check(now)
                    if reason:
                        stopped = "disk_limit"
                if stopped:
                    victims = killed_summary(stop_and_name(sorted(cgroup.pids()) if cgroup else
                                                           descendant_pids(proc.pid)))
                    events.append(Event(stopped, f"command killed: {reason}{victims}"))
                    kill_tree(proc, cgroup)
                    drain_until = now + 1.0
                elif proc.poll() is not None:
                    drain_until = now + 1.0  # finished: read what is left, but not forever
            if drain_until is not None and now >= drain_until:
                break
            for key, _ in sel.select(0.1):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                elif key.data == "out":
                    if stopped != "output_limit":
                        out.add(chunk)
                else:
                    report += chunk
    except BaseException:  # Ctrl-C or a bug here: never leave the command running behind us
        kill_tree(proc, cgroup)
        proc.wait()
        raise
    finally:
        sel.close()
        proc.stdout.close()
        if report_fd is not None:
            os.close(report_fd)
    proc.wait()
    left = kill_tree(proc, cgroup)
    # Under bwrap, init.py names what was left (and the namespace's last processes may still be dying here).
    if left and not stopped and count_leftovers:
        events.append(Event("process_killed", f"{left} process(es) left running in the command's cgroup were killed"))
    seconds = time.monotonic() - start
    if not stopped:
        reason = disk.final_check()
        if reason:
            events.append(Event("disk_limit", f"after the command: {reason}"))
    output, truncated = out.text(limits.keep_output)
    if stopped == "timeout":
        output += f"\n[killed: the command ran past its {limits.timeout:g} s timeout]"
    elif stopped == "output_limit":
        output += f"\n[killed: the command printed over {limits.max_output_bytes // MiB} MiB]"
        truncated = True
    elif stopped == "disk_limit":
        output += f"\n[killed: {events[-1].detail.removeprefix('command killed: ').split('; killed ')[0]}]"
    if cgroup is not None:
        events += cgroup.events(limits)
    reports = parse_reports(report)
    events += events_from_reports(reports, limits)
    code = None if stopped else proc.returncode
    return Outcome(code, output, seconds, stopped == "timeout", truncated, events, reports)


def parse_reports(raw: bytes) -> list[dict]:
    import json

    out = []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


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
