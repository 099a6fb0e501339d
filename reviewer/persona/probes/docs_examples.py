"""The docs' Python examples run as a reader types them (docs_claims.py turns the outcomes into findings).

Each doc file's Python blocks run in order in one namespace, twice (two hash seeds) in the sandbox: `run_examples` and
its helpers are copied into the check script (runner.script), so they import nothing of ours and read their
collaborators (`emit`, `resolve`, `limit`, ...) from reviewer/persona/probes/prelude.py. What counts as a claim, and
what is left to the reader, is docs/probes.md, section 1.
"""

from __future__ import annotations

from reviewer.persona.probes import prelude
from reviewer.persona.probes.runner import data, script


# --- runs inside the sandbox (copied into the check script) ---------------------------------------------------------

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


def from_project(error, namespace_names, package, code):
    """Did the project fail (not the reader's missing context)? Its own frames in the traceback, or a bad call or
    import of one of its names right in the example."""
    import traceback as tb

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
    for frame in tb.extract_tb(error.__traceback__):
        where = os.path.realpath(frame.filename)
        if home and (where.startswith(os.path.dirname(home) + os.sep) if package_dir else where == home):
            return True
    return isinstance(error, (TypeError, AttributeError)) and any(re.search(rf"\b{n}\b", code) for n in namespace_names)


def doctest_examples(text):
    """doctest's examples of a block, never its ValueError: a block doctest cannot parse (`>>>x` without the blank,
    prompts indented unevenly: a real `.rst` crashed the whole file's script, and only a note was left) is parsed
    paragraph by paragraph, a paragraph that still fails with its prompts mended, one that fails even then left out."""
    import doctest
    import re

    def parse(lines):
        try:
            return doctest.DocTestParser().get_examples("\n".join(lines) + "\n")
        except ValueError:
            return None

    def mend(lines):
        """`>>>x` -> `>>> x`, `...x` after a prompt -> `... x`, every line at one indentation."""
        out, prompt = [], False
        for ln in (ln.strip() for ln in lines):
            m = re.match(r"^(>>>|\.\.\.)(?=\S)", ln)
            if m and (m.group(1) == ">>>" or prompt):
                ln = ln[:3] + " " + ln[3:]
            prompt = bool(re.match(r"^(>>>|\.\.\.)( |$)", ln))
            out.append(ln)
        return out

    whole = parse([text])
    if whole is not None:
        return whole
    lines, chunks, current, first = text.split("\n"), [], [], 0
    for k, line in enumerate(lines):
        if line.strip():
            first = k if not current else first
            current.append(line)
        elif current:
            chunks.append((first, current))
            current = []
    chunks += [(first, current)] if current else []
    found = []
    for first, chunk in chunks:
        if any(">>>" in ln for ln in chunk):
            for ex in parse(chunk) or parse(mend(chunk)) or []:
                ex.lineno += first
                found.append(ex)
    return found


def project_names(namespace, package):
    return [k for k, v in namespace.items() if not k.startswith("__") and
            (getattr(v, "__module__", None) or getattr(v, "__name__", "") or "").split(".")[0] == package]


def run_examples(blocks, package, only=None):
    """Run the doc file's Python blocks in order, in one namespace; the outcome of each claim or failing example."""
    import ast
    import copy
    import doctest
    import io

    import builtins

    ns = {"__name__": "__main__"}
    outcomes = []
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.IGNORE_EXCEPTION_DETAIL
    # Names an example that could not run (the reader's context was missing) would have bound or changed: what uses
    # them later is not judged, since its result would come from the missing step, not from the project
    # (a skipped `@cached(cache) def fib` leaves `cache` empty; a skipped `ver = Version.parse(...)` leaves no `ver`)
    tainted = set()

    def names_of(code):
        try:
            tree = ast.parse(code)
        except SyntaxError:
            return set()
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                found.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                found |= {(a.asname or a.name).split(".")[0] for a in node.names}
        return found - set(dir(builtins))

    def rebound(code):
        """The names the code binds afresh, an import or a plain assignment, without reading them first: whatever
        failed before, they are new (xmltodict's README uses `xmltodict` and `mydict` in examples that cannot run,
        then has `import xmltodict` and `mydict = {...}` of its own)."""
        try:
            tree = ast.parse(code)
        except SyntaxError:
            return set()
        bound, read = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.Assign):
                bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                read.add(node.target.id)
            elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
                read.add(node.id)
        return bound - read

    def depends_on_skipped(code):  # (recording it as skipped taints its names in turn)
        return bool((names_of(code) - rebound(code)) & tainted) or lost_state[0] is not None

    def sources(block):
        if not block["doctest"]:
            return [block["text"]]
        return [ex.source for ex in doctest_examples(block["text"])]

    def used_names(code):
        """The names a piece of code uses, its imports left out."""
        try:
            tree = ast.parse(code)
        except SyntaxError:
            return set()
        imports = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for n in ast.walk(node)}
        return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in imports}

    # Every name the file's examples use: `from funcy import whatever, you, need` ("import stuff from funcy") names
    # nothing the docs go on to use; a renamed function the docs import is one they then call
    used_in_file = set().union(*(used_names(src) for b in blocks if not b.get("setup") for src in sources(b)))

    def template_import(error):
        """An import of a name the project lacks and the docs never use: the reader's placeholder, not an API."""
        m = re.search(r"cannot import name '(\w+)'", str(error)) if isinstance(error, ImportError) else None
        return bool(m) and m.group(1) not in used_in_file

    # A call made for its effect on the process that could not run (`locale.setlocale(locale.LC_ALL, 'en_US.UTF-8')`
    # on a machine without that locale): what follows in the file relies on state no name shows, and is not judged
    lost_state = [None]

    def sets_state(code):
        try:
            tree = ast.parse(code)
        except SyntaxError:
            return False
        body = tree.body
        if len(body) != 1 or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Call):
            return False
        func = tree.body[0].value.func
        if not isinstance(func, ast.Attribute):
            return False
        while isinstance(func, ast.Attribute):
            func = func.value
        return isinstance(func, ast.Name) and isinstance(ns.get(func.id), type(os))

    def sketches_project(code):
        """A class or function the docs define under a name the project's own object holds: a sketch of its code
        ("Dropping the details, ``Use`` is basically: class Use: ..." in schema's README), not code for the reader
        to run; run, it would replace the real `Use` for every later example."""
        try:
            tree = ast.parse(code)
        except SyntaxError:
            return False
        defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        mine = set(project_names(ns, package))
        return bool(tree.body) and all(isinstance(n, defs) and n.name in mine for n in tree.body)

    def no_claim(code):
        """An example that says nothing of the project: a bare literal (output shown behind a stray prompt, tinydb's
        `>>> [{'name': 'John', 'age': 22}]`), or `help(...)` (pydoc's page, whose layout is the Python version's: the
        docs show its first lines, then a blank line, which ends doctest's expected output)."""
        try:
            tree = ast.parse(code)
        except SyntaxError:
            return False
        if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
            return False
        value = tree.body[0].value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "help":
            return True
        try:
            ast.literal_eval(value)
            return True
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return False

    def unset_environment(code):
        """The variable an example reads with `os.environ.get("X")` / `os.getenv("X")` that is not set here: a value
        the reader supplies (itsdangerous' docs: `SECRET_KEY = os.environ.get("SECRET_KEY")`, then `export
        SECRET_KEY=...`), or None."""
        try:
            tree = ast.parse(code)
        except SyntaxError:
            return None
        for n in ast.walk(tree):
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

    def assumes_module(block):
        """The package's module, when the block reads `pkg.X` that the module has and that the object an earlier
        example bound to the package's name lacks (schema's README binds `schema = Schema(...)`, then a later block
        subclasses `schema.Schema`, written as after `import schema`); else None."""
        current = ns.get(package)
        if current is None or isinstance(current, type(os)):
            return None
        attrs = set()
        for src in sources(block):
            try:
                tree = ast.parse(src)
            except SyntaxError:
                continue
            attrs |= {n.attr for n in ast.walk(tree)
                      if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == package}
        try:
            module = resolve(package)
        except Exception:  # noqa: BLE001 - no module to assume
            return None
        if attrs and all(hasattr(module, a) for a in attrs) and not all(hasattr(current, a) for a in attrs):
            return module
        return None

    def skip_rest(block, statements):
        """The rest of a block after a statement that failed: it builds on that statement and does not run."""
        for stmt in statements:
            tainted.update(names_of(ast.get_source_segment(block["text"], stmt) or ""))

    # Names a `for` loop of an example left bound (dpath's README: `for x in dpath.search(x, ...)` turns the document
    # `x` into the last tuple, and the examples after it "on that same dictionary" give [] and 0): a finding about an
    # example that uses one says so, since that is the docs' mistake a maintainer must see
    loop_bound, bound_before = {}, set()

    def note_loops(line, code):
        try:
            tree = ast.parse(code)
        except SyntaxError:
            return
        for node in ast.walk(tree):
            if isinstance(node, (ast.For, ast.AsyncFor)):
                for target in ast.walk(node.target):
                    if isinstance(target, ast.Name) and target.id in bound_before:  # a loop over a document name
                        loop_bound[target.id] = (line, code.strip().splitlines()[0])
        for name in rebound(code):
            loop_bound.pop(name, None)
            bound_before.add(name)

    def record(block, line, code, kind, **kw):
        if kind in ("mismatch", "error"):
            kw["loop_bound"] = {n: loop_bound[n] for n in sorted(names_of(code) & loop_bound.keys())}
        if kind == "skipped":
            tainted.update(names_of(code))
            if lost_state[0] is None and sets_state(code):
                lost_state[0] = f"follows `{code.strip()}`, which could not run here"
        if only is None or line == only:
            outcomes.append(dict(file=block["file"], line=line, code=code.strip(), kind=kind, **kw))

    # Docs often show alternatives, not steps ("You have a few options": row by row, all rows at once, column by
    # column, each on the same fresh `table`, prettytable's README): run one after the other, the third fails on the
    # rows the first two added. So each assignment keeps a copy of the value it gave, and an example that raises is
    # run once more with the names it uses as they were assigned: if it then does what the docs show, the failure came
    # from the examples before it, and it is not judged. Not for a wrong result: on a fresh object a wrong answer can
    # happen to equal the docs' (a count one too high, before the row that made it right). Only for a name still bound
    # to the object its assignment made (changed in place since): one a later line bound anew (dpath's `for x in ...`
    # over its `x`) is a mistake of the docs, reported.
    assigned = {}  # name -> (the object assigned, a copy of it as assigned)
    ALTERNATIVE = "works with its names as assigned: the examples before it are alternatives to it, not steps"

    def copied(value):
        """A deep copy within a second, or None: a value that cannot be copied (a file, a lock) or is too big to copy
        quickly (a loaded dataset) is not retried."""
        try:
            with limit(1):
                return copy.deepcopy(value)
        except (Exception, Overtime):  # noqa: BLE001
            return None

    def keep_assigned(code):
        for name in rebound(code):
            kept = copied(ns[name]) if name in ns else None
            if kept is None:
                assigned.pop(name, None)
            else:
                assigned[name] = (ns[name], kept)

    def as_assigned(code):
        """The namespace with the names the code uses as they were assigned (fresh copies), or None."""
        used = {n for n in names_of(code) & assigned.keys() if ns.get(n) is assigned[n][0]}
        fresh = {n: copied(assigned[n][1]) for n in used}
        return {**ns, **fresh} if used and None not in fresh.values() else None

    def passes_as_assigned(code, source, filename, mode, check):
        """Does the example (`code`: its text; `source`: what to compile) do what the docs show when the names it uses
        are as they were assigned? check(printed, value)."""
        fresh = as_assigned(code)
        if fresh is None:
            return False
        got, value, error = attempt(source, filename, mode, fresh)
        return error is None and check(got, value)

    def shows(printed, want):
        """Doctest's comparison, or equal Python literals (a set in another order)."""
        if checker.check_output(want, printed, flags):
            return True
        try:
            return same_value(ast.literal_eval(printed.strip()), ast.literal_eval(want.strip()))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return False

    def expected_output(ex, block):
        """What the docs show after a `>>>` example, as a reader reads it: comment lines are not output (tomlkit's
        `>>> doc.pop("table2")` then `# del doc["table2"] is also possible`), and a triple-quoted value goes on past
        a blank line, which ends doctest's expected output (tomlkit's `>>> dumps(doc)`, shown as a triple-quoted
        string with a blank line between its tables)."""
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

    def attempt(code, filename, mode, namespace=None):
        """(printed output, value for mode 'eval', exception or None)."""
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf), limit(20):
                value = eval(compile(code, filename, mode), ns if namespace is None else namespace)
            return buf.getvalue(), value, None
        except BaseException as e:  # noqa: BLE001 - whatever the example raises is judged below
            if isinstance(e, KeyboardInterrupt):
                raise
            return buf.getvalue(), None, e

    def run_block(block):
        if block["doctest"]:
            for ex in doctest_examples(block["text"]):
                line = block["line"] + ex.lineno
                if ex.options.get(doctest.SKIP) or (only is not None and line > only):
                    continue
                if sketches_project(ex.source) or no_claim(ex.source):
                    continue
                unset = unset_environment(ex.source)
                if depends_on_skipped(ex.source) or unset:
                    record(block, line, ex.source, "skipped", error=f"reads ${unset}, which the reader sets" if unset
                           else lost_state[0] or "depends on an example that could not run")
                    continue
                got, _, error = attempt(ex.source, block["file"], "single")
                if error is None:
                    tainted.difference_update(rebound(ex.source))
                    note_loops(line, ex.source)
                    keep_assigned(ex.source)
                want = expected_output(ex, block)
                if error is None and ex.exc_msg is None:
                    if got.strip() and not want.strip():
                        continue  # the docs show no output (the echo of a call made for its effect): no claim
                    ok = shows(got, want)
                    record(block, line, ex.source, "ok" if ok else "mismatch", want=want.strip(), got=got.strip())
                elif error is not None and ex.exc_msg is not None:
                    shown = "".join(__import__("traceback").format_exception_only(type(error), error))
                    named = ex.exc_msg.split(":")[0].strip().rsplit(".", 1)[-1]  # the type is what must agree
                    ok = checker.check_output(ex.exc_msg, shown, flags) or named == type(error).__name__
                    if not ok and not from_project(error, project_names(ns, package), package, ex.source):
                        # another exception than the docs show, and not the project's: the reader's context
                        record(block, line, ex.source, "skipped", error=exception_line(error))
                        continue
                    record(block, line, ex.source, "ok" if ok else "mismatch", want=ex.exc_msg.strip(),
                           got=shown.strip())
                elif error is None:
                    record(block, line, ex.source, "mismatch", want=ex.exc_msg.strip(), got=got.strip() or "(nothing)")
                elif from_project(error, project_names(ns, package), package, ex.source) and not template_import(error):
                    if passes_as_assigned(ex.source, ex.source, block["file"], "single",
                                          lambda printed, _, want=want: not want.strip() or shows(printed, want)):
                        record(block, line, ex.source, "skipped", error=ALTERNATIVE)
                        continue
                    record(block, line, ex.source, "error", error=exception_line(error))
                else:
                    record(block, line, ex.source, "skipped", error=exception_line(error))
            return
        try:
            tree = ast.parse(block["text"])
        except SyntaxError:
            return  # pseudo-code, or output shown as code
        if any(isinstance(n, ast.Constant) and n.value is Ellipsis for n in ast.walk(tree)):
            return  # `f(...)`: a placeholder for the reader
        lines = block["text"].splitlines()
        for n, stmt in enumerate(tree.body):
            line = block["line"] + stmt.lineno - 1
            if only is not None and line > only:
                break
            code = ast.get_source_segment(block["text"], stmt) or ""
            if sketches_project(code) or no_claim(code):
                continue
            unset = unset_environment(code)
            if depends_on_skipped(code) or unset:
                record(block, line, code, "skipped", error=f"reads ${unset}, which the reader sets" if unset
                       else lost_state[0] or "depends on an example that could not run")
                skip_rest(block, tree.body[n + 1:])
                break
            rest = lines[stmt.end_lineno - 1][stmt.end_col_offset:]
            claim = re.match(r"\s*#\s*(?:->|=>|==|=|returns?|gives?|result:|output:)?\s*(.+?)\s*$", rest)
            want = None
            if claim and isinstance(stmt, (ast.Expr, ast.Assign)):
                try:
                    want = (ast.literal_eval(claim.group(1)),)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    want = None
            if want is not None and isinstance(stmt, ast.Assign) and not (
                    len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
                want = None
            if want is not None and isinstance(stmt, ast.Expr):
                _, value, error = attempt(ast.Expression(stmt.value), block["file"], "eval")
            else:
                _, _, error = attempt(ast.Module([stmt], type_ignores=[]), block["file"], "exec")
                value = ns.get(stmt.targets[0].id) if want is not None else None
            if error is None:
                tainted.difference_update(rebound(code))
                note_loops(line, code)
                keep_assigned(code)
            if error is not None:
                kind = "error" if (from_project(error, project_names(ns, package), package, code)
                                   and not template_import(error)) else "skipped"
                module = ast.Module([stmt], type_ignores=[])
                if kind == "error" and passes_as_assigned(code, module, block["file"], "exec", lambda *_: True):
                    kind, error = "skipped", ALTERNATIVE
                record(block, line, code, kind, error=error if isinstance(error, str) else exception_line(error))
                skip_rest(block, tree.body[n + 1:])
                break
            if want is None:
                continue
            if hasattr(value, "__next__") and isinstance(want[0], (list, tuple)):
                value = list(itertools.islice(value, 10000))
            ok = same_value(value, want[0])
            record(block, line, code, "ok" if ok else "mismatch", want=claim.group(1), got=repr(value)[:2000])

    for block in blocks:  # Sphinx testsetup code first, as Sphinx runs it before the doctests; never judged
        if block.get("setup"):
            attempt(block["text"], block["file"], "exec")
    for block in blocks:
        if block.get("setup"):
            continue
        if only is not None and block["line"] > only:
            break
        before = dict(ns)
        module = assumes_module(block)
        if module is not None:
            ns[package] = module
        run_block(block)
        # `import pkg` in one snippet (to set an option) must not turn `from pkg import pkg` of the others into the
        # module: a snippet's rebinding of a name to a module stays in that snippet (so does an assumed module).
        for name, old in before.items():
            if ns.get(name) is not old and isinstance(ns.get(name), type(os)) and not isinstance(old, type(os)):
                ns[name] = old
    return outcomes


def syntax_errors(blocks):
    """The docs' Python that does not parse: each block (each `>>>` example of a doctest block) compiled as the
    project's Python compiles it. Deliberate fragments are left alone: `...` or `…` in it, a `<placeholder>` on the
    failing line, a signature shown without its body (`def f(x)`, `class A(B)`), `return`/`yield`/`break` outside
    their function or loop (a piece of a body), a trailing `def f():` whose body the docs leave out, shell lines and
    IPython magics in a python block, tracebacks (pytb), templates (`{{`, `{%`). Nor a slip of the prompts in code
    that is right as the reader copies it: continuation lines written with `>>>` (addict's `>>>     def
    __missing__`) or without `...` (simpleeval's second line of a call, doctest's "output"), two spaces after `>>>`."""
    import ast
    import re
    import textwrap

    def compiles(text):
        try:
            compile(textwrap.dedent(text), "<docs>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
            return True
        except (SyntaxError, ValueError, OverflowError):
            return False

    def prompt_slip(pieces, i):
        """The failing example i is right once joined to its neighbours, or to the lines doctest took for output."""
        want = pieces[i][2].splitlines(keepends=True)
        if any(compiles(pieces[i][1] + "".join(want[:m])) for m in range(1, min(len(want), 20) + 1)):
            return True
        return any(compiles("".join(p[1] for p in pieces[j:k + 1]))
                   for j in range(max(0, i - 10), i + 1) for k in range(i, min(len(pieces), i + 10)))

    # (IPython's magics: `%load_ext dotenv`, `%%time`, python-dotenv's README)
    fragment = re.compile(r"\.\.\.|…|\{\{|\{%|^\s*(\$ |%{1,2}\w|% |!|In \[\d*\]:|pip install)", re.M)
    partial = re.compile(r"outside (async )?function|outside loop|not properly in loop|'await' outside")
    found = []
    for block in blocks:
        lang = block.get("lang", "")
        if lang in ("pytb", "ipython"):
            continue
        if block["doctest"]:
            pieces = [(block["line"] + ex.lineno, ex.source, ex.want) for ex in doctest_examples(block["text"])]
        elif lang in ("pycon", "doctest", "pyrepl"):
            continue  # a console block without prompts is output
        else:
            pieces = [(block["line"], block["text"], "")]
        for i, (first, source, _) in enumerate(pieces):
            if fragment.search(source):
                continue
            try:
                compile(source, block["file"], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
                continue
            except SyntaxError as e:
                error = e
            except (ValueError, OverflowError):  # a NUL byte, a literal too large: not what a reader sees
                continue
            lines = source.splitlines()
            n = max(1, min(error.lineno or 1, len(lines) or 1))
            bad = lines[n - 1] if lines else ""
            signature = re.match(r"^\s*(async\s+def|def|class)\s", bad) and not bad.rstrip().endswith(":")
            body_left_out = "expected an indented block" in str(error.msg) and n >= len(lines)
            if partial.search(str(error.msg)) or signature or body_left_out or re.search(r"<\w[^<>]*>", bad) \
                    or (block["doctest"] and prompt_slip(pieces, i)):
                continue
            found.append({"file": block["file"], "line": first + n - 1, "msg": str(error.msg), "text": bad,
                          "offset": error.offset, "source": source})
    return found


# --- the host side: the script that carries them -------------------------------------------------------------------

EXAMPLES_BODY = """
outcomes = run_examples(BLOCKS, PACKAGE, ONLY)
bad = [o for o in outcomes if o["kind"] in ("mismatch", "error")]
emit({"outcomes": [o for o in outcomes if o["kind"] != "ok"][:200], "checked": len(outcomes)})
sys.exit(1 if bad else 0)
"""


def examples_script(blocks: list[dict], package: str, only: int | None = None) -> str:
    head = f"BLOCKS = {data(blocks)}\nPACKAGE = {package!r}\nONLY = {only!r}\n"
    return script(head + EXAMPLES_BODY, prelude.emit, prelude.resolve, prelude.Overtime, prelude.limit,
                  prelude.exception_line, same_value, from_project, doctest_examples, project_names, run_examples,
                  imports=("re",))


SYNTAX_BODY = """
errors = syntax_errors(BLOCKS)
emit({"errors": errors[:50]})
sys.exit(1 if errors else 0)
"""


def syntax_script(blocks: list[dict]) -> str:
    return script(f"BLOCKS = {data(blocks)}\n" + SYNTAX_BODY, prelude.emit, doctest_examples, syntax_errors,
                  imports=("re",))
