"""ruff finds no undefined name (F821) in reviewer/, backend/ and reviewer_kernels/ (issue 44). What it checks, and the
temporary per-file exclusions, are pyproject.toml's [tool.ruff]: `ruff check` alone is the command, here and by hand."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """ruff from this interpreter's environment (the test extra installs it), run at the repository root."""
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_ruff_check_passes():
    proc = ruff("check", "--output-format", "concise")
    assert proc.returncode == 0, proc.stdout + proc.stderr + "\n(no module named ruff: pip install -e '.[test]')"


@pytest.mark.parametrize("package", ["reviewer", "backend", "reviewer_kernels"])
def test_the_configuration_reports_an_undefined_name_in_each_package(package):
    """The project's configuration selects F821 for a module of each package (so the check above can fail)."""
    proc = ruff("check", "--output-format", "concise", "--stdin-filename", f"{package}/new_module.py", "-",
                stdin="def f():\n    return undefined_name\n")
    assert proc.returncode == 1 and "F821" in proc.stdout and "undefined_name" in proc.stdout, proc.stdout


def test_ruff_checks_the_three_packages_and_nothing_else():
    files = ruff("check", "--show-files").stdout.splitlines()
    tops = {Path(line.strip()).relative_to(ROOT).parts[0] for line in files if line.strip().endswith(".py")}
    assert tops == {"reviewer", "backend", "reviewer_kernels"}
    assert len([f for f in files if f.strip().endswith(".py")]) == sum(
        1 for p in ("reviewer", "backend", "reviewer_kernels") for _ in (ROOT / p).rglob("*.py"))
