"""The import graph of one package, and its circles: `python -m tests.import_graph reviewer` (exit 1 on a circle).

Every import statement counts, at module level and inside functions alike: an import moved into a function hides a
circle from Python's start-up but not from the reader, so this checker reads the source (ast) instead of importing
it. `--lazy` also lists the function-level imports, for a look at which of them still have a reason (a heavy
dependency kept out of start-up) and which only hid a circle. Imports under `if TYPE_CHECKING:` count too, unless
`--skip-type-checking` (they never run, but the two modules still know each other).

An import names a module of the package when it is `import pkg.a.b`, `from pkg.a import b` (b a module or a name in
pkg.a) or the relative forms of these; importing `pkg.a.b` also runs `pkg/__init__.py` and `pkg/a/__init__.py`, so
those count as edges too.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module of the package
    line: int
    lazy: bool  # inside a function


def package_modules(package: str, root: Path | None = None) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of the package (found without importing it)."""
    if root is None:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"{package} is not a package that can be found from here")
        root = Path(list(spec.submodule_search_locations)[0])
    modules = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = [package, *rel.parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _with_parents(name: str, modules: dict[str, Path]) -> list[str]:
    """`a.b.c` -> the modules Python runs to import it: a, a.b, a.b.c (those that are part of the package)."""
    parts = name.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in modules]


def is_type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): imports that only annotations see, never run."""
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, modules: dict[str, Path], *, type_checking: bool = True) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if not type_checking and is_type_checking(child):
                for orelse in child.orelse:  # the `else:` of `if TYPE_CHECKING:` does run
                    visit(ast.Module(body=[orelse], type_ignores=[]), lazy)
                continue
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    for target in _with_parents(alias.name, modules):
                        found.append(Import(module, target, child.lineno, lazy))
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: from the module's own package upward
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    name = ".".join(base + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                targets = _with_parents(name, modules)
                for alias in child.names:
                    sub = f"{name}.{alias.name}"
                    if sub in modules:  # `from pkg import module`
                        targets.append(sub)
                for target in dict.fromkeys(targets):
                    found.append(Import(module, target, child.lineno, lazy))
            visit(child, inner)

    visit(tree, False)
    # A package's own __init__ is run before any of its modules: an edge to it from inside is no circle of note.
    return [i for i in found if i.target != module and not module.startswith(i.target + ".")]


def all_imports(module: str, path: Path) -> list[tuple[str, int]]:
    """Every module the file imports, inside the package or not, as (absolute dotted name, line): relative imports
    resolved against `module`, `from a import b` as `a` (and as `a.b`, which may be a module). For a rule about
    what a part may import from outside (a stdlib-only part), where import_graph sees only the package's own."""
    tree = ast.parse(path.read_text(), filename=str(path))
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            up = base[: len(base) - (node.level - 1)] if node.level else []
            name = ".".join(up + ([node.module] if node.module else []))
            found.append((name, node.lineno))
            found += [(f"{name}.{alias.name}", node.lineno) for alias in node.names if alias.name != "*"]
    return found


def import_graph(package: str, root: Path | None = None, *, type_checking: bool = True) -> list[Import]:
    """Every import between the package's modules. `type_checking=False` leaves out those under `if TYPE_CHECKING:`
    (annotations only: no circle at run time, though the two modules still know each other)."""
    modules = package_modules(package, root)
    return [imp for module, path in modules.items()
            for imp in imports_of(module, path, modules, type_checking=type_checking)]


def circles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted: every import circle."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        # Iterative, so a deep graph cannot reach the recursion limit.
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(found)


def describe(circle: list[str], edges: list[Import]) -> str:
    members = set(circle)
    lines = [f"import circle: {' <-> '.join(circle)}"]
    for e in sorted(edges, key=lambda e: (e.source, e.line)):
        if e.source in members and e.target in members:
            lines.append(f"  {e.source}:{e.line} imports {e.target}" + (" (inside a function)" if e.lazy else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.import_graph", description=__doc__.splitlines()[0])
    parser.add_argument("package", help="the package to walk, e.g. reviewer")
    parser.add_argument("--lazy", action="store_true", help="also list the imports made inside functions")
    parser.add_argument("--skip-type-checking", action="store_true",
                        help="leave out imports under `if TYPE_CHECKING:` (they never run)")
    args = parser.parse_args(argv)
    edges = import_graph(args.package, type_checking=not args.skip_type_checking)
    modules = {e.source for e in edges} | set(package_modules(args.package))
    found = circles(edges)
    for circle in found:
        print(describe(circle, edges))
    if args.lazy:
        lazy = [e for e in edges if e.lazy]
        for e in sorted(lazy, key=lambda e: (e.source, e.line)):
            # `from pkg.a import b` also runs pkg/__init__.py; name only the module the line is for.
            if not any(o.source == e.source and o.line == e.line and o.target.startswith(e.target + ".") for o in lazy):
                print(f"lazy: {e.source}:{e.line} imports {e.target}")
    statements = {(e.source, e.line) for e in edges}
    lazy_statements = {(e.source, e.line) for e in edges if e.lazy}
    print(f"{args.package}: {len(modules)} modules, {len(statements)} import statements within the package "
          f"({len(lazy_statements)} inside functions), {len(found)} circle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
