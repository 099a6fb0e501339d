"""The process supervisor: runs one command (already wrapped in bwrap and the cgroup shim, or plain bash for the bare
baseline) and enforces from outside what only the outside can: the wall-clock timeout, the output size (reading stops
and the command is killed), the disk usage of the writable folders (polled) and the free space of their file system,
and a final kill of everything the command left. The one loop every command of a persona runs under."""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from reviewer.sandbox import diskcap
from reviewer.sandbox.cgroups import Cgroup, read_or_empty
from reviewer.sandbox.limits import Event, Limits, MiB, Outcome, events_from_reports, group_names


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
        stat = read_or_empty(Path(f"/proc/{name}/stat"))
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
    cmd = " ".join(read_or_empty(Path(f"/proc/{pid}/cmdline")).replace("\0", " ").split())
    if cmd:
        return cmd[:200]
    stat = read_or_empty(Path(f"/proc/{pid}/stat"))
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


@dataclass
class Supervision:
    """One supervised command while it runs: the process and its pipes, what it printed and reported, and why the
    supervisor stopped it (None while it has not). drain_until: once the command ended or was killed, how long the
    pipes are still read (what is left in them, but not forever)."""

    proc: subprocess.Popen
    cgroup: Cgroup | None
    limits: Limits
    deadline: float
    out: OutputBuffer
    disk: DiskWatch
    sel: selectors.BaseSelector
    report: bytearray = field(default_factory=bytearray)
    events: list[Event] = field(default_factory=list)
    stopped: str | None = None
    drain_until: float | None = None


def start_command(argv: list[str], cwd: Path, env: dict[str, str], report_fd: int | None,
                  pass_fds: tuple[int, ...]) -> subprocess.Popen:
    """The command in a new session, stdout and stderr on one pipe; closes pass_fds (and report_fd if it fails)."""
    try:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, pass_fds=pass_fds)
    except BaseException:
        if report_fd is not None:
            os.close(report_fd)
        raise
    finally:
        for fd in pass_fds:
            os.close(fd)  # the child has its copy; ours would keep the report pipe from ever reaching EOF


def watch_pipes(proc: subprocess.Popen, report_fd: int | None) -> selectors.BaseSelector:
    """A selector over the command's output ("out") and init.py's report pipe ("report"), both non-blocking."""
    sel = selectors.DefaultSelector()
    stdout_fd = proc.stdout.fileno()
    os.set_blocking(stdout_fd, False)
    sel.register(stdout_fd, selectors.EVENT_READ, "out")
    if report_fd is not None:
        os.set_blocking(report_fd, False)
        sel.register(report_fd, selectors.EVENT_READ, "report")
    return sel


def victims(proc: subprocess.Popen, cgroup: Cgroup | None) -> str:
    """'; killed N process(es): ...' for the command's processes, stopped and named just before they are killed."""
    return killed_summary(stop_and_name(sorted(cgroup.pids()) if cgroup else descendant_pids(proc.pid)))


def check_limits(s: Supervision, now: float) -> None:
    """Kill the command at the first limit it passes (timeout, output, disk) and record why; once it is killed or
    has finished, start draining its pipes."""
    reason = None
    if now >= s.deadline:
        s.stopped, reason = "timeout", f"ran past its {s.limits.timeout:g} s timeout"
    elif s.out.total > s.limits.max_output_bytes:
        s.stopped, reason = "output_limit", (f"printed over {s.limits.max_output_bytes // MiB} MiB of output; "
                                             f"stopped reading")
    else:
        reason = s.disk.check(now)
        if reason:
            s.stopped = "disk_limit"
    if s.stopped:
        s.events.append(Event(s.stopped, f"command killed: {reason}{victims(s.proc, s.cgroup)}"))
        kill_tree(s.proc, s.cgroup)
        s.drain_until = now + 1.0
    elif s.proc.poll() is not None:
        s.drain_until = now + 1.0  # finished: read what is left, but not forever


def read_ready(s: Supervision) -> None:
    """Read what the pipes hold within 0.1 s; a pipe at EOF is dropped. Output past the output limit is not kept."""
    for key, _ in s.sel.select(0.1):
        try:
            chunk = os.read(key.fd, 65536)
        except BlockingIOError:
            continue
        if not chunk:
            s.sel.unregister(key.fd)
        elif key.data == "out":
            if s.stopped != "output_limit":
                s.out.add(chunk)
        else:
            s.report += chunk


def pump(s: Supervision) -> None:
    """Read the pipes until both close or the drain ends, checking the limits between reads."""
    while s.sel.get_map():
        now = time.monotonic()
        if s.drain_until is None:
            check_limits(s, now)
        if s.drain_until is not None and now >= s.drain_until:
            break
        read_ready(s)


def wait_within_timeout(s: Supervision) -> None:
    """The output can end before the command does (bare bash whose command closed its stdout and went on; under
    init.py the pipe stays open to the end): the timeout still holds."""
    try:
        s.proc.wait(timeout=max(s.deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        s.stopped = "timeout"
        s.events.append(Event(s.stopped, f"command killed: ran past its {s.limits.timeout:g} s timeout"
                                         f"{victims(s.proc, s.cgroup)}"))
        kill_tree(s.proc, s.cgroup)
    except BaseException:  # Ctrl-C while waiting: never leave the command running behind us
        kill_tree(s.proc, s.cgroup)
        s.proc.wait()
        raise


def outcome(s: Supervision, seconds: float) -> Outcome:
    """The Outcome of a finished command: its output with a note on why it was killed, and every event (the
    supervisor's, the cgroup's, and init.py's reports)."""
    output, truncated = s.out.text(s.limits.keep_output)
    if s.stopped == "timeout":
        output += f"\n[killed: the command ran past its {s.limits.timeout:g} s timeout]"
    elif s.stopped == "output_limit":
        output += f"\n[killed: the command printed over {s.limits.max_output_bytes // MiB} MiB]"
        truncated = True
    elif s.stopped == "disk_limit":
        output += f"\n[killed: {s.events[-1].detail.removeprefix('command killed: ').split('; killed ')[0]}]"
    events = list(s.events)
    if s.cgroup is not None:
        events += s.cgroup.events(s.limits)
    reports = parse_reports(s.report)
    events += events_from_reports(reports, s.limits)
    code = None if s.stopped else s.proc.returncode
    return Outcome(code, output, seconds, s.stopped == "timeout", truncated, events, reports)


def run_supervised(argv: list[str], *, cwd: Path, env: dict[str, str], limits: Limits, watch: list[Path],
                   cgroup: Cgroup | None = None, report_fd: int | None = None,
                   pass_fds: tuple[int, ...] = (), count_leftovers: bool = True) -> Outcome:
    """Run argv (already wrapped in bwrap and the cgroup shim), enforce the supervisor's limits, collect events.
    `report_fd` is the read end of the pipe init.py writes its JSON lines to; this function closes it and
    `pass_fds` (the write end) in every case. `count_leftovers`: report processes found in the cgroup after the
    command as killed leftovers (for --isolation none; under bwrap init.py does that, exactly)."""
    start = time.monotonic()
    proc = start_command(argv, cwd, env, report_fd, pass_fds)
    s = Supervision(proc=proc, cgroup=cgroup, limits=limits, deadline=start + limits.timeout,
                    out=OutputBuffer(limits.keep_output * 2),
                    disk=DiskWatch(watch, limits, pause=lambda: paused(proc, cgroup)),
                    sel=watch_pipes(proc, report_fd))
    try:
        pump(s)
    except BaseException:  # Ctrl-C or a bug here: never leave the command running behind us
        kill_tree(proc, cgroup)
        proc.wait()
        raise
    finally:
        s.sel.close()
        proc.stdout.close()
        if report_fd is not None:
            os.close(report_fd)
    if not s.stopped:
        wait_within_timeout(s)
    proc.wait()
    left = kill_tree(proc, cgroup)
    # Under bwrap, init.py names what was left (and the namespace's last processes may still be dying here).
    if left and not s.stopped and count_leftovers:
        s.events.append(Event("process_killed", f"{left} process(es) left running in the command's cgroup were killed"))
    seconds = time.monotonic() - start
    if not s.stopped:
        reason = s.disk.final_check()
        if reason:
            s.events.append(Event("disk_limit", f"after the command: {reason}"))
    return outcome(s, seconds)


def parse_reports(raw: bytes) -> list[dict]:
    out = []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
