"""The reviewer's import graph (tests/import_graph.py): no circle, the folders import each other only downward (the
data flow of reviewer/README.md), and imports inside functions only where they keep heavy modules out of start-up."""

import subprocess
import sys
from pathlib import Path

from tests.import_graph import Import, all_imports, circles, import_graph, package_modules

ROOT = Path(__file__).resolve().parents[2]

# Folder -> the folders (and top-level modules) of reviewer it may import; reviewer/README.md draws the same picture.
MAY_IMPORT = {
    "cli": {"config", "run", "report", "persona", "sandbox"},
    "run": {"persona", "llm", "sandbox", "store", "report", "text", "liveness"},
    "report": {"store", "sandbox", "stats", "text"},  # never run: a read command does not write through the run layer
    "persona": {"llm", "sandbox", "store", "stats", "text"},
    "llm": {"text"},
    "sandbox": {"liveness"},
    "store": {"liveness"},
    "config": set(), "stats": set(), "text": set(), "examples": set(), "liveness": set(),
}
# Imports inside functions that keep something heavy out of start-up, each for its reason (the cli's docstring).
LAZY_OK = {("reviewer.cli", "reviewer.run.review"), ("reviewer.cli", "reviewer.run.loop"),
           ("reviewer.cli", "reviewer.report.report"), ("reviewer.cli", "reviewer.persona.files"),
           ("reviewer.cli", "reviewer.sandbox.doctor"), ("reviewer.cli", "reviewer.run.inputs")}


def part(module: str) -> str:
    """reviewer.run.review -> run; reviewer.cli -> cli."""
    return module.split(".")[1] if "." in module else module


def test_the_reviewer_has_no_import_circle():
    assert circles(import_graph("reviewer")) == []


def test_the_command_line_check_passes():
    proc = subprocess.run([sys.executable, "-m", "tests.import_graph", "reviewer"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 circle(s)" in proc.stdout


def upward_imports(edges: list[Import]) -> list[str]:
    """The imports that go against MAY_IMPORT, and those of a part MAY_IMPORT does not know (a new folder or module
    gets its line there)."""
    wrong = []
    for e in edges:
        source, target = part(e.source), part(e.target)
        if source == target or e.target == "reviewer":
            continue
        if source not in MAY_IMPORT:
            wrong.append(f"{e.source} is in no line of MAY_IMPORT")
        elif target not in MAY_IMPORT[source]:
            wrong.append(f"{e.source}:{e.line} imports {e.target}")
    return wrong


def test_folders_import_only_downward():
    assert upward_imports(import_graph("reviewer")) == []


def test_report_importing_run_is_caught(tmp_path):
    """The arrow this rule took out (report -> run.recovery, issue 44), put back in a copy of the package's shape, in
    every form an import can take: the check names each one."""
    pkg = tmp_path / "reviewer"
    for folder in ("run", "report", "store"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "run" / "recovery.py").write_text("def recover(): pass\n")
    (pkg / "store" / "deadruns.py").write_text("")
    (pkg / "report" / "report.py").write_text("from reviewer.store import deadruns\n"
                                              "from reviewer.run.recovery import recover\n")
    (pkg / "report" / "late.py").write_text("def f():\n    from ..run import recovery\n    return recovery\n")
    (pkg / "report" / "plain.py").write_text("import reviewer.run\n")
    wrong = upward_imports(import_graph("reviewer", root=pkg))
    assert wrong == ["reviewer.report.late:2 imports reviewer.run",
                     "reviewer.report.late:2 imports reviewer.run.recovery",
                     "reviewer.report.plain:1 imports reviewer.run",
                     "reviewer.report.report:2 imports reviewer.run",
                     "reviewer.report.report:2 imports reviewer.run.recovery"]


def test_a_part_without_a_rule_is_caught(tmp_path):
    pkg = tmp_path / "reviewer"
    (pkg / "newpart").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "newpart" / "__init__.py"):
        init.write_text("")
    (pkg / "text.py").write_text("")
    (pkg / "newpart" / "a.py").write_text("from reviewer import text\n")
    assert upward_imports(import_graph("reviewer", root=pkg)) == ["reviewer.newpart.a is in no line of MAY_IMPORT"]


# Runs inside the sandbox with the project's own Python, where reviewer is not installed: the standard library and its
# own package only (reviewer/persona/probes/sandboxed/__init__.py).
SANDBOXED = "reviewer.persona.probes.sandboxed"


def sandbox_side_imports(modules: dict[str, Path]) -> list[str]:
    """The imports of the sandboxed package's modules that are neither the standard library nor that package (a
    `from . import x` that climbs out of it counts as what it reaches)."""
    wrong = []
    for module, path in sorted(modules.items()):
        if module != SANDBOXED and not module.startswith(SANDBOXED + "."):
            continue
        for name, line in all_imports(module, path):
            top = name.split(".")[0]
            inside = name == SANDBOXED or name.startswith(SANDBOXED + ".")
            # `from .prelude import emit` also gives `...sandboxed.prelude.emit`: a name, inside all the same
            if not inside and (top == "reviewer" or top not in sys.stdlib_module_names):
                wrong.append(f"{module}:{line} imports {name}")
    return list(dict.fromkeys(wrong))


def test_the_sandboxed_probe_modules_import_only_the_standard_library_and_each_other():
    modules = package_modules("reviewer")
    assert sum(m.startswith(SANDBOXED + ".") for m in modules) >= 5  # the rule has something to check
    assert sandbox_side_imports(modules) == []


def test_a_sandboxed_module_importing_reviewer_or_a_third_party_module_is_caught(tmp_path):
    pkg = tmp_path / "reviewer"
    side = pkg / "persona" / "probes" / "sandboxed"
    side.mkdir(parents=True)
    for init in (pkg, pkg / "persona", pkg / "persona" / "probes", side):
        (init / "__init__.py").write_text("")
    (pkg / "text.py").write_text("")
    (pkg / "persona" / "probes" / "runner.py").write_text("")
    (side / "prelude.py").write_text("import json, os\nfrom collections.abc import Mapping\n")
    (side / "check.py").write_text("from __future__ import annotations\nimport re\nfrom .prelude import emit\n"
                                   "from reviewer import text\nfrom .. import runner\n"
                                   "def f():\n    import requests\n    return requests\n")
    assert sandbox_side_imports(package_modules("reviewer", pkg)) == [
        "reviewer.persona.probes.sandboxed.check:4 imports reviewer",
        "reviewer.persona.probes.sandboxed.check:4 imports reviewer.text",
        "reviewer.persona.probes.sandboxed.check:5 imports reviewer.persona.probes",
        "reviewer.persona.probes.sandboxed.check:5 imports reviewer.persona.probes.runner",
        "reviewer.persona.probes.sandboxed.check:7 imports requests"]


def test_imports_inside_functions_only_keep_heavy_modules_out():
    lazy = {(e.source, e.target) for e in import_graph("reviewer") if e.lazy and e.target.count(".") >= 2}
    assert lazy <= LAZY_OK, sorted(lazy - LAZY_OK)


def test_a_circle_hidden_inside_a_function_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    edges = import_graph("pkg", root=pkg)
    assert circles(edges) == [["pkg.a", "pkg.sub.b"]]
    assert [(e.target, e.lazy) for e in edges if e.source == "pkg.sub.b"] == [("pkg.a", True)]
    assert [(e.source, e.target) for e in edges if e.source == "pkg.c"] == [("pkg.c", "pkg.a")]


def test_type_checking_imports_count_unless_left_out(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
                              "else:\n    import pkg.c\n")
    (pkg / "c.py").write_text("")
    assert circles(import_graph("pkg", root=pkg)) == [["pkg.a", "pkg.b"]]
    edges = import_graph("pkg", root=pkg, type_checking=False)
    assert circles(edges) == [] and ("pkg.b", "pkg.c") in {(e.source, e.target) for e in edges}
