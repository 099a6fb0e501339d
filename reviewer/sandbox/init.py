"""The first program inside the sandbox: set resource limits, forward the proxy port, run the command, report.

Runs as `python -I -S init.py [options] -- argv...` inside bubblewrap (standard library only: the sandbox has
no site-packages of ours). It is PID 2 of the sandbox's PID namespace, right under bwrap's own reaper, so:

- the limits it sets with setrlimit apply to the command and everything it starts (RLIMIT_NPROC is counted inside the
  sandbox's user namespace, so a fork bomb meets it — except when the reviewer runs as root, where the kernel exempts
  uid 0 and the cgroup's pids.max does the job);
- it forwards 127.0.0.1:PORT (the sandbox's own loopback) to the proxy's unix socket bound into the sandbox, because
  pip, npm and git only speak HTTP proxy over TCP and the sandbox has no route out;
- when the command returns, every process still alive in the namespace was left behind by it (a daemon, a server a
  test forgot): it lists them, kills them, and says so.

What it has to say goes as JSON lines to a file descriptor the reviewer passed in and that the command never inherits.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import time

LIMITS = {
    "cpu": resource.RLIMIT_CPU,
    "data": resource.RLIMIT_DATA,
    "nproc": resource.RLIMIT_NPROC,
    "fsize": resource.RLIMIT_FSIZE,
}
MAX_LISTED = 20  # leftover processes named in the report; the rest are counted


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sandbox_init")
    p.add_argument("--report-fd", type=int, default=-1)
    p.add_argument("--forward", default=None, help="PORT:UNIX_SOCKET_PATH")
    p.add_argument("--reap", action="store_true", help="kill what is left in the PID namespace when the command ends")
    p.add_argument("--nice", type=int, default=0, help="lower the command's CPU priority (when no cpu cgroup)")
    for name in LIMITS:
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("no command")
    return args


class Reporter:
    def __init__(self, fd: int):
        self.fd = fd

    def send(self, **record) -> None:
        if self.fd < 0:
            return
        try:
            os.write(self.fd, (json.dumps(record) + "\n").encode())
        except OSError:
            pass


def set_limits(args: argparse.Namespace) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crashing test must not drop gigabytes of core files
    for name, which in LIMITS.items():
        value = getattr(args, name)
        if value is None:
            continue
        soft, hard = value, value
        if name == "cpu":
            hard = value + 5  # SIGXCPU at the soft limit (a clean signal to recognise), SIGKILL a little later
        cur_soft, cur_hard = resource.getrlimit(which)
        if cur_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(which, (soft, hard))


class Forwarder:
    """127.0.0.1:port inside the sandbox <-> the proxy's unix socket. One selector loop, no threads: a fork bomb that
    exhausts the process limit must not stop it. Each socket has a buffer of bytes waiting to be written to it; a
    socket is read only while its peer's buffer is empty (back-pressure), and an EOF is passed on as a half-close once
    the buffer has drained, so no response bytes are lost when a server closes first."""

    def __init__(self, port: int, unix_path: str, sel: selectors.BaseSelector):
        self.unix_path = unix_path
        self.sel = sel
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(128)
        self.listener.setblocking(False)
        sel.register(self.listener, selectors.EVENT_READ, self.accept)
        self.peer: dict[socket.socket, socket.socket] = {}
        self.out: dict[socket.socket, bytearray] = {}  # bytes to write to this socket
        self.eof: set[socket.socket] = set()  # sockets that have sent EOF (nothing more to read from them)

    def accept(self, _sock, _mask) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(self.unix_path)
        except OSError:
            client.close()
            upstream.close()
            return
        self.peer[client], self.peer[upstream] = upstream, client
        for s in (client, upstream):
            s.setblocking(False)
            self.out[s] = bytearray()
            self.sel.register(s, selectors.EVENT_READ, self.pump)

    def interest(self, s: socket.socket) -> int:
        want = 0
        if s not in self.eof and not self.out[self.peer[s]]:
            want |= selectors.EVENT_READ
        if self.out[s]:
            want |= selectors.EVENT_WRITE
        return want

    def update(self, s: socket.socket) -> None:
        if s not in self.out:
            return
        want = self.interest(s)
        registered = s in self.sel.get_map()
        if want and registered:
            self.sel.modify(s, want, self.pump)
        elif want:
            self.sel.register(s, want, self.pump)
        elif registered:
            self.sel.unregister(s)

    def close_pair(self, s: socket.socket) -> None:
        for x in (s, self.peer.get(s)):
            if x is None or x not in self.out:
                continue
            if x in self.sel.get_map():
                self.sel.unregister(x)
            x.close()
            self.out.pop(x, None)
            self.eof.discard(x)
        self.peer.pop(s, None)

    def pump(self, s: socket.socket, mask: int) -> None:
        other = self.peer.get(s)
        if other is None or s not in self.out:
            return
        try:
            if mask & selectors.EVENT_WRITE and self.out[s]:
                sent = s.send(self.out[s])
                del self.out[s][:sent]
                if not self.out[s] and other in self.eof:
                    s.shutdown(socket.SHUT_WR)
            if mask & selectors.EVENT_READ:
                data = s.recv(65536)
                if data:
                    self.out[other].extend(data)
                else:
                    self.eof.add(s)
                    if not self.out[other]:
                        other.shutdown(socket.SHUT_WR)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.close_pair(s)
            return
        if s in self.eof and other in self.eof and not self.out[s] and not self.out[other]:
            self.close_pair(s)
            return
        self.update(s)
        self.update(other)


def describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = " ".join(f.read().replace(b"\0", b" ").decode("utf-8", "replace").split())
        if cmd:
            return cmd[:200]
        with open(f"/proc/{pid}/stat") as f:  # a zombie or kernel-side exit in progress: no cmdline, still a name
            stat = f.read()
        return f"[{stat[stat.index('(') + 1:stat.rindex(')')]}, {stat[stat.rindex(')') + 2:].split()[0]}]"
    except (OSError, ValueError):
        return f"[pid {pid}]"


def leftovers() -> list[int]:
    me = os.getpid()
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, me):
            pids.append(int(name))
    return pids


def reap_leftovers(reporter: Reporter) -> None:
    """Kill everything the command left behind in this PID namespace and name it. Stopped first (reading the command
    line of a process that keeps forking waits on its memory map lock), named within a time budget, then killed;
    a few rounds, since a dying parent can still fork in between."""
    seen: dict[int, str] = {}
    end = time.monotonic() + 2.0
    for _ in range(20):
        pids = leftovers()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        for pid in pids:
            if pid not in seen:
                seen[pid] = describe(pid) if time.monotonic() < end and len(seen) < MAX_LISTED else ""
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
    if seen:
        listed = [{"pid": p, "command": c} for p, c in seen.items() if c][:MAX_LISTED]
        reporter.send(event="leftover", count=len(seen), processes=listed)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    reporter = Reporter(args.report_fd)
    # Nobody else in the sandbox (same uid) may read our report fd through /proc/PID/fd.
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except Exception:
        pass
    sel = selectors.DefaultSelector()
    if args.forward:
        port, _, path = args.forward.partition(":")
        try:
            Forwarder(int(port), path, sel)
        except OSError as e:
            reporter.send(event="error", detail=f"proxy forwarder could not listen on 127.0.0.1:{port}: {e}")
    try:
        set_limits(args)
    except (ValueError, OSError) as e:
        reporter.send(event="error", detail=f"could not set resource limits: {e}")
    if args.nice:
        os.nice(args.nice)  # after the forwarder is set up; the init itself barely uses the CPU
    try:
        proc = subprocess.Popen(args.command, close_fds=True)  # close_fds: the report fd stays ours
    except OSError as e:
        print(f"sandbox: cannot run {args.command[0]}: {e}", file=sys.stderr)
        reporter.send(event="exit", code=127, signal=None)
        return 127
    # Ctrl-C or a TERM from outside goes to the command; the reviewer kills us with SIGKILL when it has to.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    while proc.poll() is None:
        if not sel.get_map():
            try:
                proc.wait()
            except KeyboardInterrupt:
                pass
            continue
        try:
            for key, mask in sel.select(timeout=0.05):
                key.data(key.fileobj, mask)
        except InterruptedError:
            pass
    code = proc.returncode
    reporter.send(event="exit", code=code if code >= 0 else None, signal=-code if code < 0 else None)
    if args.reap:
        reap_leftovers(reporter)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
