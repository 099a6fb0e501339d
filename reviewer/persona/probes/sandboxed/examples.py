"""The docs' Python examples run as a reader types them, inside the sandbox (the host half, which turns the outcomes
into findings, is reviewer/persona/probes/docs_examples.py and docs_claims.py).

Each doc file's Python blocks run in order in one namespace (`run_examples`): a `>>>` block example by example
(`run_doctest_block`), any other block statement by statement (`run_code_block`). What the earlier examples left
behind travels in one `Examples` object: the namespace, the names that could not be bound, the process state an
example could not set, the values as assigned. What counts as a claim, and what is left to the reader, is
docs/probes.md, section 1.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import doctest
import io
import itertools
import os
import re
import traceback
from dataclasses import dataclass, field

from .doctests import doctest_examples
from .prelude import Overtime, emit, exception_line, limit, resolve

CHECKER = doctest.OutputChecker()
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.IGNORE_EXCEPTION_DETAIL
ALTERNATIVE = "works with its names as assigned: the examples before it are alternatives to it, not steps"
# `# -> 3`, `# returns [1, 2]`, `# 3` after a statement: the value the docs claim for it
CLAIM = re.compile(r"\s*#\s*(?:->|=>|==|=|returns?|gives?|result:|output:)?\s*(.+?)\s*$")
LITERAL_ERRORS = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError)  # what literal_eval raises


@dataclass
class Examples:
    """One doc file's examples as they run, and what the earlier ones left for the later ones."""

    package: str
    only: int | None  # the one line to report (a repro), or None for all
    used_in_file: set  # every name the file's examples use (template_import)
    ns: dict = field(default_factory=lambda: {"__name__": "__main__"})
    outcomes: list = field(default_factory=list)
    # Names an example that could not run (the reader's context was missing) would have bound or changed: what uses
    # them later is not judged, since its result would come from the missing step, not from the project
    # (a skipped `@cached(cache) def fib` leaves `cache` empty; a skipped `ver = Version.parse(...)` leaves no `ver`)
    tainted: set = field(default_factory=set)
    # A call made for its effect on the process that could not run (`locale.setlocale(locale.LC_ALL, 'en_US.UTF-8')`
    # on a machine without that locale): what follows in the file relies on state no name shows, and is not judged
    lost_state: str | None = None
    # Names a `for` loop of an example left bound (dpath's README: `for x in dpath.search(x, ...)` turns the document
    # `x` into the last tuple, and the examples after it "on that same dictionary" give [] and 0): a finding about an
    # example that uses one says so, since that is the docs' mistake a maintainer must see
    loop_bound: dict = field(default_factory=dict)  # name -> (line, the loop's first line)
    bound_before: set = field(default_factory=set)
    # Docs often show alternatives, not steps ("You have a few options": row by row, all rows at once, column by
    # column, each on the same fresh `table`, prettytable's README): run one after the other, the third fails on the
    # rows the first two added. So each assignment keeps a copy of the value it gave, and an example that raises is
    # run once more with the names it uses as they were assigned: if it then does what the docs show, the failure
    # came from the examples before it, and it is not judged. Not for a wrong result: on a fresh object a wrong
    # answer can happen to equal the docs' (a count one too high, before the row that made it right). Only for a name
    # still bound to the object its assignment made (changed in place since): one a later line bound anew (dpath's
    # `for x in ...` over its `x`) is a mistake of the docs, reported.
    assigned: dict = field(default_factory=dict)  # name -> (the object assigned, a copy of it as assigned)


# --- what a piece of code is (ast) ------------------------------------------------------------------------------------

def parsed(code):
    try:
        return ast.parse(code)
    except SyntaxError:
        return None


def names_of(code):
    """Every name the code uses or binds (imports, definitions), the builtins left out."""
    tree = parsed(code)
    found = set()
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return found - set(dir(builtins))


def rebound(code):
    """The names the code binds afresh, an import or a plain assignment, without reading them first: whatever failed
    before, they are new (xmltodict's README uses `xmltodict` and `mydict` in examples that cannot run, then has
    `import xmltodict` and `mydict = {...}` of its own)."""
    tree = parsed(code)
    bound, read = set(), set()
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign):
            bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            read.add(node.target.id)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            read.add(node.id)
    return bound - read


def used_names(code):
    """The names a piece of code uses, its imports left out."""
    tree = parsed(code)
    if tree is None:
        return set()
    imports = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
               for n in ast.walk(node)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in imports}


def sources(block):
    if not block["doctest"]:
        return [block["text"]]
    return [ex.source for ex in doctest_examples(block["text"])]


def no_claim(code):
    """An example that says nothing of the project: a bare literal (output shown behind a stray prompt, tinydb's
    `>>> [{'name': 'John', 'age': 22}]`), or `help(...)` (pydoc's page, whose layout is the Python version's: the docs
    show its first lines, then a blank line, which ends doctest's expected output)."""
    tree = parsed(code)
    if tree is None or len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return False
    value = tree.body[0].value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "help":
        return True
    try:
        ast.literal_eval(value)
        return True
    except LITERAL_ERRORS:
        return False


def unset_environment(code):
    """The variable an example reads with `os.environ.get("X")` / `os.getenv("X")` that is not set here: a value the
    reader supplies (itsdangerous' docs: `SECRET_KEY = os.environ.get("SECRET_KEY")`, then `export SECRET_KEY=...`),
    or None."""
    tree = parsed(code)
    for n in ast.walk(tree) if tree else ():
        if not isinstance(n, ast.Call) or not n.args or not isinstance(n.args[0], ast.Constant):
            continue
        f = n.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        on = f.value if isinstance(f, ast.Attribute) else None
        environ = (isinstance(on, ast.Attribute) and on.attr == "environ") or (
            isinstance(on, ast.Name) and on.id == "environ")
        if (name == "getenv" or (name == "get" and environ)) and isinstance(n.args[0].value, str) \
                and n.args[0].value not in os.environ:
            return n.args[0].value
    return None


# --- what the namespace says about it ---------------------------------------------------------------------------------

def project_names(namespace, package):
    return [k for k, v in namespace.items() if not k.startswith("__") and
            (getattr(v, "__module__", None) or getattr(v, "__name__", "") or "").split(".")[0] == package]


def sets_state(run, code):
    """A single call of a module's function (`locale.setlocale(...)`): made for its effect on the process."""
    tree = parsed(code)
    if tree is None:
        return False
    body = tree.body
    if len(body) != 1 or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Call):
        return False
    func = body[0].value.func
    if not isinstance(func, ast.Attribute):
        return False
    while isinstance(func, ast.Attribute):
        func = func.value
    return isinstance(func, ast.Name) and isinstance(run.ns.get(func.id), type(os))


def sketches_project(run, code):
    """A class or function the docs define under a name the project's own object holds: a sketch of its code
    ("Dropping the details, ``Use`` is basically: class Use: ..." in schema's README), not code for the reader to
    run; run, it would replace the real `Use` for every later example."""
    tree = parsed(code)
    if tree is None:
        return False
    defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    mine = set(project_names(run.ns, run.package))
    return bool(tree.body) and all(isinstance(n, defs) and n.name in mine for n in tree.body)


def assumes_module(run, block):
    """The package's module, when the block reads `pkg.X` that the module has and that the object an earlier example
    bound to the package's name lacks (schema's README binds `schema = Schema(...)`, then a later block subclasses
    `schema.Schema`, written as after `import schema`); else None."""
    package = run.package
    current = run.ns.get(package)
    if current is None or isinstance(current, type(os)):
        return None
    attrs = set()
    for src in sources(block):
        tree = parsed(src)
        attrs |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                  and n.value.id == package} if tree else set()
    try:
        module = resolve(package)
    except Exception:  # noqa: BLE001 - no module to assume
        return None
    if attrs and all(hasattr(module, a) for a in attrs) and not all(hasattr(current, a) for a in attrs):
        return module
    return None


def template_import(run, error):
    """An import of a name the project lacks and the docs never use: the reader's placeholder, not an API."""
    m = re.search(r"cannot import name '(\w+)'", str(error)) if isinstance(error, ImportError) else None
    return bool(m) and m.group(1) not in run.used_in_file


def skip_reason(run, code):
    """Why the example is not run (a variable the reader sets, an earlier example that could not run), or None."""
    unset = unset_environment(code)
    if unset:
        return f"reads ${unset}, which the reader sets"
    if (names_of(code) - rebound(code)) & run.tainted or run.lost_state is not None:
        return run.lost_state or "depends on an example that could not run"
    return None


def project_error(run, error, code):
    """An exception that is the project's failure, not the reader's missing context or the docs' placeholder."""
    return from_project(error, project_names(run.ns, run.package), run.package, code) and not template_import(
        run, error)


def from_project(error, namespace_names, package, code):
    """Did the project fail (not the reader's missing context)? Its own frames in the traceback, or a bad call or
    import of one of its names right in the example."""
    if isinstance(error, (NameError, OSError, EOFError, Overtime)) and not isinstance(error, UnboundLocalError):
        return False  # an undefined name, a file or the network the reader must supply
    if isinstance(error, ImportError):
        return (error.name or "").split(".")[0] == package or f"from '{package}" in str(error)
    try:
        home = os.path.realpath(resolve(package).__file__)
    except Exception:  # noqa: BLE001
        home = None
    # A package's code is its folder; a single-module project's (xmltodict.py at the top) is that file alone: its
    # folder is the repository root, where the doc examples themselves run ("README.md" as their file name)
    package_dir = os.path.basename(home or "").startswith("__init__.")
    for frame in traceback.extract_tb(error.__traceback__):
        where = os.path.realpath(frame.filename)
        if home and (where.startswith(os.path.dirname(home) + os.sep) if package_dir else where == home):
            return True
    return isinstance(error, (TypeError, AttributeError)) and any(re.search(rf"\b{n}\b", code) for n in namespace_names)


# --- what an example left behind ----------------------------------------------------------------------------------------

def record(run, block, line, code, kind, **kw):
    """One outcome; a skipped example taints the names it would have bound, and may have lost the process's state."""
    if kind in ("mismatch", "error"):
        kw["loop_bound"] = {n: run.loop_bound[n] for n in sorted(names_of(code) & run.loop_bound.keys())}
    if kind == "skipped":
        run.tainted.update(names_of(code))
        if run.lost_state is None and sets_state(run, code):
            run.lost_state = f"follows `{code.strip()}`, which could not run here"
    if run.only is None or line == run.only:
        run.outcomes.append(dict(file=block["file"], line=line, code=code.strip(), kind=kind, **kw))


def skip_rest(run, block, statements):
    """The rest of a block after a statement that failed: it builds on that statement and does not run."""
    for stmt in statements:
        run.tainted.update(names_of(ast.get_source_segment(block["text"], stmt) or ""))


def ran(run, line, code):
    """An example that ran: the names it bound are good again, its loops and assignments are noted."""
    run.tainted.difference_update(rebound(code))
    note_loops(run, line, code)
    keep_assigned(run, code)


def note_loops(run, line, code):
    tree = parsed(code)
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, (ast.For, ast.AsyncFor)):
            for target in ast.walk(node.target):
                if isinstance(target, ast.Name) and target.id in run.bound_before:  # a loop over a document name
                    run.loop_bound[target.id] = (line, code.strip().splitlines()[0])
    for name in rebound(code):
        run.loop_bound.pop(name, None)
        run.bound_before.add(name)


def copied(value):
    """A deep copy within a second, or None: a value that cannot be copied (a file, a lock) or is too big to copy
    quickly (a loaded dataset) is not retried."""
    try:
        with limit(1):
            return copy.deepcopy(value)
    except (Exception, Overtime):  # noqa: BLE001
        return None


def keep_assigned(run, code):
    for name in rebound(code):
        kept = copied(run.ns[name]) if name in run.ns else None
        if kept is None:
            run.assigned.pop(name, None)
        else:
            run.assigned[name] = (run.ns[name], kept)


def as_assigned(run, code):
    """The namespace with the names the code uses as they were assigned (fresh copies), or None."""
    used = {n for n in names_of(code) & run.assigned.keys() if run.ns.get(n) is run.assigned[n][0]}
    fresh = {n: copied(run.assigned[n][1]) for n in used}
    return {**run.ns, **fresh} if used and None not in fresh.values() else None


def passes_as_assigned(run, code, source, filename, mode, check):
    """Does the example (`code`: its text; `source`: what to compile) do what the docs show when the names it uses are
    as they were assigned? check(printed, value)."""
    fresh = as_assigned(run, code)
    if fresh is None:
        return False
    got, value, error = attempt(run, source, filename, mode, fresh)
    return error is None and check(got, value)


# --- running and comparing --------------------------------------------------------------------------------------------

def attempt(run, code, filename, mode, namespace=None):
    """(printed output, value for mode 'eval', exception or None)."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), limit(20):
            value = eval(compile(code, filename, mode), run.ns if namespace is None else namespace)
        return buf.getvalue(), value, None
    except BaseException as e:  # noqa: BLE001 - whatever the example raises is judged below
        if isinstance(e, KeyboardInterrupt):
            raise
        return buf.getvalue(), None, e


def same_value(got, want):
    """Equal as a reader means it: floats to the digits shown, lists and tuples alike."""
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        shown = repr(want).split("e")[0]
        digits = len(shown.split(".")[1]) if "." in shown else 0
        return abs(got - want) <= 0.5 * 10 ** -digits + 1e-12 * abs(want)
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        return len(got) == len(want) and all(same_value(g, w) for g, w in zip(got, want))
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(same_value(got[k], want[k]) for k in want)
    try:
        return bool(got == want)
    except Exception:  # noqa: BLE001 - an object that cannot compare is not equal
        return False


def shows(printed, want):
    """Doctest's comparison, or equal Python literals (a set in another order)."""
    if CHECKER.check_output(want, printed, FLAGS):
        return True
    try:
        return same_value(ast.literal_eval(printed.strip()), ast.literal_eval(want.strip()))
    except LITERAL_ERRORS:
        return False


def expected_output(ex, block):
    """What the docs show after a `>>>` example, as a reader reads it: comment lines are not output (tomlkit's
    `>>> doc.pop("table2")` then `# del doc["table2"] is also possible`), and a triple-quoted value goes on past a
    blank line, which ends doctest's expected output (tomlkit's `>>> dumps(doc)`, shown as a triple-quoted string with
    a blank line between its tables)."""
    want = ex.want
    if want and all(line.lstrip().startswith("#") for line in want.splitlines()):
        return ""
    quote = want.lstrip()[:3]
    if quote in ('"""', "'''") and want.count(quote) == 1:
        lines = block["text"].splitlines()
        after = ex.lineno + ex.source.count("\n") + want.count("\n")
        for k in range(after, len(lines)):
            rest = lines[k][ex.indent:] if lines[k][:ex.indent].strip() == "" else lines[k].strip()
            want += rest + "\n"
            if quote in rest:
                break
        else:
            return ex.want  # never closed: what doctest saw
    return want


# --- doctest blocks: example by example -------------------------------------------------------------------------------

def run_doctest_block(run, block):
    for ex in doctest_examples(block["text"]):
        line = block["line"] + ex.lineno
        if ex.options.get(doctest.SKIP) or (run.only is not None and line > run.only):
            continue
        if sketches_project(run, ex.source) or no_claim(ex.source):
            continue
        reason = skip_reason(run, ex.source)
        if reason:
            record(run, block, line, ex.source, "skipped", error=reason)
            continue
        got, _, error = attempt(run, ex.source, block["file"], "single")
        if error is None:
            ran(run, line, ex.source)
        judge_doctest(run, block, line, ex, got, error)


def judge_doctest(run, block, line, ex, got, error):
    """The outcome of one `>>>` example: its output (or exception) against what the docs show."""
    want = expected_output(ex, block)
    if error is None and ex.exc_msg is None:
        if got.strip() and not want.strip():
            return  # the docs show no output (the echo of a call made for its effect): no claim
        ok = shows(got, want)
        record(run, block, line, ex.source, "ok" if ok else "mismatch", want=want.strip(), got=got.strip())
    elif error is not None and ex.exc_msg is not None:
        shown = "".join(traceback.format_exception_only(type(error), error))
        named = ex.exc_msg.split(":")[0].strip().rsplit(".", 1)[-1]  # the type is what must agree
        ok = CHECKER.check_output(ex.exc_msg, shown, FLAGS) or named == type(error).__name__
        if not ok and not from_project(error, project_names(run.ns, run.package), run.package, ex.source):
            # another exception than the docs show, and not the project's: the reader's context
            record(run, block, line, ex.source, "skipped", error=exception_line(error))
            return
        record(run, block, line, ex.source, "ok" if ok else "mismatch", want=ex.exc_msg.strip(), got=shown.strip())
    elif error is None:
        record(run, block, line, ex.source, "mismatch", want=ex.exc_msg.strip(), got=got.strip() or "(nothing)")
    elif project_error(run, error, ex.source):
        if passes_as_assigned(run, ex.source, ex.source, block["file"], "single",
                              lambda printed, _: not want.strip() or shows(printed, want)):
            record(run, block, line, ex.source, "skipped", error=ALTERNATIVE)
            return
        record(run, block, line, ex.source, "error", error=exception_line(error))
    else:
        record(run, block, line, ex.source, "skipped", error=exception_line(error))


# --- other blocks: statement by statement -----------------------------------------------------------------------------

def run_code_block(run, block):
    tree = parsed(block["text"])
    if tree is None:
        return  # pseudo-code, or output shown as code
    if any(isinstance(n, ast.Constant) and n.value is Ellipsis for n in ast.walk(tree)):
        return  # `f(...)`: a placeholder for the reader
    for n, stmt in enumerate(tree.body):
        line = block["line"] + stmt.lineno - 1
        if run.only is not None and line > run.only:
            break
        if not run_statement(run, block, line, stmt):
            skip_rest(run, block, tree.body[n + 1:])
            break


def claimed_value(block, stmt):
    """(the claim's text, (the value it claims,)) of a statement followed by `# value`, or (None, None)."""
    rest = block["text"].splitlines()[stmt.end_lineno - 1][stmt.end_col_offset:]
    claim = CLAIM.match(rest)
    if not claim or not isinstance(stmt, (ast.Expr, ast.Assign)):
        return None, None
    if isinstance(stmt, ast.Assign) and not (len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None, None
    try:
        return claim.group(1), (ast.literal_eval(claim.group(1)),)
    except LITERAL_ERRORS:
        return None, None


def run_statement(run, block, line, stmt):
    """Run one statement and judge its claim, if it makes one; False when the rest of the block cannot run."""
    code = ast.get_source_segment(block["text"], stmt) or ""
    if sketches_project(run, code) or no_claim(code):
        return True
    reason = skip_reason(run, code)
    if reason:
        record(run, block, line, code, "skipped", error=reason)
        return False
    claim, want = claimed_value(block, stmt)
    module = ast.Module([stmt], type_ignores=[])
    if want is not None and isinstance(stmt, ast.Expr):
        _, value, error = attempt(run, ast.Expression(stmt.value), block["file"], "eval")
    else:
        _, _, error = attempt(run, module, block["file"], "exec")
        value = run.ns.get(stmt.targets[0].id) if want is not None else None
    if error is not None:
        kind = "error" if project_error(run, error, code) else "skipped"
        if kind == "error" and passes_as_assigned(run, code, module, block["file"], "exec", lambda *_: True):
            kind, error = "skipped", ALTERNATIVE
        record(run, block, line, code, kind, error=error if isinstance(error, str) else exception_line(error))
        return False
    ran(run, line, code)
    if want is not None:
        if hasattr(value, "__next__") and isinstance(want[0], (list, tuple)):
            value = list(itertools.islice(value, 10000))
        ok = same_value(value, want[0])
        record(run, block, line, code, "ok" if ok else "mismatch", want=claim, got=repr(value)[:2000])
    return True


# --- a doc file -------------------------------------------------------------------------------------------------------

def run_examples(blocks, package, only=None):
    """Run the doc file's Python blocks in order, in one namespace; the outcome of each claim or failing example."""
    # Every name the file's examples use: `from funcy import whatever, you, need` ("import stuff from funcy") names
    # nothing the docs go on to use; a renamed function the docs import is one they then call
    used = set().union(*(used_names(src) for b in blocks if not b.get("setup") for src in sources(b)))
    run = Examples(package=package, only=only, used_in_file=used)
    for block in blocks:  # Sphinx testsetup code first, as Sphinx runs it before the doctests; never judged
        if block.get("setup"):
            attempt(run, block["text"], block["file"], "exec")
    for block in blocks:
        if block.get("setup"):
            continue
        if only is not None and block["line"] > only:
            break
        before = dict(run.ns)
        module = assumes_module(run, block)
        if module is not None:
            run.ns[package] = module
        (run_doctest_block if block["doctest"] else run_code_block)(run, block)
        # `import pkg` in one snippet (to set an option) must not turn `from pkg import pkg` of the others into the
        # module: a snippet's rebinding of a name to a module stays in that snippet (so does an assumed module).
        for name, old in before.items():
            new = run.ns.get(name)
            if new is not old and isinstance(new, type(os)) and not isinstance(old, type(os)):
                run.ns[name] = old
    return run.outcomes


def check_examples(blocks, package, only=None):
    """The check script's entry: the outcomes that are not "ok" (the host's findings), exit 1 when one is a failure."""
    outcomes = run_examples(blocks, package, only)
    bad = [o for o in outcomes if o["kind"] in ("mismatch", "error")]
    emit({"outcomes": [o for o in outcomes if o["kind"] != "ok"][:200], "checked": len(outcomes)})
    return 1 if bad else 0
