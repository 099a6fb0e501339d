"""The example project as a real git repository, for `make demo` and the tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tinystats"
IGNORE = shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.egg-info", ".venv")


def git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "example", "GIT_AUTHOR_EMAIL": "example@localhost",
           "GIT_COMMITTER_NAME": "example", "GIT_COMMITTER_EMAIL": "example@localhost", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def make_example_repo(dest: Path, source: Path = EXAMPLE) -> Path:
    """Copy the example project to `dest` (replacing it) and commit it on branch main; returns `dest`."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest, ignore=IGNORE)
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "tinystats 0.3.1")
    return dest


if __name__ == "__main__":
    import sys

    print(make_example_repo(Path(sys.argv[1] if len(sys.argv) > 1 else "build/demo-repo")))
