"""`reviewer doctor`: what isolation this machine gives a reviewed repository, and why not where it falls short.

Each check runs the real thing (bubblewrap with every namespace, a command inside the actual sandbox, a cgroup made and
removed, the proxy on its socket) rather than reading version numbers. Exit 0 when full isolation is available
(namespaces, no network but the proxy, a process limit that holds); 1 otherwise.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from reviewer.sandbox import cgroups, diskcap, egress_proxy, isolation, limits
from reviewer.sandbox.isolation import Check

# Runs inside the sandbox: each line "name ok|FAIL detail". Standard library only.
PROBE = r'''
import os, socket
def say(name, ok, detail): print(name, "ok" if ok else "FAIL", detail, flush=True)
home = os.environ["REVIEWER_DOCTOR_REAL_HOME"]
allowed = set(filter(None, os.environ["REVIEWER_DOCTOR_ALLOWED"].split(":")))
visible = set(os.listdir(home)) if os.path.isdir(home) else set()
say("home_hidden", visible <= allowed, f"{home} shows {sorted(visible) or 'nothing'}"
    + (f" (only the Python installation {sorted(allowed)} is meant to be there)" if allowed else ""))
db = os.environ["REVIEWER_DOCTOR_DB"]
say("database_hidden", not db or not os.path.exists(db), f"{db or 'no database path'} is not visible")
try:
    open("/etc/reviewer-doctor", "w")
    say("system_read_only", False, "could write /etc")
except OSError as e:
    say("system_read_only", True, f"/etc: {e.strerror}")
try:
    socket.create_connection(("1.1.1.1", 443), timeout=3).close()
    say("no_direct_network", False, "reached 1.1.1.1:443 directly")
except OSError as e:
    say("no_direct_network", True, f"direct connection: {e.strerror or e}")
try:
    s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
    s.sendall(b"CONNECT reviewer-doctor.invalid:443 HTTP/1.1\r\nHost: reviewer-doctor.invalid:443\r\n\r\n")
    answer = s.recv(200).split(b"\r\n")[0].decode()
    say("proxy_reachable", answer.startswith("HTTP/1.1 403"), f"proxy answered {answer!r} to a host off the allowlist")
except OSError as e:
    say("proxy_reachable", False, f"127.0.0.1:3128: {e}")
say("pid_namespace", os.getpid() < 10, f"pid {os.getpid()} inside")
'''


def sandbox_checks(db_path: Path | None) -> list[Check]:
    """Run PROBE inside a real sandbox (the same code path as a review's commands)."""
    home = Path.home().resolve()
    allowed = sorted({p.relative_to(home).parts[0] for p in isolation.python_prefixes() if p.is_relative_to(home)})
    ws = Path(tempfile.mkdtemp(prefix=f"reviewer-doctor-pid{os.getpid()}-"))
    try:
        for sub in ("repo", "home", "tmp"):
            (ws / sub).mkdir()
        (ws / "repo" / "probe.py").write_text(PROBE)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(ws / "home"), "LANG": "C.UTF-8",
               "REVIEWER_DOCTOR_REAL_HOME": str(home), "REVIEWER_DOCTOR_ALLOWED": ":".join(allowed),
               "REVIEWER_DOCTOR_DB": str(db_path or "")}
        box = isolation.Sandbox(workspace=ws, limits=limits.Limits(timeout=60),
                                protect=[db_path] if db_path else [])
        python = os.path.realpath(__import__("sys").executable)
        outcome = isolation.run_sandboxed(f"{python} -I probe.py", sandbox=box, cwd=ws / "repo", env=env)
    except (isolation.IsolationError, OSError) as e:
        return [Check("sandbox", False, str(e))]
    finally:
        shutil.rmtree(ws, ignore_errors=True)
    checks = []
    for line in outcome.output.splitlines():
        name, _, rest = line.partition(" ")
        status, _, detail = rest.partition(" ")
        if status in ("ok", "FAIL"):
            checks.append(Check(name, status == "ok", detail))
    if not checks:
        checks.append(Check("sandbox", False, f"the probe printed nothing useful: {outcome.output.strip()[-300:]}"))
    if not any(e.kind == "network_refused" and "reviewer-doctor.invalid" in e.detail for e in outcome.events):
        checks.append(Check("refusal_recorded", False, "the proxy's refusal was not recorded as an event"))
    else:
        checks.append(Check("refusal_recorded", True, "the refusal became a network_refused event"))
    return checks


def limit_checks() -> tuple[list[Check], list[Check]]:
    """(required, advisory) checks about resource limits."""
    cg, why = cgroups.create_cgroup(limits.Limits())
    if cg is not None:
        cg.remove()
    root = os.geteuid() == 0
    pids_ok = cg is not None and cg.pids_dir is not None
    if pids_ok:
        pids = Check("process_limit", True, f"pids.max in a {why}")
    elif not root:
        pids = Check("process_limit", True, "RLIMIT_NPROC, counted inside the sandbox's user namespace")
    else:
        pids = Check("process_limit", False, f"running as root, which the kernel exempts from RLIMIT_NPROC, and no "
                                             f"pids cgroup: {why}")
    mem_ok = cg is not None and cg.memory_dir is not None
    memory = Check("memory_limit", mem_ok, f"total memory of a command in a {why}" if mem_ok else
                   f"per process only (RLIMIT_DATA); no memory cgroup: {why}")
    rl = Check("rlimits", True, "CPU time, file size, data size set per command inside the sandbox")
    return [pids], [memory, rl, disk_check()]


def disk_check() -> Check:
    """Can a workspace be its own size-limited file system here (reviewer/sandbox/diskcap.py)? Tried for real."""
    probe = Path(tempfile.mkdtemp(prefix=f"reviewer-doctor-pid{os.getpid()}-"))
    try:
        why = diskcap.mount_capped(probe, 16 * limits.MiB)
    finally:
        diskcap.release(probe)
        probe.rmdir()
    if why:
        return Check("disk_limit", False, why)
    return Check("disk_limit", True, "in the kernel: each workspace is its own ext4 file system of the disk limit "
                                     "(loop mount); polling as a second line")


def network_check() -> Check:
    setup = egress_proxy.registry_setup()
    allow = egress_proxy.expand_allowlist(["auto"], setup)
    local = f"; local indexes shown read-only: {', '.join(map(str, setup.ro_paths))}" if setup.ro_paths else ""
    return Check("allowlist", True, f"default (auto): {', '.join(allow)}{local}")


def doctor_command(settings, console: Console | None = None) -> int:
    console = console or Console()
    required: list[Check] = []
    advisory: list[Check] = []
    bw = isolation.probe_bwrap()
    required.append(bw)
    if bw.ok:
        db = str(getattr(settings, "db", "") or "")
        required += sandbox_checks(Path(db).expanduser().resolve() if db and "://" not in db else None)
    pid_checks, more = limit_checks()
    required += pid_checks
    advisory += more
    advisory.append(network_check())
    table = Table(title="Sandbox isolation on this machine", show_lines=False)
    table.add_column("check")
    table.add_column("")
    table.add_column("detail", overflow="fold")
    for c in required:
        table.add_row(c.name, "[green]ok[/green]" if c.ok else "[red]no[/red]", escape(c.detail))
    for c in advisory:
        table.add_row(c.name, "[green]ok[/green]" if c.ok else "[yellow]partial[/yellow]", escape(c.detail))
    console.print(table)
    setting = getattr(settings, "isolation", "auto")
    full = all(c.ok for c in required)
    if full:
        console.print(f"[green]Full isolation is available.[/green] isolation = {setting!r}: commands run in "
                      f"bubblewrap with the network proxy and limits.")
        if setting == "none":
            console.print("[yellow]But isolation is set to 'none': reviews will run WITHOUT the sandbox.[/yellow]")
        return 0
    missing = ", ".join(c.name for c in required if not c.ok)
    console.print(f"[red]Full isolation is NOT available[/red] (missing: {escape(missing)}).")
    if not bw.ok:
        console.print("`reviewer run` stops with an error unless you pass --isolation none (then the reviewed code "
                      "runs as you, with your files and network).")
    return 1
