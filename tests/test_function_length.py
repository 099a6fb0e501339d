"""No function over 80 lines in reviewer/, backend/ and reviewer_kernels/ (issue 44): a longer one is split into named
steps. bench/ scripts and tests/ are not held to it. Read from the source with ast, as tests/import_graph.py reads
imports: a function counts from its `def` line to its last line, docstring and comments included, decorators not; a
nested function counts in itself and in the function around it.

    python -m tests.test_function_length    # lists every function over the limit
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reviewer", "backend", "reviewer_kernels")
MAX_LINES = 80

@dataclass(frozen=True)
class LongFunction:
    path: str  # relative to the repository root
    name: str  # qualified: Class.method, outer.inner
    line: int
    lines: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.name} ({self.lines} lines)"


def long_functions(source: str, path: str, max_lines: int = MAX_LINES) -> list[LongFunction]:
    """The functions of one module longer than max_lines, in source order."""
    found: list[LongFunction] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef) and child.end_lineno - child.lineno + 1 > max_lines:
                    found.append(LongFunction(path, name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            else:
                visit(child, prefix)  # functions under `if`, `try`, `with` (a Triton kernel under `if triton`)

    visit(ast.parse(source, filename=path), "")
    return found


def package_long_functions(root: Path = ROOT) -> list[LongFunction]:
    return [f for package in PACKAGES for path in sorted((root / package).rglob("*.py"))
            for f in long_functions(path.read_text(), path.relative_to(root).as_posix())]


def test_no_function_is_over_80_lines():
    over = [str(f) for f in package_long_functions()]
    assert over == [], "split these into named steps (issue 44):\n" + "\n".join(over)


def _function(name: str, lines: int, indent: str = "") -> str:
    """A decorated function `lines` long from its def line to its return."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 2))
    return f"{indent}@decorator\n{indent}def {name}():\n{body}{indent}    return 0\n"


def test_the_check_counts_def_to_last_line_and_finds_methods_nested_and_guarded_functions():
    source = (_function("at_the_limit", 80) + _function("over", 81) + "class C:\n" + _function("method", 90, "    ")
              + "if flag:\n" + _function("guarded", 85, "    ")
              + "def outer():\n" + _function("inner", 82, "    ") + "    return inner\n")
    found = long_functions(source, "m.py")
    assert [(f.name, f.lines) for f in found] == [("over", 81), ("C.method", 90), ("guarded", 85),
                                                  ("outer", 85), ("outer.inner", 82)]
    assert str(found[0]) == "m.py:83 over (81 lines)"  # at_the_limit: lines 1-81 (decorator, def .. return)


if __name__ == "__main__":
    found = package_long_functions()
    print("\n".join(map(str, found)))
    sys.exit(1 if found else 0)
