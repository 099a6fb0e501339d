"""The repository under review and the fresh workspace each persona gets.

`resolve_target` turns what the user typed (a git URL or a local path) and an optional ref into a repository URL and a
commit sha, checking everything a review needs before anything is written. `create_workspace` then makes, per persona,
a folder holding a fresh shallow clone of exactly that commit (`repo/`, the persona's working directory), its own
virtual environment (`venv/`, outside the clone so the project never trips over it), and its own HOME and TMPDIR.

git runs with prompts off and a timeout, so a bad URL or a private repository fails in seconds with one line instead of
waiting for a password nobody will type.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from reviewer.sandbox import diskcap
from reviewer.sandbox.command import CommandResult, run_shell, sandbox_env
from reviewer.sandbox.isolation import Policy, Sandbox

LS_REMOTE_TIMEOUT = 60.0
FETCH_TIMEOUT = 600.0
VENV_TIMEOUT = 300.0
FULL_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
KEPT_MARKER = "KEPT"  # in a workspace kept on purpose (a failed persona's): the orphan sweep leaves it for a day
SCP_LIKE = re.compile(r"^[\w.-]+@[\w.-]+:")  # git@github.com:owner/repo.git


class WorkspaceError(Exception):
    """A target, ref or workspace problem; the message is one line for the user."""


@dataclass
class Target:
    url: str  # what is fetched and stored as the repository: the URL, or file:// + absolute path for a local repo
    commit: str  # full sha
    ref: str | None  # what the user asked for (None: the default branch)
    branch: str | None = None  # branch name when the ref (or HEAD) is a branch, for a friendlier checkout


@dataclass
class Workspace:
    root: Path  # the persona's fresh clone: the working directory of every command
    venv: Path  # its own virtual environment, made before the persona starts
    env: dict[str, str]
    commit: str
    path: Path | None = None  # the folder holding root, venv, home and tmp; removed after the persona
    url: str = ""
    command_timeout: float = 600.0  # upper bound for any one command (settings.command_timeout)
    notes: list[str] = field(default_factory=list)  # things the persona should know (e.g. submodules not fetched)
    sandbox: Sandbox | None = None  # how commands are confined (None: the bare baseline, for tests of it)
    on_event: Callable[[object, str], None] | None = None  # (reviewer.sandbox.limits.Event, command) -> record it
    _told: set[str] = field(default_factory=set)  # event kinds said once per workspace (isolation_disabled)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def run(self, command: str, timeout: float) -> CommandResult:
        result = run_shell(command, cwd=self.root, env=self.env, timeout=min(float(timeout), self.command_timeout),
                           sandbox=self.sandbox)
        if self.on_event is not None:
            for event in result.events:
                if event.kind == "isolation_disabled":  # true of every command: recorded once per persona
                    if event.kind in self._told:
                        continue
                    self._told.add(event.kind)
                self.on_event(event, command)
        return result

    def resolve(self, path: str) -> Path:
        """A workspace-relative or absolute path -> the real path inside root; anything escaping root (through '..'
        or a symlink) raises WorkspaceError."""
        root = self.root.resolve()
        try:
            candidate = Path(path)
            resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
        except (ValueError, OSError, RuntimeError) as e:  # NUL bytes, symlink loops
            raise WorkspaceError(f"bad path {path!r}: {e}") from None
        if resolved != root and not resolved.is_relative_to(root):
            raise WorkspaceError(f"{path!r} is outside the workspace ({root})")
        return resolved

    def remove(self) -> None:
        if self.path is not None:
            remove_workspace(self.path)

    def keep(self) -> None:
        """Leave the workspace for a look (its path is printed); the next reviews' orphan sweep removes it a day on."""
        if self.path is not None:
            (self.path / KEPT_MARKER).write_text(f"kept by pid {os.getpid()}\n")


def git_env() -> dict[str, str]:
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", LC_ALL="C")
    env.setdefault("GIT_SSH_COMMAND", "ssh -o BatchMode=yes -o ConnectTimeout=20")
    return env


def git(*args: str, cwd: Path | None = None, timeout: float = LS_REMOTE_TIMEOUT) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=cwd, env=git_env(), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise WorkspaceError(f"`git {args[0]}` gave no answer within {timeout:g} s") from None
    except FileNotFoundError:
        raise WorkspaceError("git is not installed (it is needed to fetch the repository)") from None


def git_reason(proc: subprocess.CompletedProcess) -> str:
    """The line of git's stderr that says what went wrong."""
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("fatal:"):
            return ln.removeprefix("fatal:").strip()
    return lines[-1] if lines else f"git exited with {proc.returncode}"


def is_url(target: str) -> bool:
    return "://" in target or bool(SCP_LIKE.match(target))


def local_repository_url(path_text: str) -> str:
    """A local path must be the top of a git repository (or a bare one); its file:// URL is what gets cloned."""
    path = Path(path_text).expanduser()
    if not path.exists():
        raise WorkspaceError(f"{path_text}: no such file or directory (give a git URL or the path of a git repository)")
    if not path.is_dir():
        raise WorkspaceError(f"{path_text}: not a directory (give a git URL or the path of a git repository)")
    path = path.resolve()
    proc = git("rev-parse", "--is-bare-repository", "--show-toplevel", cwd=path)
    if proc.returncode != 0:
        raise WorkspaceError(f"{path_text}: not a git repository")
    out = proc.stdout.split()
    if out and out[0] == "true":
        return path.as_uri()
    top = Path(out[1]).resolve() if len(out) > 1 else path
    if top != path:
        raise WorkspaceError(f"{path_text}: not the top of a git repository (it lies inside {top}); give {top}")
    return path.as_uri()


def list_remote(url: str) -> tuple[dict[str, str], str | None]:
    """(ref name -> sha, default branch) of a repository, peeled tags under 'refs/tags/NAME^{}'."""
    proc = git("ls-remote", "--symref", url)
    if proc.returncode != 0:
        raise WorkspaceError(f"cannot read repository {url}: {git_reason(proc)}")
    refs: dict[str, str] = {}
    default_branch = None
    for line in proc.stdout.splitlines():
        if line.startswith("ref: ") and line.endswith("\tHEAD"):
            default_branch = line[5:].split("\t")[0].removeprefix("refs/heads/")
            continue
        sha, _, name = line.partition("\t")
        if name:
            refs[name] = sha
    return refs, default_branch


def commit_exists(url: str, sha: str) -> bool:
    """Ask the server for exactly this commit (depth 1, no trees where the server can filter) in a scratch repo."""
    with tempfile.TemporaryDirectory(prefix=f"reviewer-probe-pid{os.getpid()}-") as tmp:
        init = git("init", "-q", "--bare", tmp)
        if init.returncode != 0:
            raise WorkspaceError(f"git init failed: {git_reason(init)}")
        proc = git("-c", "protocol.version=2", "fetch", "-q", "--depth", "1", "--filter=tree:0", url, sha, cwd=Path(tmp),
                   timeout=FETCH_TIMEOUT)
        return proc.returncode == 0


def resolve_target(target: str, ref: str | None = None) -> Target:
    """What to review: the repository URL and the commit sha. Raises WorkspaceError (one line) if either is wrong."""
    target = target.strip()
    if not target:
        raise WorkspaceError("no repository given")
    url = target if is_url(target) else local_repository_url(target)
    refs, default_branch = list_remote(url)
    if ref is None:
        if "HEAD" not in refs:
            raise WorkspaceError(f"{url} has no commits (or no default branch); give --ref")
        return Target(url=url, commit=refs["HEAD"], ref=None, branch=default_branch)
    # git's own order for a short name: the exact ref, then tags, then branches. Annotated tags peel to their commit.
    for name in (ref, f"refs/tags/{ref}", f"refs/heads/{ref}"):
        sha = refs.get(f"{name}^{{}}") or refs.get(name)
        if sha:
            branch = name.removeprefix("refs/heads/") if name.startswith("refs/heads/") else None
            return Target(url=url, commit=sha, ref=ref, branch=branch)
    if FULL_SHA.fullmatch(ref.lower()):
        sha = ref.lower()
        if sha in refs.values() or commit_exists(url, sha):
            return Target(url=url, commit=sha, ref=ref)
        raise WorkspaceError(f"unknown ref {ref!r}: no such commit in {url}")
    branches = sorted(n.removeprefix("refs/heads/") for n in refs if n.startswith("refs/heads/"))
    tags = sorted(n.removeprefix("refs/tags/") for n in refs if n.startswith("refs/tags/") and not n.endswith("^{}"))
    known = ", ".join([f"branches: {', '.join(branches[:8]) or '-'}", f"tags: {', '.join(tags[:8]) or '-'}"])
    hint = " (a commit must be given as its full sha)" if re.fullmatch(r"[0-9a-fA-F]{4,39}", ref) else ""
    raise WorkspaceError(f"unknown ref {ref!r} in {url}{hint}; {known}")


def remove_tree(path: Path) -> None:
    """rmtree that also removes read-only files (Go's module cache makes them)."""

    root = os.path.abspath(path)

    def inside(p: str) -> bool:
        return os.path.commonpath([root, os.path.abspath(p)]) == root

    def make_writable_and_retry(func, p, _exc):
        # Only folders inside the tree are touched: when the tree's own root cannot be removed, its parent
        # (often /tmp itself) must keep its mode. An earlier version made /tmp 0700 that way.
        try:
            parent = os.path.dirname(p)
            if inside(parent):
                os.chmod(parent, stat.S_IRWXU)
            if inside(p) and not os.path.islink(p):  # chmod follows symlinks: a planted one would reach a host file
                os.chmod(p, stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onexc=make_writable_and_retry) if sys.version_info >= (3, 12) else shutil.rmtree(
        path, onerror=make_writable_and_retry)


def remove_workspace(path: Path) -> None:
    """A workspace folder and everything in it, its disk-capped file system (diskcap) included."""
    diskcap.release(path)
    remove_tree(path)


def clone_commit(url: str, commit: str, dest: Path, branch: str | None = None) -> list[str]:
    """A fresh shallow clone of one commit: init + fetch --depth 1 <sha> + checkout. Works for https, ssh and file://
    (protocol v2 lets a client ask for any commit, advertised or not). Returns notes for the persona."""
    notes: list[str] = []
    for args in (("init", "-q", str(dest)), ("-C", str(dest), "remote", "add", "origin", url)):
        proc = git(*args)
        if proc.returncode != 0:
            raise WorkspaceError(f"git {args[0] if args[0] != '-C' else args[2]} failed: {git_reason(proc)}")
    proc = git("-c", "protocol.version=2", "fetch", "-q", "--depth", "1", "origin", commit, cwd=dest, timeout=FETCH_TIMEOUT)
    if proc.returncode != 0:
        raise WorkspaceError(f"cannot fetch {commit[:12]} from {url}: {git_reason(proc)}")
    checkout = ("checkout", "-q", "-B", branch, commit) if branch else ("checkout", "-q", "--detach", commit)
    proc = git(*checkout, cwd=dest)
    if proc.returncode != 0:
        raise WorkspaceError(f"cannot check out {commit[:12]}: {git_reason(proc)}")
    head = git("rev-parse", "HEAD", cwd=dest).stdout.strip()
    if head != commit:
        raise WorkspaceError(f"checked out {head[:12]} instead of {commit[:12]}")
    if (dest / ".gitmodules").is_file():
        proc = git("submodule", "update", "--init", "--recursive", "--depth", "1", cwd=dest, timeout=FETCH_TIMEOUT)
        if proc.returncode != 0:
            notes.append(f"git submodules could not be fetched: {git_reason(proc)}")
    return notes


def create_venv(venv: Path, python: str = sys.executable, home: Path | None = None) -> None:
    # HOME inside the workspace: ensurepip's pip runs `rustc --version` for its user agent, and rustup would create
    # ~/.rustup in the user's real home.
    env = {**os.environ, "HOME": str(home)} if home is not None else None
    try:
        proc = subprocess.run([python, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=VENV_TIMEOUT,
                              stdin=subprocess.DEVNULL, env=env)
    except subprocess.TimeoutExpired:
        raise WorkspaceError(f"creating the virtual environment took over {VENV_TIMEOUT:g} s") from None
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise WorkspaceError(f"cannot create a virtual environment with {python}: {lines[-1] if lines else proc.returncode}")


def create_workspace(target: Target, *, parent: Path | None, name: str, command_timeout: float = 600.0,
                     python: str = sys.executable, policy: Policy | None = None) -> Workspace:
    """A fresh folder for one persona: repo/ (shallow clone at target.commit), venv/, home/, tmp/. Its commands run
    confined by `policy` (default: bubblewrap with the default limits; IsolationError where it is unavailable).
    Where the machine allows (root), the folder is its own file system of the policy's disk size (diskcap), so the
    kernel stops a disk-filling command at the limit; the name carries our pid, so that a later review can tell an
    orphan (its process killed) from a workspace in use, and remove it (reviewer.sandbox.orphans)."""
    policy = policy or Policy.from_settings(None)
    parent = Path(parent) if parent else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)[:40] or "persona"
    path = Path(tempfile.mkdtemp(prefix=f"reviewer-{safe}-pid{os.getpid()}-", dir=parent))
    try:
        if policy.limits.disk_bytes:
            diskcap.mount_capped(path, policy.limits.disk_bytes)  # else (not root): the polling limit alone
        root, venv, home, tmp = path / "repo", path / "venv", path / "home", path / "tmp"
        notes = clone_commit(target.url, target.commit, root, target.branch)
        home.mkdir()
        tmp.mkdir()
        create_venv(venv, python, home=home)
        env = sandbox_env(home=home, tmp=tmp, venv=venv)
        return Workspace(root=root, venv=venv, env=env, commit=target.commit, path=path, url=target.url,
                         command_timeout=command_timeout, notes=notes, sandbox=policy.for_workspace(path, tmp))
    except BaseException:
        remove_workspace(path)
        raise
