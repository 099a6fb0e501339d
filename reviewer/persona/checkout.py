"""The code under test is the checkout's: after the install, and again after what the tests need is installed, smoke
checks that the project's package imports from the workspace (or from a wheel built from it), and fixes it when not.

How it goes wrong (seen on a real project): a workspace is a shallow clone without tags, so setuptools-scm (or
hatch-vcs) gives the project the version `0.1.dev1`; a test dependency that requires the project itself at `>=2`
(pytest requires its own plugins' hosts, a plugin requires its host) then makes pip replace the editable install with
the registry's release, and the tests and probes run against site-packages while every finding names the checkout.
The fix: install again with `SETUPTOOLS_SCM_PRETEND_VERSION` set to a version that satisfies the dependents (the one
PKG-INFO gives, else the upstream's last tag, else the version of the release pip chose, which satisfies them by
construction). When even that does not help, every later finding says so and the summary marks the run.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from reviewer.sandbox.workspace import WorkspaceError, git, list_remote

PRETEND = "SETUPTOOLS_SCM_PRETEND_VERSION"
REDONE = "install time (the checkout's own code)"  # the measurement of the install redone; verify.py redoes it
# Build backends whose version comes from git tags: a tagless clone gives them 0.1.dev1 (or 0.0)
# and that read SETUPTOOLS_SCM_PRETEND_VERSION (hatch-vcs and flit-scm run setuptools-scm)
SCM_BACKENDS = re.compile(r"setuptools[-_]scm|hatch[-_]vcs|flit[-_]scm", re.I)

# Runs in the sandbox with `python -I` (no cwd on sys.path: `python -c` from the repository root would import a flat
# layout's checkout whatever is installed). Says where the package comes from and which distribution holds it.
WHERE_SCRIPT = r"""
import importlib, json, os, sys
from importlib import metadata
root = os.path.realpath(sys.argv[1])
out = {"file": None, "inside": False, "dist": None, "version": None, "url": ""}
try:
    m = importlib.import_module(sys.argv[2])
    f = getattr(m, "__file__", None) or next(iter(getattr(m, "__path__", [])), None)
    out["file"] = os.path.realpath(f) if f else None
except BaseException as e:
    out["error"] = repr(e)[:300]
if out["file"]:
    out["inside"] = out["file"].startswith(root + os.sep)
    for dist in metadata.distributions():
        files = [str(p) for p in (dist.files or [])]
        top = sys.argv[2] + "/__init__.py", sys.argv[2] + ".py"
        if any(p in top for p in files):
            out["dist"], out["version"] = dist.metadata["Name"], dist.version
            try:
                out["url"] = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
            except ValueError:
                pass
            break
print("@@checkout@@ " + json.dumps(out))
"""


@dataclass
class Where:
    """Where the package a user imports comes from in the workspace."""

    file: str | None  # the module's file (or the package's __init__.py), real path
    inside: bool  # inside the clone (an editable install, or the clone itself)
    dist: str | None  # the distribution holding it
    version: str | None
    url: str  # direct_url.json's url: file://<clone> for a wheel built from the checkout
    error: str | None = None

    def checkouts(self, root: Path) -> bool:
        built_here = self.url.startswith("file://") and Path(self.url[7:]).resolve() == root.resolve()
        return self.file is not None and (self.inside or built_here)

    def describe(self) -> str:
        release = f"{self.dist} {self.version}" if self.dist else "an installed copy"
        return f"`{self.file}` ({release}, not built from this checkout)"


def where_command(root: Path, package: str) -> str:
    return f"python -I -c {shlex.quote(WHERE_SCRIPT)} {shlex.quote(str(root))} {shlex.quote(package)}"


def parse_where(output: str) -> Where | None:
    for line in reversed(output.splitlines()):
        if line.startswith("@@checkout@@ "):
            try:
                got = json.loads(line[len("@@checkout@@ "):])
            except ValueError:
                return None
            return Where(file=got.get("file"), inside=bool(got.get("inside")), dist=got.get("dist"),
                         version=got.get("version"), url=got.get("url") or "", error=got.get("error"))
    return None


def uses_scm_version(root: Path) -> bool:
    """Does the build take its version from git (setuptools-scm, hatch-vcs, ...)?"""
    for name in ("pyproject.toml", "setup.py", "setup.cfg"):
        path = root / name
        if path.is_file() and SCM_BACKENDS.search(path.read_text(errors="replace")):
            return True
    return False


def version_key(tag: str) -> tuple:
    return tuple(int(n) for n in re.findall(r"\d+", tag)[:4])


def pkg_info_version(root: Path) -> str | None:
    """The version an sdist's PKG-INFO gives (a repository made from an sdist keeps it at the top). Not an
    egg-info's: the install itself writes one, with the very 0.1.dev1 that is the problem."""
    path = root / "PKG-INFO"
    m = re.search(r"^Version:\s*(\S+)", path.read_text(errors="replace"), re.M) if path.is_file() else None
    return m.group(1) if m else None


def upstream_tag_version(url: str) -> str | None:
    """The highest version among the upstream's tags (`v1.2.3`, `1.2.3`), or None."""
    if not url:
        return None
    try:
        refs, _ = list_remote(url)
    except (WorkspaceError, OSError):
        return None
    tags = [n.removeprefix("refs/tags/").removesuffix("^{}") for n in refs if n.startswith("refs/tags/")]
    versions = [t.lstrip("vV") for t in tags if re.fullmatch(r"[vV]?\d+(\.\d+)*", t)]
    return max(versions, key=version_key) if versions else None


def pretend_versions(root: Path, url: str, replaced: Where | None) -> list[tuple[str, str]]:
    """(version, where it came from) to try, best first."""
    found = [(pkg_info_version(root), "PKG-INFO"), (upstream_tag_version(url), "the upstream's last tag")]
    if replaced is not None and replaced.version:
        found.append((replaced.version, f"the version of the release pip installed instead ({replaced.dist})"))
    return list(dict.fromkeys((v, why) for v, why in found if v))


def tagless(root: Path) -> bool:
    """No tag reachable from the clone's commit (a workspace is a shallow clone: always, unless tags came along)."""
    try:
        return git("describe", "--tags", "--abbrev=0", cwd=root).returncode != 0
    except (OSError, WorkspaceError, subprocess.SubprocessError):
        return True


def version_before_install(root: Path, url: str) -> tuple[str, str] | None:
    """(version, where from) to pretend for a tagless clone whose build takes its version from git, when PKG-INFO or
    the upstream's tags say it; None otherwise (the check after the install still catches a replaced install)."""
    if not uses_scm_version(root) or not tagless(root):
        return None
    return next(iter(pretend_versions(root, url, None)), None)


def where(smoke, package: str) -> Where | None:
    res = smoke.sh(f"where does `import {package}` come from?", where_command(smoke.workspace.root, package),
                   timeout=60)
    return parse_where(res.output)


def ensure_checkout(smoke, moment: str) -> None:
    """After an install step (`moment`): the package must import from the checkout; if not, install it again (with
    a pretended version where the build takes it from git) and check again; if that fails, mark the run."""
    package, root = smoke.package, smoke.workspace.root
    if not package or smoke.not_checkout:
        return
    found = where(smoke, package)
    if found is None or found.file is None or found.checkouts(root):
        return  # it imports from the checkout (an import that fails is smoke's own finding)
    tries = [(v, why) for v, why in pretend_versions(root, smoke.workspace.url, found)] if uses_scm_version(root) else []
    for version, why in tries + [(None, "")]:
        env = f"{PRETEND}={shlex.quote(version)} " if version else ""
        command = env + re.sub(rf"^{PRETEND}=\S+ ", "", smoke.reinstall)
        got = smoke.sh("install the checkout again (" + (f"version {version}, from {why}" if version else "as is")
                       + ")", command)
        again = where(smoke, package) if got.exit_code == 0 else None
        if again is not None and again.checkouts(root):
            if version:
                smoke.workspace.env[PRETEND] = version  # any later build of the project keeps it
            smoke.measure(name=REDONE, value=round(got.seconds, 3), unit="s",
                          command=command)
            smoke.notes.append(f"{moment}, `import {package}` came from {found.describe()}; installed the checkout "
                               "again" + (f" as version {version} ({why})" if version else ""))
            return
    smoke.not_checkout = (f"this run did not test the checkout's own code: {moment}, `import {package}` comes from "
                          f"{found.describe()}, and installing the checkout again did not change that")
    smoke.notes.append("NOT THE CHECKOUT'S CODE: " + smoke.not_checkout)
