"""Confining one command: bubblewrap, the egress proxy and the resource limits put together.

`run_sandboxed(command, sandbox=Sandbox(...), ...)` is the one entry point (reviewer/sandbox/command.py calls it). Under
bubblewrap a command sees:
- the system read-only (/usr and the merged-usr links, /etc minus every file an ordinary user could not read, the
  Python installation the workspace's venv points to, local package indexes), nothing else of the host;
- its workspace folder read-write (the clone, its venv, its HOME, its TMPDIR) and that folder's tmp/ as a private /tmp;
- no network but its own loopback, where 127.0.0.1:3128 leads to the allowlisting proxy outside (egress_proxy.py);
- new user, PID, IPC, UTS, cgroup and network namespaces, no capabilities, no further user namespaces, a new session
  (no terminal injection), killed with the reviewer (--die-with-parent);
- an environment built from an allowlist, checked once more here for anything that looks like a secret.
The user's home, the reviewer's config, database and keys are simply not there.

`--isolation none` runs the same command with the same limits but without bubblewrap and without the network rule,
and says so in an `isolation_disabled` event on every command.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from reviewer.sandbox import cgroups, egress_proxy, supervisor
from reviewer.sandbox import limits as limits_mod
from reviewer.sandbox.limits import Event, Limits, Outcome

INIT_SCRIPT = Path(__file__).with_name("init.py")
INSIDE_DIR = "/.reviewer"  # where the init script and the proxy socket appear inside the sandbox
SYSTEM_DIRS = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]
DEV_SHM_BYTES = 256 * 1024 * 1024
PROC_READ_ONLY = ["/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs"]


class IsolationError(Exception):
    """Isolation was asked for and cannot be had; the message says why and what to do (one line)."""


# ----------------------------------------------------------------------------------------------------- capabilities

@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


@lru_cache(maxsize=1)
def bwrap_features() -> frozenset[str]:
    """Options this bwrap knows (0.8 added --disable-userns, --size needs 0.9 for --tmpfs... ask, don't guess)."""
    path = bwrap_path()
    if not path:
        return frozenset()
    try:
        text = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return frozenset(re.findall(r"^\s+(--[a-z0-9-]+)", text, re.M))


def userns_hint(stderr: str) -> str:
    """Why bwrap could not make its namespaces, in words a user can act on."""
    hints = []
    if _read_int("/proc/sys/user/max_user_namespaces") == 0:
        hints.append("user namespaces are disabled (sysctl user.max_user_namespaces=0)")
    if _read_int("/proc/sys/kernel/unprivileged_userns_clone") == 0:
        hints.append("unprivileged user namespaces are off (sysctl kernel.unprivileged_userns_clone=1 turns them on)")
    if _read_int("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == 1:
        hints.append("AppArmor restricts unprivileged user namespaces (Ubuntu >= 23.10): "
                     "sysctl kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile for bwrap")
    if "Operation not permitted" in stderr and not hints:
        hints.append("a container or seccomp policy forbids namespaces (docker needs --security-opt seccomp=unconfined "
                     "or a privileged container)")
    return "; ".join(hints)


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@lru_cache(maxsize=1)
def probe_bwrap() -> Check:
    """Can bubblewrap make every namespace we use (incl. network), here, as this user?"""
    path = bwrap_path()
    if not path:
        return Check("bubblewrap", False, "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)")
    argv = [path, "--unshare-all", "--unshare-user", "--die-with-parent", "--cap-drop", "ALL",
            "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check("bubblewrap", False, f"{path} could not run: {e}")
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        hint = userns_hint(proc.stderr)
        return Check("bubblewrap", False, f"{path} cannot create namespaces: {err}" + (f" — {hint}" if hint else ""))
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip()
    return Check("bubblewrap", True, f"{version} at {path}: user, PID, network, IPC, UTS, cgroup namespaces work")


def resolve_mode(setting: str) -> str:
    """'auto' | 'bwrap' | 'none' -> 'bwrap' | 'none'. Never silently weaker than asked: without bubblewrap, 'auto'
    and 'bwrap' raise IsolationError and only an explicit 'none' runs unconfined."""
    if setting == "none":
        return "none"
    check = probe_bwrap()
    if check.ok:
        return "bwrap"
    raise IsolationError(f"cannot isolate commands: {check.detail}. Install/enable bubblewrap, or run with "
                         f"--isolation none to review WITHOUT a sandbox (the repository's code then runs as you)")


# --------------------------------------------------------------------------------------------------------- the view

@lru_cache(maxsize=1)
def etc_masks() -> tuple[tuple[str, str], ...]:
    """Files and folders under /etc that not every user may read (shadow, ssh host keys, sudoers, private TLS keys,
    wifi passwords...): hidden from the sandbox even when the reviewer runs as root, which could read them."""
    masks: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk("/etc"):
        for name in list(dirnames):
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and (st.st_mode & 0o005) != 0o005:
                masks.append(("dir", p))
                dirnames.remove(name)  # nothing below it is visible anyway
        for name in filenames:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and not st.st_mode & 0o004:
                masks.append(("file", p))
    return tuple(masks)


def python_prefixes() -> list[Path]:
    """The Python installation(s) the reviewer runs on; the workspace's venv links to it (often under the user's
    home, e.g. ~/.pyenv/versions/3.11.7): only that prefix is shown, never the home around it."""
    prefixes = {Path(sys.base_prefix).resolve(), Path(os.path.realpath(sys.executable)).parent.parent}
    return sorted(p for p in prefixes if not any(str(p).startswith(s + "/") or str(p) == s for s in SYSTEM_DIRS))


# Folders in the home whose bin/ is on PATH but which also hold secrets or user data: only bin/ itself is shown.
BIN_ONLY_PARENTS = {".local", ".cargo", ".npm", ".config", ".ssh", ".gnupg", ".aws", ".docker", ".kube"}


def toolchain_paths(env: dict[str, str]) -> list[Path]:
    """Toolchains installed in the user's home that the command's PATH uses (rustup's ~/.cargo/bin, nvm's
    ~/.nvm/versions/node/vX/bin, ~/.local/bin...), shown read-only: the bin folder, or for a version prefix
    (…/vX/bin with lib/ beside it) the prefix; plus RUSTUP_HOME (toolchains, no credentials). Never the home itself,
    never ~/.cargo or ~/.local as a whole (credentials, keyrings, application data)."""
    home = Path.home().resolve()
    out: list[Path] = []
    for entry in env.get("PATH", "").split(os.pathsep):
        if not entry:
            continue
        p = Path(entry).resolve()
        if not p.is_dir() or p == home or not p.is_relative_to(home) or p.name == "shims":
            continue  # shims (pyenv, asdf) call their manager from the hidden home: shown, they would shadow /usr/bin
        parent = p.parent
        if p.name == "bin" and parent != home and parent.name not in BIN_ONLY_PARENTS and (parent / "lib").is_dir():
            out.append(parent)
        else:
            out.append(p)
    rustup = env.get("RUSTUP_HOME")
    if rustup and Path(rustup).is_dir():
        out.append(Path(rustup).resolve())
    return list(dict.fromkeys(out))


def sensitive_paths(extra: list[Path] = ()) -> list[Path]:
    """What must never be inside a folder we show the sandbox: the user's home and the reviewer's own files."""
    out = [Path.home()]
    config = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "reviewer"
    out.append(config)
    out += list(extra)
    return [p.resolve() for p in out]


def check_visible(path: Path, sensitive: list[Path], what: str) -> None:
    path = path.resolve()
    for s in sensitive:
        if s == path or s.is_relative_to(path):
            raise IsolationError(f"refusing to show {path} to the sandbox ({what}): it contains {s}")


@dataclass
class Sandbox:
    """Where one persona's commands may write and what they may reach."""
    workspace: Path  # the folder the sandbox may write (clone, venv, home, tmp)
    tmp: Path | None = None  # shown as the sandbox's private /tmp; default workspace/tmp if it exists
    mode: str = "bwrap"  # 'bwrap' | 'none' (see resolve_mode)
    limits: Limits = field(default_factory=Limits)
    network_allow: list[str] = field(default_factory=lambda: ["auto"])
    extra_ro: list[Path] = field(default_factory=list)  # more read-only paths the commands need
    protect: list[Path] = field(default_factory=list)  # more paths that must stay invisible (database, keys)


@dataclass
class Policy:
    """How a review confines its commands (from the settings); `for_workspace` makes each workspace's Sandbox."""
    mode: str = "bwrap"
    limits: Limits = field(default_factory=Limits)
    network_allow: list[str] = field(default_factory=lambda: ["auto"])
    protect: list[Path] = field(default_factory=list)

    @classmethod
    def from_settings(cls, settings=None) -> "Policy":
        """Raises IsolationError when isolation is asked for ('auto', 'bwrap') and bubblewrap cannot provide it.
        Settings names (all optional but isolation): isolation, network_allow, sandbox_memory_mb,
        sandbox_max_processes, sandbox_disk_mb, sandbox_output_mb, sandbox_cpu_seconds, command_timeout, db."""
        get = lambda name, default: getattr(settings, name, default) if settings is not None else default  # noqa: E731
        mode = resolve_mode(get("isolation", "auto"))
        command_timeout = float(get("command_timeout", 600))
        mb = lambda name, default: (get(name, default) or 0) * limits_mod.MiB or None  # noqa: E731
        lim = Limits(
            timeout=command_timeout,
            cpu_seconds=get("sandbox_cpu_seconds", None) or int(2 * command_timeout),
            memory_bytes=mb("sandbox_memory_mb", 4096),
            max_processes=get("sandbox_max_processes", 1024) or None,
            disk_bytes=mb("sandbox_disk_mb", 10240),
            max_output_bytes=mb("sandbox_output_mb", 64) or 64 * limits_mod.MiB,
        )
        protect = []
        db = str(get("db", "") or "")
        if db and "://" not in db:
            protect.append(Path(db).expanduser().resolve())
        return cls(mode=mode, limits=lim, network_allow=list(get("network_allow", ["auto"])), protect=protect)

    def for_workspace(self, workspace: Path, tmp: Path | None = None) -> "Sandbox":
        return Sandbox(workspace=workspace, tmp=tmp, mode=self.mode, limits=self.limits,
                       network_allow=self.network_allow, protect=self.protect)


def bwrap_argv(inner_argv: list[str], *, sandbox: Sandbox, cwd: Path, env: dict[str, str],
               proxy_socket: Path | None) -> list[str]:
    """The full bwrap command line that runs inner_argv (under init.py) confined."""
    path = bwrap_path()
    if not path:
        raise IsolationError("bwrap is not installed")
    features = bwrap_features()
    sensitive = sensitive_paths(sandbox.protect)
    a = [path, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
         "--hostname", "sandbox"]
    if "--disable-userns" in features:
        a += ["--disable-userns"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            a += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            a += ["--ro-bind", d, d]
    a += ["--ro-bind", "/etc", "/etc"]
    for kind, p in etc_masks():
        a += ["--tmpfs", p, "--remount-ro", p] if kind == "dir" else ["--ro-bind", "/dev/null", p]
    a += ["--proc", "/proc"]
    # Global kernel knobs stay read-only: as root the sandbox could otherwise write /proc/sys (kernel.core_pattern
    # runs a program as the host's root on the next crash) — bwrap leaves them writable here.
    for d in PROC_READ_ONLY:
        a += ["--ro-bind-try", d, d]
    a += ["--dev", "/dev", "--size", str(DEV_SHM_BYTES), "--tmpfs", "/dev/shm"]
    tmp = sandbox.tmp or (sandbox.workspace / "tmp" if (sandbox.workspace / "tmp").is_dir() else None)
    if tmp is not None:
        a += ["--bind", str(tmp), "/tmp"]
    else:
        a += ["--size", str(DEV_SHM_BYTES), "--tmpfs", "/tmp"]
    a += ["--symlink", "/tmp", "/var/tmp"]
    ro = python_prefixes() + [Path(p) for p in sandbox.extra_ro]
    for p in dict.fromkeys(ro):
        if p.exists():
            check_visible(p, sensitive, "read-only")
            a += ["--ro-bind", str(p), str(p)]
    check_visible(sandbox.workspace, sensitive, "workspace")
    a += ["--bind", str(sandbox.workspace), str(sandbox.workspace)]
    # The workspace may sit under the host's /tmp: bound after the private /tmp, it still lands on its own path.
    a += ["--dir", INSIDE_DIR, "--ro-bind", str(INIT_SCRIPT), f"{INSIDE_DIR}/init.py"]
    if proxy_socket is not None:
        a += ["--ro-bind", str(proxy_socket), f"{INSIDE_DIR}/proxy.sock"]
    a += ["--remount-ro", "/", "--chdir", str(cwd), "--clearenv"]
    for k, v in env.items():
        a += ["--setenv", k, v]
    return a + ["--", *inner_argv]


# ------------------------------------------------------------------------------------------------------ environment

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE|^AWS_|^AZURE_|"
                         r"^GOOGLE_APPLICATION|^GCP_|^GH_|^GITHUB_|^HF_|^OPENAI_|^ANTHROPIC_|^DATABASE_URL$", re.I)
# Certificate bundles are public (AWS_CA_BUNDLE is a path to CA certificates, not a credential).
SAFE_NAME = re.compile(r"CA_BUNDLE$|CA_CERTS?$|CERT_(?:FILE|DIR)$|^PIP_CERT$|^PIP_CONSTRAINT$", re.I)


def secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name)) and not SAFE_NAME.search(name)



def withhold_secrets(env: dict[str, str], host_env: dict[str, str] | None = None) -> tuple[dict[str, str], list[Event]]:
    """The caller builds env from an allowlist; this is the second lock. A variable goes if its name looks like a
    secret or its value is the value of a secret-looking variable of the reviewer's own environment."""
    host_env = os.environ if host_env is None else host_env
    # A path is not the secret (the file it names is, and the sandbox does not show it): only other values count.
    secret_values = {v for k, v in host_env.items() if secret_name(k) and len(v) >= 8 and not v.startswith("/")}
    kept, dropped = {}, []
    for k, v in env.items():
        if secret_name(k) or any(s in v for s in secret_values):
            dropped.append(k)
        else:
            kept[k] = v
    events = [Event("env_withheld", f"kept out of the sandbox's environment: {', '.join(sorted(dropped))}")] if dropped else []
    return kept, events


def proxy_env(port: int = egress_proxy.SANDBOX_PROXY_PORT) -> dict[str, str]:
    url = f"http://127.0.0.1:{port}"
    env = {}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "npm_config_proxy",
                 "npm_config_https_proxy", "YARN_HTTP_PROXY", "YARN_HTTPS_PROXY"):
        env[name] = url
    env["NO_PROXY"] = env["no_proxy"] = "localhost,127.0.0.1,::1"
    env.pop("ALL_PROXY", None)
    return env


# -------------------------------------------------------------------------------------------------------------- run

def file_size_limit(limits: Limits) -> int | None:
    # Just over the disk limit, so one huge file still shows up as a disk_limit event (the supervisor's final check)
    # while it cannot grow without bound between two polls.
    if limits.file_size_bytes:
        return limits.file_size_bytes
    return limits.disk_bytes + limits_mod.MiB if limits.disk_bytes else None


def init_argv(command: str, *, limits: Limits, cgroup: cgroups.Cgroup | None, report_fd: int | None,
              python: str, script: str, forward: str | None, reap: bool) -> list[str]:
    a = [python, "-I", "-S", script]
    if report_fd is not None:
        a += ["--report-fd", str(report_fd)]
    if forward:
        a += ["--forward", forward]
    if reap:
        a += ["--reap"]
    if limits.cpu_seconds:
        a += ["--cpu", str(int(limits.cpu_seconds))]
    fsize = file_size_limit(limits)
    if fsize:
        a += ["--fsize", str(int(fsize))]
    if limits.memory_bytes and not (cgroup and cgroup.memory_dir):
        # Without a memory cgroup, the next best thing: a per-process cap on private writable memory (RLIMIT_DATA,
        # not RLIMIT_AS, which breaks V8 and the JVM that reserve large address ranges they never touch).
        a += ["--data", str(int(limits.memory_bytes))]
    if not (cgroup and cgroup.cpu_dir):
        # Without a cpu cgroup each sandboxed process competes with the reviewer one by one; a lower priority keeps
        # a fork bomb from starving the supervisor that has to stop it (it costs nothing on an idle machine).
        a += ["--nice", "5"]
    if limits.max_processes and reap:
        # Counted per user namespace: a fresh count inside bwrap. Without it (mode none) it would count every process
        # this user has on the machine, so it is left to the cgroup there.
        a += ["--nproc", str(int(limits.max_processes))]
    return a + ["--", "bash", "-c", command]


def run_sandboxed(command: str, *, sandbox: Sandbox, cwd: Path, env: dict[str, str]) -> Outcome:
    """Run `command` with bash in `cwd`, confined as `sandbox` says. Returns the outcome with every event."""
    lim = sandbox.limits
    env, events = withhold_secrets(env)
    python = os.path.realpath(sys.executable)
    cgroup, _why = cgroups.create_cgroup(lim)
    r, w = os.pipe()
    os.set_inheritable(w, True)
    # Short path: unix socket names are limited to 107 bytes. The pid tells an orphan (reviewer killed) from one in use.
    scratch = Path(tempfile.mkdtemp(prefix=f"rvsb-pid{os.getpid()}-"))
    proxy = None
    try:
        watch = [sandbox.workspace]
        if sandbox.tmp is not None and not sandbox.tmp.resolve().is_relative_to(sandbox.workspace.resolve()):
            watch.append(sandbox.tmp)
        if sandbox.mode == "none":
            events.append(Event("isolation_disabled", "isolation none: this command ran WITHOUT a sandbox, as the "
                                                      "reviewer's user, with its files and network"))
            argv = init_argv(command, limits=lim, cgroup=cgroup, report_fd=w, python=python, script=str(INIT_SCRIPT),
                             forward=None, reap=False)
            outer_env = env
        else:
            setup = egress_proxy.registry_setup()
            allow = egress_proxy.expand_allowlist(sandbox.network_allow, setup)
            sock = scratch / "proxy.sock"
            proxy = egress_proxy.EgressProxy(sock, allow)
            proxy.start()
            inner_env = {**setup.env, **env, **proxy_env()}
            inner = init_argv(command, limits=lim, cgroup=cgroup, report_fd=w, python=python,
                              script=f"{INSIDE_DIR}/init.py", reap=True,
                              forward=f"{egress_proxy.SANDBOX_PROXY_PORT}:{INSIDE_DIR}/proxy.sock")
            box = Sandbox(**{**sandbox.__dict__,
                             "extra_ro": [*setup.ro_paths, *toolchain_paths(inner_env), *sandbox.extra_ro]})
            argv = bwrap_argv(inner, sandbox=box, cwd=cwd, env=inner_env, proxy_socket=sock)
            outer_env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}  # bwrap's own; readable inside
        argv = cgroups.enter_cgroup_argv(cgroup, argv)
        fds, r, w = (r, w), -1, -1  # run_supervised owns them from here
        outcome = supervisor.run_supervised(argv, cwd=cwd, env=outer_env, limits=lim, watch=watch, cgroup=cgroup,
                                            report_fd=fds[0], pass_fds=(fds[1],), count_leftovers=sandbox.mode == "none")
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
        if proxy is not None:
            proxy.stop()
        if cgroup is not None:
            cgroup.kill_all()
            cgroup.remove()
        shutil.rmtree(scratch, ignore_errors=True)
    if proxy is not None:
        events += [Event("network_refused", egress_proxy.refusal_detail(x)) for x in proxy.refusals()]
    events += outcome.events
    shown = python_prefixes() + list(sandbox.extra_ro) + [sandbox.workspace]
    events += limits_mod.events_from_output(outcome.output, events, hidden=sensitive_paths(sandbox.protect),
                                            shown=shown)
    outcome.events = events
    return outcome
