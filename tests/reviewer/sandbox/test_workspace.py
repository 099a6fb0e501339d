"""Targets, refs and fresh workspaces on real git repositories; the baseline sandbox on real subprocesses."""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from reviewer.examples import git, make_example_repo
from reviewer.sandbox.command import run_shell, sandbox_env
from reviewer.sandbox.workspace import (Workspace, WorkspaceError, clone_commit, create_workspace, remove_tree,
                                        resolve_target)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """The example project with some history: tag v0.3.0 (annotated) on the first commit, a branch `dev` one commit
    ahead of main, and main one commit past the tag."""
    path = make_example_repo(tmp_path_factory.mktemp("repos") / "tinystats")
    git(path, "tag", "-a", "v0.3.0", "-m", "first release")
    (path / "CHANGES.md").write_text("0.3.1: more statistics\n")
    git(path, "add", "CHANGES.md")
    git(path, "commit", "-q", "-m", "changelog")
    git(path, "checkout", "-q", "-b", "dev")
    (path / "DEV.md").write_text("work in progress\n")
    git(path, "add", "DEV.md")
    git(path, "commit", "-q", "-m", "dev work")
    git(path, "checkout", "-q", "main")
    return path


def sha(repo: Path, rev: str) -> str:
    return git(repo, "rev-parse", rev)


def bare_workspace(tmp_path: Path) -> Workspace:
    """A workspace without clone or venv, for sandbox tests that need neither."""
    root = tmp_path / "repo"
    for d in ("repo", "home", "tmp"):
        (tmp_path / d).mkdir()
    env = sandbox_env(home=tmp_path / "home", tmp=tmp_path / "tmp")
    return Workspace(root=root, venv=tmp_path / "venv", env=env, commit="0" * 40, path=tmp_path)


# --- targets and refs ---------------------------------------------------------------------------------------------

def test_local_path_becomes_its_file_url_at_head(repo):
    t = resolve_target(str(repo))
    assert t.url == repo.resolve().as_uri()
    assert t.commit == sha(repo, "main")
    assert t.branch == "main" and t.ref is None


def test_file_url_works_like_any_remote(repo):
    t = resolve_target(repo.resolve().as_uri())
    assert t.commit == sha(repo, "HEAD")


@pytest.mark.parametrize("ref, rev", [("main", "main"), ("dev", "dev"), ("v0.3.0", "v0.3.0^{commit}"),
                                      ("refs/heads/dev", "dev")])
def test_branch_and_tag_refs(repo, ref, rev):
    t = resolve_target(str(repo), ref)
    assert t.commit == sha(repo, rev)  # an annotated tag resolves to its commit, not to the tag object


def test_full_sha_not_at_any_branch_tip_is_fetched_and_checked(repo, tmp_path):
    first = sha(repo, "main~1")  # reachable, but no ref points at it
    t = resolve_target(str(repo), first)
    assert t.commit == first
    clone_commit(t.url, t.commit, tmp_path / "clone")
    assert git(tmp_path / "clone", "rev-parse", "HEAD") == first
    assert not (tmp_path / "clone" / "CHANGES.md").exists()


@pytest.mark.parametrize("ref, expected", [
    ("no-such-branch", "unknown ref 'no-such-branch'"),
    ("0123456789abcdef0123456789abcdef01234567", "no such commit"),
])
def test_unknown_ref_is_one_clear_line(repo, ref, expected):
    with pytest.raises(WorkspaceError) as err:
        resolve_target(str(repo), ref)
    message = str(err.value)
    assert expected in message
    assert "\n" not in message
    if "branch" in ref:
        assert "branches: dev, main" in message and "v0.3.0" in message  # says what does exist


def test_short_sha_asks_for_the_full_one(repo):
    with pytest.raises(WorkspaceError, match="full sha"):
        resolve_target(str(repo), sha(repo, "main")[:10])


def test_not_a_repository(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(WorkspaceError, match="not a git repository"):
        resolve_target(str(tmp_path / "plain"))
    with pytest.raises(WorkspaceError, match="no such file or directory"):
        resolve_target(str(tmp_path / "missing"))


def test_folder_inside_a_repository_names_the_top(repo):
    with pytest.raises(WorkspaceError, match="not the top of a git repository"):
        resolve_target(str(repo / "tinystats"))


@pytest.mark.parametrize("url", ["https://nonexistent.invalid/owner/repo.git", "file:///nonexistent/repo.git"])
def test_unresolvable_url_fails_fast_with_one_line(url):
    start = time.monotonic()
    with pytest.raises(WorkspaceError) as err:
        resolve_target(url)
    assert time.monotonic() - start < 30
    assert str(err.value).startswith(f"cannot read repository {url}")
    assert "\n" not in str(err.value)


# --- workspaces ---------------------------------------------------------------------------------------------------

def test_each_persona_gets_its_own_fresh_clone_and_venv(repo, tmp_path):
    target = resolve_target(str(repo), "dev")
    a = create_workspace(target, parent=tmp_path, name="a")
    b = create_workspace(target, parent=tmp_path, name="b")
    try:
        assert a.root != b.root and a.venv != b.venv
        for ws in (a, b):
            assert git(ws.root, "rev-parse", "HEAD") == sha(repo, "dev")
            assert git(ws.root, "status", "--porcelain") == ""  # the clone holds the project and nothing else
            assert (ws.root / "DEV.md").is_file()
            assert git(ws.root, "rev-list", "--count", "HEAD") == "1"  # shallow
            assert not ws.venv.is_relative_to(ws.root)
        # One persona's mess never reaches the other: files, installed packages, HOME.
        out = a.run("echo mess > junk.txt && rm README.md && python -m pip --version && echo $VIRTUAL_ENV && echo $HOME", 60)
        assert out.exit_code == 0, out.output
        assert str(a.venv) in out.output and str(a.path / "home") in out.output
        assert (a.root / "junk.txt").exists() and not (b.root / "junk.txt").exists()
        assert (b.root / "README.md").is_file()
        which = b.run("command -v python", 10).output.strip()
        assert which == str(b.venv / "bin" / "python")
    finally:
        a.remove()
        b.remove()
    assert not a.path.exists() and not b.path.exists()


def test_resolve_stays_inside_the_workspace(tmp_path):
    ws = bare_workspace(tmp_path)
    (ws.root / "src").mkdir()
    (ws.root / "src" / "a.py").write_text("x = 1\n")
    (ws.root / "inside").symlink_to(ws.root / "src")
    (ws.root / "outside").symlink_to("/etc")
    (ws.root / "src" / "sneaky").symlink_to("../../home")
    assert ws.resolve("src/a.py") == (ws.root / "src" / "a.py").resolve()
    assert ws.resolve(str(ws.root / "src" / "a.py")) == (ws.root / "src" / "a.py").resolve()
    assert ws.resolve("inside/a.py") == (ws.root / "src" / "a.py").resolve()
    assert ws.resolve("new/file.txt") == (ws.root / "new" / "file.txt").resolve()  # not there yet: fine
    for bad in ("../home", "/etc/passwd", "src/../../tmp", "outside/passwd", "src/sneaky", "src/sneaky/x"):
        with pytest.raises(WorkspaceError, match="outside the workspace"):
            ws.resolve(bad)


# --- the sandbox --------------------------------------------------------------------------------------------------

def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose; reaped by init since its parent is gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_timeout_kills_the_whole_process_group(tmp_path):
    ws = bare_workspace(tmp_path)
    start = time.monotonic()
    result = ws.run("sleep 300 & echo $! > child.pid; (sleep 301; echo never) & echo started; wait", 1.5)
    assert result.timed_out and result.exit_code is None
    assert time.monotonic() - start < 10
    assert "started" in result.output and "never" not in result.output
    assert "timeout" in result.output
    child = int((ws.root / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_background_processes_do_not_outlive_the_command(tmp_path):
    ws = bare_workspace(tmp_path)
    result = ws.run("sleep 300 & echo $! > bg.pid; echo done", 30)
    assert result.exit_code == 0 and not result.timed_out
    assert result.seconds < 10  # did not wait for the background sleep
    pid = int((ws.root / "bg.pid").read_text())
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_output_is_capped_to_head_and_tail(tmp_path):
    ws = bare_workspace(tmp_path)
    result = run_shell("echo FIRST; yes middle | head -c 3000000; echo; echo LAST", cwd=ws.root, env=ws.env,
                       timeout=30, max_output=2000)
    assert result.exit_code == 0 and result.truncated
    assert result.output.startswith("FIRST")
    assert result.output.rstrip().endswith("LAST")
    assert len(result.output) < 2200
    # The one supervisor's head + tail (reviewer/sandbox/supervisor.py OutputBuffer), as in the sandbox.
    left_out = int(result.output.split("[... ")[1].split(" bytes left out")[0])
    assert 2_990_000 < left_out < 3_000_100


def test_exit_code_and_stderr_are_kept(tmp_path):
    ws = bare_workspace(tmp_path)
    result = ws.run("echo out; echo err >&2; printf '\\xff\\n'; exit 3", 10)
    assert result.exit_code == 3 and not result.truncated
    assert "out" in result.output and "err" in result.output and "\ufffd" in result.output


def test_environment_is_scrubbed(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-fake-secret-123")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-fake-456")
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_fake789")
    monkeypatch.setenv("MY_OWN_SETTING", "private-value")
    monkeypatch.setenv("PIP_INDEX_URL", "https://user:pw-secret@example.invalid/simple")  # allowlisted, passed on
    ws = bare_workspace(tmp_path)
    result = ws.run("env", 10)
    assert result.exit_code == 0
    for secret in ("sk-fake-secret-123", "sk-ant-fake-456", "ghp_fake789", "private-value", "OPENAI_API_KEY"):
        assert secret not in result.output
    env = dict(line.split("=", 1) for line in result.output.splitlines() if "=" in line)
    assert env["HOME"] == str(tmp_path / "home")
    assert env["TMPDIR"] == str(tmp_path / "tmp")
    assert env["PWD"] == str(ws.root)
    assert env["PIP_INDEX_URL"].startswith("https://")


def test_a_command_that_closes_its_output_still_times_out(tmp_path):
    ws = bare_workspace(tmp_path)
    t = time.monotonic()
    result = ws.run("exec >/dev/null 2>&1; sleep 30", 1.5)
    assert time.monotonic() - t < 10
    assert result.timed_out and result.exit_code is None


@pytest.mark.parametrize("command", ["echo $$ > shell.pid; sleep 300",
                                     "echo $$ > shell.pid; exec >/dev/null 2>&1; sleep 300"],
                         ids=["printing", "output_closed"])
def test_ctrl_c_while_a_command_runs_kills_it(tmp_path, command):
    ws = bare_workspace(tmp_path)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            ws.run(command, 60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    pid = int((ws.root / "shell.pid").read_text())
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_removing_a_tree_whose_root_cannot_go_keeps_the_parent_mode(tmp_path):
    """A workspace left mounted (a busy diskcap mount) cannot be removed itself; removing what is inside must not
    change its parent's mode. An earlier remove_tree made the parent 0700, and the parent was /tmp."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a tmpfs")
    parent = tmp_path / "parent"
    parent.mkdir()
    parent.chmod(0o1777)
    root = parent / "workspace"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], capture_output=True).returncode:
        pytest.skip("this machine cannot mount a tmpfs")
    try:
        (root / "sub").mkdir()
        (root / "sub" / "read-only.txt").write_text("x")
        (root / "sub" / "read-only.txt").chmod(0o400)
        (root / "sub").chmod(0o500)
        remove_tree(root)
        assert list(root.iterdir()) == []  # everything inside went; the mount point itself stays
        assert (parent.stat().st_mode & 0o7777) == 0o1777
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)
