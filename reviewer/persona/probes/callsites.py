"""Where the project's own tests and docs call its public functions with literal arguments: `median([1, 2, 3, 4])`,
`mi.chunked('ABCDEF', 3)`. Those calls say which functions matter and what arguments they take; scaling.py grows the
sized ones, edge_inputs.py swaps in empty, zero, negative and non-ASCII ones. Static (ast) work on the host.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from reviewer.persona.probes.doctext import Block
from reviewer.persona.project import NOT_PACKAGES

MAX_TEST_FILES = 200
MAX_FILE_BYTES = 1_000_000


@dataclass
class Arg:
    source: str  # as written
    kind: str  # seq | str | bytes | range | listrange | iter | int | float | other
    length: int = 0  # of a seq, str, bytes or range: what scaling grows
    inner: str = ""  # the literal inside iter(...) / the bound of range(...)


@dataclass
class CallSite:
    target: str  # dotted path of the function as imported: "tinystats.median", "more_itertools.chunked"
    where: str  # "tests/test_core.py:12" or "README.md:17"
    text: str  # the call as written
    args: list[Arg]
    kwargs: list[tuple[str, Arg]]
    in_docs: bool

    @property
    def name(self) -> str:
        return self.target.rsplit(".", 1)[-1]

    def all_args(self) -> list[tuple[str | None, Arg]]:
        return [(None, a) for a in self.args] + list(self.kwargs)


@dataclass
class Sites:
    calls: dict[str, list[CallSite]] = field(default_factory=dict)  # target -> its call sites, in file order
    expected: dict[str, set[str]] = field(default_factory=dict)  # target -> exception names its tests expect


def classify(node: ast.expr) -> Arg | None:
    """An argument we can rebuild in the sandbox (a literal, range(k), list(range(k)), iter(literal)), else None."""
    src = ast.unparse(node)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords and len(node.args) == 1:
        inner = node.args[0]
        if node.func.id == "range" and isinstance(inner, ast.Constant) and type(inner.value) is int and inner.value >= 0:
            return Arg(src, "range", inner.value, str(inner.value))
        if node.func.id in ("list", "tuple") and isinstance(inner, ast.Call):
            got = classify(inner)
            if got and got.kind == "range" and node.func.id == "list":
                return Arg(src, "listrange", got.length, got.inner)
            return None
        if node.func.id == "iter":
            got = classify(inner)
            if got and got.kind in ("seq", "str"):
                return Arg(src, "iter", got.length, got.source)
            return None
        return None
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if isinstance(value, bool) or value is None:
        return Arg(src, "other")
    if isinstance(value, int):
        return Arg(src, "int")
    if isinstance(value, float):
        return Arg(src, "float")
    if isinstance(value, str):
        return Arg(src, "str", len(value))
    if isinstance(value, bytes):
        return Arg(src, "bytes", len(value))
    if isinstance(value, (list, tuple)):
        return Arg(src, "seq", len(value))
    return Arg(src, "other")  # dicts, sets, complex: passed through unchanged, never grown or emptied


def aliases(tree: ast.AST, package: str) -> dict[str, str]:
    """Local name -> dotted target, for the imports of `package` anywhere in the file."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == package or a.name.startswith(package + "."):
                    names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == package or node.module.startswith(package + "."):
                for a in node.names:
                    if a.name != "*":
                        names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def dotted(func: ast.expr, names: dict[str, str]) -> str | None:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name) or func.id not in names:
        return None
    return ".".join([names[func.id], *reversed(parts)])


def expected_exceptions(fn: ast.AST) -> set[str]:
    """Exception names a test function expects: pytest.raises(X), self.assertRaises(X), assertRaisesRegex(X, ...)."""
    found = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and node.args:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("raises", "assertRaises", "assertRaisesRegex", "assertRaisesRegexp"):
                first = node.args[0]
                for e in (first.elts if isinstance(first, ast.Tuple) else [first]):
                    if isinstance(e, ast.Attribute):
                        found.add(e.attr)
                    elif isinstance(e, ast.Name):
                        found.add(e.id)
    return found


def own_nodes(scope: ast.AST):
    """The nodes of one scope (a module or a function), not those of the functions and classes inside it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def scan(tree: ast.AST, rel: str, package: str, in_docs: bool, sites: Sites, line_offset: int = 0) -> None:
    names = aliases(tree, package)
    if not names:
        return
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and scope.name.startswith("test"):
            expected = expected_exceptions(scope)
            if expected:
                for call in ast.walk(scope):
                    if isinstance(call, ast.Call) and (target := dotted(call.func, names)):
                        sites.expected.setdefault(target, set()).update(expected)
        nodes = list(own_nodes(scope))
        # `txt = "..."; slugify(txt)`: a name bound to a literal earlier in the same scope stands for that literal.
        bound: dict[str, list[tuple[int, ast.expr]]] = {}
        for node in nodes:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                bound.setdefault(node.targets[0].id, []).append((node.lineno, node.value))

        def arg(node: ast.expr, line: int) -> Arg | None:
            if isinstance(node, ast.Name) and node.id in bound:
                earlier = [v for ln, v in bound[node.id] if ln < line]
                return classify(earlier[-1]) if earlier else None
            return classify(node)

        for node in sorted((n for n in nodes if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset)):
            target = dotted(node.func, names)
            if not target or any(p.startswith("_") for p in target.split(".")[1:]):
                continue
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                continue
            args = [arg(a, node.lineno) for a in node.args]
            kwargs = [(k.arg, arg(k.value, node.lineno)) for k in node.keywords]
            if any(a is None for a in args) or any(a is None for _, a in kwargs) or not (args or kwargs):
                continue
            site = CallSite(target, f"{rel}:{node.lineno + line_offset}", ast.unparse(node), args, kwargs, in_docs)
            sites.calls.setdefault(target, []).append(site)


def test_files(root: Path) -> list[Path]:
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p.startswith(".") or p in ("node_modules", "build", "dist", "site-packages") for p in parts):
            continue
        if path.name.startswith("test") or path.name.endswith("_test.py") or any(p in ("tests", "test") for p in parts[:-1]):
            found.append(path)
    return found[:MAX_TEST_FILES]


def doctest_source(text: str) -> str:
    """The code of a doctest block: `>>> ` and `... ` lines, prompts removed; output lines left blank, so that line
    numbers stay those of the doc."""
    lines = []
    for line in text.splitlines():
        m = re.match(r"^\s*(>>>|\.\.\.)( |$)(.*)$", line)
        lines.append(m.group(3) if m else "")
    return "\n".join(lines) + "\n"


def find(root: Path, package: str, doc_blocks: list[Block]) -> Sites:
    sites = Sites()
    for block in doc_blocks:
        if not block.is_python:
            continue
        code = doctest_source(block.text) if block.is_doctest else block.text
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue
        scan(tree, block.file, package, True, sites, line_offset=block.line - 1)
    for path in test_files(root):
        if path.stat().st_size > MAX_FILE_BYTES or path.name in NOT_PACKAGES:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        scan(tree, str(path.relative_to(root)), package, False, sites)
    return sites
