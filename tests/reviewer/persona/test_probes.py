"""The deterministic probes (reviewer/persona/probes) on small real git repositories: `statly` has one planted defect of each
kind the probes look for, its clean twin has the same docs and tests with every defect fixed and must give no
finding. Real installs in the real sandbox, real subprocesses; each finding's repro command is run again, and must
fail on the defective project and pass on the fixed one. No timing is asserted (speed figures: bench/probes.py)."""

import ast
import random
import subprocess
import sys
from pathlib import Path

import pytest
from sqlmodel import select

from reviewer.examples import git, make_example_repo
from reviewer.persona.probes import callsites, docs_claims, docs_examples, doctext
from reviewer.persona.smoke import run_smoke
from reviewer.persona.tools import TOOL_NAMES, TOOLS, Toolbox
from reviewer.run.recorder import DbRecorder
from reviewer.sandbox.workspace import create_workspace, resolve_target
from reviewer.store import db
from reviewer.store.db import Finding, Measurement, PersonaRun, ReviewRun

PYPROJECT = """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "statly"
version = "1.0"
requires-python = ">=3.9"
optional-dependencies = {test = ["pytest"]}
scripts = {statly = "statly.cli:main"}

[tool.setuptools]
packages = ["statly"]
"""

README = """# statly

statly is a lightweight statistics library.

```python
from statly import middle, running_max

middle([1, 2, 3, 4])          # 2.5
data = load_your_data("measurements.csv")
```

`running_max` is linear in the length of its input.

```
statly numbers.txt --stat mean
statly --stat middle --precision 2 numbers.txt
```
"""

USAGE = """# Usage

```pycon
>>> from statly import first_gap, running_max
>>> first_gap([1, 4, 9])
3
>>> running_max([3, 1, 4])
[3, 3, 4]

```
"""

CHANGELOG = """# Changes

## 0.1
```pycon
>>> from statly import middle
>>> middle([1, 2])
99
```
"""

TESTS = """from statly import first_gap, middle, running_max


def test_middle_odd():
    assert middle([3, 1, 2]) == 2


def test_first_gap():
    assert first_gap([1, 4, 9]) == 3


def test_running_max():
    assert running_max([3, 1, 4]) == [3, 3, 4]
"""

DEFECTIVE_CORE = """import time

time.sleep(0.55)  # heavy work at import time: over the 0.5 s threshold, whatever the machine


def middle(values):
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def first_gap(values):
    return values[1] - values[0]


def running_max(values):
    return [max(values[: i + 1]) for i in range(len(values))]
"""

FIXED_CORE = """def middle(values):
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def first_gap(values):
    if len(values) < 2:
        raise ValueError("need two values")
    return values[1] - values[0]


def running_max(values):
    out, best = [], None
    for v in values:
        best = v if best is None or v > best else best
        out.append(best)
    return out
"""

CLI = """import argparse
from statly import core


def main(argv=None):
    parser = argparse.ArgumentParser(prog="statly")
    parser.add_argument("file")
    parser.add_argument("--stat", choices=["mean", "middle"], default="mean")
    {precision}
    args = parser.parse_args(argv)
    with open(args.file) as f:
        {read}
    if not values:
        raise SystemExit("statly: no numbers in " + args.file)
    print(sum(values) / len(values) if args.stat == "mean" else core.middle(values))
"""
DEFECTIVE_CLI = CLI.format(precision="", read="values = [float(line) for line in f if line.strip()]")
FIXED_CLI = CLI.format(precision='parser.add_argument("--precision", type=int, default=6)',
                       read="""try:
            values = [float(line) for line in f if line.strip()]
        except ValueError as e:
            raise SystemExit("statly: " + str(e))""")


def project(core: str, cli: str) -> dict[str, str]:
    return {"pyproject.toml": PYPROJECT, "README.md": README, "docs/usage.md": USAGE, "CHANGELOG.md": CHANGELOG,
            "statly/__init__.py": "from statly.core import first_gap, middle, running_max\n",
            "statly/core.py": core, "statly/cli.py": cli, "tests/test_core.py": TESTS}


def make_repo(path: Path, files: dict[str, str]) -> Path:
    for name, content in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(content)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "statly")
    return path


def review(repo: Path, tmp_path: Path):
    """The smoke persona with its probes, as `reviewer run` runs it; (findings, measurements, workspace)."""
    dbp = str(tmp_path / "reviews.db")
    target = resolve_target(str(repo))
    with db.session(dbp) as s:
        run = ReviewRun(repository_id=db.get_or_create_repository(s, target.url).id, commit_sha=target.commit)
        s.add(run)
        s.flush()
        prun = PersonaRun(run_id=run.id, persona="smoke")
        s.add(prun)
        s.commit()
    ws = create_workspace(target, parent=tmp_path / "work", name="smoke")
    result = run_smoke(ws, DbRecorder(dbp, run.id, prun.id, "smoke"), timeout=600)
    assert result.status == "completed", result
    assert "gave no result" not in result.summary and " failed: " not in result.summary, result.summary  # no probe bug
    with db.session(dbp) as s:
        findings = s.exec(select(Finding).where(Finding.run_id == run.id)).all()
        measurements = s.exec(select(Measurement).where(Measurement.run_id == run.id)).all()
    return findings, measurements, ws


@pytest.fixture(scope="module")
def reviewed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probes")
    bad = review(make_repo(tmp / "defective", project(DEFECTIVE_CORE, DEFECTIVE_CLI)), tmp / "a")
    good = review(make_repo(tmp / "fixed", project(FIXED_CORE, FIXED_CLI)), tmp / "b")
    yield bad, good
    bad[2].remove()
    good[2].remove()


def test_each_planted_defect_is_found_once_with_a_repro_that_fails(reviewed):
    (findings, measurements, ws), _ = reviewed
    got = {f.category: f for f in findings}
    titles = sorted(f"{f.category}: {f.title}" for f in findings)
    assert len(findings) == 6, titles
    docs = [f for f in findings if f.category == "docs"]
    assert sorted(f.title for f in docs) == [
        "README.md example `middle([1, 2, 3, 4])` gives 3, the docs say 2.5",
        "README.md uses `--precision`, which `statly` does not accept"], titles
    assert all(f.file == "README.md" and f.line for f in docs)
    perf = sorted((f for f in findings if f.category == "performance"), key=lambda f: f.title)
    assert perf[0].title.startswith("`import statly` takes 0.") and perf[0].severity == "high"  # the docs say lightweight
    assert "README.md:3: statly is a lightweight statistics library." in perf[0].details
    assert perf[1].title.startswith("`running_max` takes time ~n^") and "linear in the length" in perf[1].title
    assert perf[1].file == "statly/core.py" and "Timings:" in perf[1].details
    crashes = sorted((f for f in findings if f.category == "crash"), key=lambda f: f.title)
    assert crashes[0].title.startswith("`first_gap([])` raises IndexError") and crashes[0].file == "statly/core.py"
    assert crashes[1].title.startswith("`statly numbers.txt --stat mean` dies with a traceback on a malformed file")
    assert "ValueError: could not convert string to float" in crashes[1].details
    assert got["docs"] and not any(f.file == "CHANGELOG.md" for f in findings)  # the past is not a claim
    assert "CLI start-up (statly --help)" in {m.name for m in measurements}
    for f in findings:  # each repro shows the problem in the workspace it came from
        again = ws.run(f.repro_command, 120)
        assert again.exit_code == 1, (f.title, again.output[-2000:])


def test_the_clean_twin_gives_no_finding_and_passes_every_repro(reviewed):
    (bad_findings, _, _), (findings, measurements, ws) = reviewed
    assert findings == [], [f.title for f in findings]
    assert "import time (statly)" in {m.name for m in measurements}
    for f in bad_findings:  # the same checks pass once the code is fixed: the repro says "fixed" by exiting 0
        again = ws.run(f.repro_command, 120)
        assert again.exit_code == 0, (f.title, again.output[-2000:])


def test_the_probes_are_tools_an_agent_can_call(reviewed):
    (_, _, ws), _ = reviewed
    for name in ("probe_docs", "probe_timing", "probe_scaling", "probe_edges"):
        tool = TOOLS[TOOL_NAMES.index(name)]["function"]
        assert "\n" not in tool["description"] and len(tool["description"]) < 160  # one line in the tool list

    class Recorder:
        def __init__(self):
            self.findings = []

        def record_finding(self, **kw):
            self.findings.append(kw)
            return len(self.findings)

        def record_measurement(self, **kw):
            return 0

    recorder = Recorder()
    out = Toolbox(ws, recorder).execute("probe_edges", {"function": "first_gap"})
    assert out.ok and "edges probe recorded 1 finding(s)" in out.output, out.output
    assert "`first_gap([])` raises IndexError" in out.output
    assert [f["category"] for f in recorder.findings] == ["crash"] and recorder.findings[0]["repro_command"]
    missing = Toolbox(ws, recorder).execute("probe_scaling", {"function": "nowhere"})
    assert not missing.ok and "never call 'nowhere'" in missing.output
    bad = Toolbox(ws, recorder).execute("probe_docs", {"verbose": True})
    assert not bad.ok and "bad arguments for probe_docs" in bad.output


def test_the_four_defects_of_the_example_are_found(tmp_path):
    """tinystats (examples/README.md): the smoke persona found one of its four defects; with the probes, all four.
    `make demo` shows them verified in fresh clones; here each repro command is run again in the same workspace."""
    findings, _, ws = review(make_example_repo(tmp_path / "tinystats"), tmp_path)
    try:
        titles = sorted(f.title for f in findings)
        assert len(findings) == 5, titles
        assert "README.md example `median([1, 2, 3, 4])` gives 3, the docs say 2.5" in titles  # even-length median
        assert "1 of 8 tests fail (tests/test_core.py::test_percentile_unsorted)" in titles  # percentile: unsorted
        assert "README.md example `percentile([5, 1, 3], 50)` gives 1, the docs say 3" in titles
        assert any(t.startswith("`moving_average` takes time ~n^") and "linear in the length" in t
                   for t in titles)  # O(n * window)
        assert any(t.startswith("`tinystats data.txt --stat median` dies with a traceback on an empty file and a "
                                "malformed file") for t in titles)  # the CLI on a non-numeric line
        for f in findings:
            assert ws.run(f.repro_command, 120).exit_code != 0, f.title
    finally:
        ws.remove()


# --- the precision rules, on what real projects do (no install: the package lies on PYTHONPATH) ------------------------

def run_examples_script(tmp_path: Path, package_files: dict[str, str], doc: str, name: str = "README.md"):
    for rel, text in package_files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / name).write_text(doc)
    blocks = [docs_claims.block_data(b) for b in doctext.all_blocks(tmp_path) if b.is_python]
    code = docs_examples.examples_script(blocks, "pkg")
    done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=60)
    from reviewer.persona.probes.runner import result_line

    return done.returncode, result_line(done.stdout)


def run_probe_script(code: str, root: Path) -> dict:
    """A probe's generated script run over the package lying in `root` (no install): its result line."""
    from reviewer.persona.probes.runner import result_line

    done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=120)
    return result_line(done.stdout)


def call_site(call: str, target: str) -> callsites.CallSite:
    """The call site a test file's `call` (source text) of `target` makes."""
    tree = ast.parse(call, mode="eval").body
    return callsites.CallSite(target, "tests/test_x.py:1", call, [callsites.classify(a) for a in tree.args],
                              [(k.arg, callsites.classify(k.value)) for k in tree.keywords], False)


def edge_result(site: callsites.CallSite, root: Path, doc_named: bool = True) -> dict:
    """The edge-input probe's result for `site`: every variant of its arguments, run over the package in `root`."""
    from reviewer.persona.probes import edge_inputs

    cases = [(shown, swaps[0][1], src) for swaps in edge_inputs.variants(site)
             for src, shown in [edge_inputs.call_source(site, swaps)]]
    return run_probe_script(edge_inputs.edge_script(site, cases, set(), "", doc_named), root)


PKG = {"pkg/__init__.py": "from pkg.core import pkg, half\nOPTION = 1\n",
       "pkg/core.py": "def pkg(x):\n    return [x]\n\n\ndef half(x):\n    return x / 2\n"}


def test_docs_examples_leave_alone_what_the_reader_must_supply(tmp_path):
    doc = """# pkg
```python
from pkg import pkg, half
import pkg as module_of_it          # fine
half(1)                              # 0.5
half(2)                              # 1.0 exactly, as shown
```

Set an option (this snippet imports the module under the function's name):

```python
import pkg
pkg.OPTION = 2
```

```pycon
>>> pkg(3)
[3]
>>> sorted({"b", "a"})
['a', 'b']
>>> half(1/3)
0.16666...
>>> read_my_file("data.csv")
>>> half(1)  # doctest: +SKIP
7
```

```python
result = load(...)        # a placeholder
```
"""
    code, got = run_examples_script(tmp_path, PKG, doc)
    assert code == 0, got
    assert [o["kind"] for o in got["outcomes"]] == ["skipped"]  # the undefined read_my_file: not the project's fault
    assert got["checked"] == 5


def test_docs_examples_that_are_wrong_or_raise_from_the_project_are_reported(tmp_path):
    doc = """```python
from pkg import half, pkg
half(3)        # 1.4
```

```pycon
>>> pkg(1)
[2]
>>> from pkg import missing
>>> half("x")
'x'
```

```python
missing(2)
```
"""
    code, got = run_examples_script(tmp_path, PKG, doc)
    assert code == 1
    kinds = [(o["line"], o["kind"], o.get("got") or o.get("error")) for o in got["outcomes"]]
    assert kinds == [(3, "mismatch", "1.5"), (7, "mismatch", "[1]"),
                     (9, "error", "ImportError: cannot import name 'missing' from 'pkg' (" + str(tmp_path)
                      + "/pkg/__init__.py)"),
                     (10, "error", "TypeError: unsupported operand type(s) for /: 'str' and 'int'"),
                     (15, "skipped", "NameError: name 'missing' is not defined")]  # (the docs use what they import)


def test_docs_examples_after_a_step_the_reader_must_supply_are_not_judged(tmp_path):
    """What real projects' docs do (cachetools, semver, humanize): an example that cannot run here (a name from a
    Sphinx testsetup block or a conftest, a translation file the build makes) leaves the examples that build on it
    without their state; those are not findings. Sphinx testsetup code runs first, so what needs only it is checked."""
    doc = """Title
=====

.. testsetup:: *

   from pkg import half

.. doctest::

   >>> cache = {}
   >>> @memo(cache)
   ... def f(n):
   ...     return n
   >>> f(2)
   2
   >>> sorted(cache)
   [2]
   >>> half(4)
   2.0
   >>> half(6)
   4.0

.. code-block:: python

   >>> ver = Version.parse("1.2.3")
   >>> ver[3]
   Traceback (most recent call last):
   ...
   IndexError: Version part undefined
   >>> _t = open("locale/ru.mo")
   >>> half(1)
   0.5
   >>> print(ver)
   1.2.3
"""
    code, got = run_examples_script(tmp_path, PKG, doc, name="README.rst")
    kinds = [(o["line"], o["kind"]) for o in got["outcomes"]]
    assert code == 1, got
    # the one finding: half(6) is 3.0, and half came from the testsetup block
    assert [k for k in kinds if k[1] != "skipped"] == [(20, "mismatch")], got
    # skipped: the decorator nobody defined, what builds on it, the parse that needs a conftest's name and what
    # uses its result, the missing file; half(1) after it does not use what the file would have given: checked
    assert kinds == [(11, "skipped"), (14, "skipped"), (16, "skipped"), (20, "mismatch"), (25, "skipped"),
                     (26, "skipped"), (30, "skipped"), (33, "skipped")] and got["checked"] == 11


def test_template_imports_lost_state_rebound_names_and_a_single_module_project(tmp_path):
    """Seen on the fourth round's projects. funcy's README: `from funcy import whatever, you, need` (names the docs
    never use: the reader's placeholder, not an API). natsort's README: `locale.setlocale(locale.LC_ALL,
    'en_US.UTF-8')` fails on a machine without that locale, and the LOCALE sorts after it then differ (state no name
    shows). xmltodict's README: uses `xmltodict` before its own `import xmltodict`, and xmltodict.py is a single module
    at the top of the repository, so every example, run from there, looked like the project's code."""
    doc = """# pkg
```python
from pkg import whatever, you, need
```

```pycon
>>> print(json.dumps(half(2)))
1.0
>>> from pkg import half
>>> half(3)
9
>>> int([])
>>> import locale
>>> locale.setlocale(locale.LC_ALL, 'xx_XX.UTF-8')
'xx_XX.UTF-8'
>>> half(1)
7
```
"""
    code, got = run_examples_script(tmp_path, {"pkg.py": "def half(x):\n    return x / 2\n"}, doc)
    kinds = [(o["line"], o["kind"], o.get("got") or o.get("error")) for o in got["outcomes"]]
    assert code == 1, got
    assert [k[:2] for k in kinds] == [(3, "skipped"), (7, "skipped"), (10, "mismatch"), (12, "skipped"),
                                      (14, "skipped"), (16, "skipped")], kinds
    assert kinds[2][2] == "1.5" and kinds[3][2].startswith("TypeError")
    assert kinds[5][2] == "follows `locale.setlocale(locale.LC_ALL, 'xx_XX.UTF-8')`, which could not run here"


def test_a_sketch_of_the_projects_code_and_the_package_name_reused_for_an_object(tmp_path):
    """Seen on the fifth round (schema 0.7.7's README). "``Use`` is basically: class Use: ..." sketches the project's
    own class: run, it replaced the real `Use`, and a later `Use(int, error=...)` raised TypeError. And one example
    binds `schema = Schema(...)`, a later block subclasses `schema.Schema`, written as after `import schema`: that
    block sees the module, the examples after it the object again. What they compute is still checked. Not claims
    (tinydb's and dpath's READMEs): a bare literal behind a stray prompt, and `help(...)` shown up to a blank line.
    And itsdangerous' `SECRET_KEY = os.environ.get("SECRET_KEY")`: a value the reader supplies, unset here."""
    from reviewer.persona.probes.docs_claims import example_finding
    from reviewer.persona.probes.runner import Probe
    files = {"pkg/__init__.py": "class Use:\n    def __init__(self, f, error=None):\n        self.f = f\n\n"
                                "    def run(self, x):\n        return self.f(x)\n\n\n"
                                "class Box:\n    def __init__(self, v):\n        self.v = v\n"}
    doc = """# pkg
```pycon
>>> from pkg import Use, Box
>>> pkg = Box(3)
>>> pkg.v
3
```

``Use`` is basically:

```python
class Use:
    def __init__(self, f):
        self.f = f
```

```python
class Mine(pkg.Box):
    pass

Mine(2).v    # 2
```

```pycon
>>> Use(int, error="bad").run("4")
4
>>> pkg.v
3
>>> Use(int).run("5")
6
>>> help(Box)
Help on class Box in module pkg:

>>> [{'v': 3}]
```

```pycon
>>> box = Box([1, 2])
>>> for box in [Box(5)]: pass
>>> box.v
[1, 2]
```

```python
import os
KEY = os.environ.get("REVIEWER_UNSET_KEY")
Box(KEY).v.upper()    # 'X'
```
"""
    code, got = run_examples_script(tmp_path, files, doc)
    kinds = [(o["line"], o["kind"], o.get("got") or o.get("error")) for o in got["outcomes"]]
    assert code == 1 and kinds == [(29, "mismatch", "5"), (40, "mismatch", "5"),
                                   (46, "skipped", "reads $REVIEWER_UNSET_KEY, which the reader sets")], kinds
    # a loop over a name the docs bound before (dpath's `for x in dpath.search(x, ...)`): the finding says so
    assert [o["loop_bound"] for o in got["outcomes"][:2]] == [{}, {"box": [39, "for box in [Box(5)]: pass"]}]
    assert got["checked"] == 11, got
    recorded = []
    probe = Probe(root=tmp_path, sh=None, finding=lambda **kw: recorded.append(kw), measure=None, deadline=0.0,
                  package="pkg")
    example_finding(probe, [], got["outcomes"][1])
    assert recorded[0]["details"].endswith("Note: `box` there is what the loop `for box in [Box(5)]: pass` at "
                                           "README.md:39 left in it, not what the docs bound to `box` before that "
                                           "loop."), recorded


def test_examples_that_are_alternatives_are_not_run_as_steps(tmp_path):
    """Seen on prettytable's README: "you have a few options" (row by row, then column by column), each on the same
    fresh `table`; run one after the other, the column-by-column one raised ValueError on the rows already there.
    With `table` as it was assigned it works, so it is not judged. A wrong result is judged as it comes: on a fresh
    `other` the count one too high would equal the docs' 1. And tomlkit's quickstart: a value shown as a triple-quoted
    string with a blank line in it, and a comment line after a call made for its effect (not its output)."""
    files = {"pkg/__init__.py": "class Table:\n    def __init__(self):\n        self.rows, self.cols = [], {}\n\n"
                                "    def add_row(self, row):\n        self.rows.append(row)\n\n"
                                "    def add_column(self, name, values):\n"
                                "        if self.rows and len(values) != len(self.rows):\n"
                                "            raise ValueError('column length does not match the rows')\n"
                                "        self.cols[name] = values\n\n"
                                "    def count(self):\n        return len(self.rows) + 1\n"}
    doc = """# pkg
```python
from pkg import Table
table = Table()
```

Row by row:

```python
table.add_row([1])
table.add_row([2])
```

Or column by column:

```python
table.add_column("a", [1, 2, 3])
```

```pycon
>>> other = Table()
>>> other.add_row([1])
>>> other.count()
1
```

```pycon
>>> grid = Table()
>>> grid.add_row([1])
>>> grid.add_column("b", [4, 5, 6])
```

```pycon
>>> text = "a\\n\\nb\\n"
>>> text
'''a

b
'''
>>> bag = [1]
>>> bag.pop()
# bag.clear() also works
```
"""
    code, got = run_examples_script(tmp_path, files, doc)
    kinds = [(o["line"], o["kind"], o.get("got") or o.get("error")) for o in got["outcomes"]]
    alternative = "works with its names as assigned: the examples before it are alternatives to it, not steps"
    assert code == 1 and kinds == [(17, "skipped", alternative), (23, "mismatch", "2"), (30, "skipped", alternative)], \
        kinds


def test_a_documented_command_that_fails_as_the_docs_show_is_not_a_finding():
    fails = "sh -c 'echo ERROR 1.5 is not valid >&2; exit 2'"
    spec = {"text": fails, "argv": ["sh", "-c", "x"], "prefix": 1, "expected": "ERROR 1.5 is not valid"}
    from reviewer.persona.probes.sandboxed.commands import check_command

    assert check_command(spec, ["run"], 10) == []
    other = dict(spec, expected="2.0.0")
    assert [p["what"] for p in check_command(other, ["run"], 10)] == ["exit code 2"]
    silent = dict(spec, expected=None)
    assert [p["what"] for p in check_command(silent, ["run"], 10)] == ["exit code 2"]


def test_documented_commands_are_the_lines_that_run_the_project(tmp_path):
    (tmp_path / "README.md").write_text("""```
tool in.txt --fast
pip install tool
```

    ==========  =====
    tool (1.0)   12.5
    ==========  =====

```console
$ echo "a b" | tool --stdin
a-b
$ git clone https://example.org/tool
```

```
tool run FILE
python -m tool.sub check
```
""")
    found = doctext.commands(doctext.all_blocks(tmp_path), {"tool"}, "tool")
    assert [(c.line, c.text, c.expected) for c in found] == [
        (2, "tool in.txt --fast", None), (11, 'echo "a b" | tool --stdin', "a-b"), (17, "tool run FILE", None),
        (18, "python -m tool.sub check", None)]
    assert [doctext.is_placeholder(t) for t in found[2].argv] == [False, False, True]
    # run as written only when every file it names is there, whatever the extension (sqlparse's `query.sql`); a
    # module after `-m` is not a file
    from reviewer.persona.probes.docs_claims import runnable

    line = lambda text: doctext.Command("README.md", 1, text)  # noqa: E731
    assert not runnable(line("sqlformat --reindent query.sql"), tmp_path)
    (tmp_path / "query.sql").write_text("select 1")
    assert runnable(line("sqlformat --reindent query.sql"), tmp_path)
    assert runnable(line("python -m tool.sub check --level 1.5"), tmp_path)
    assert not runnable(line("tool in.txt --fast"), tmp_path)


def test_call_sites_come_from_tests_and_docs_with_literal_arguments(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("""import pytest
import pkg as p
from pkg.core import half


def test_half():
    txt = "abc"
    assert p.pkg(txt) == ["abc"]
    assert half(range(4), n=2)
    with pytest.raises(KeyError):
        half({}, n=[1, 2])
    half(some_variable)
    p._private([1])
""")
    sites = callsites.find(tmp_path, "pkg", [])
    assert {t: [s.text for s in c] for t, c in sites.calls.items()} == {
        "pkg.pkg": ["p.pkg(txt)"], "pkg.core.half": ["half(range(4), n=2)", "half({}, n=[1, 2])"]}
    assert [a.source for _, a in sites.calls["pkg.pkg"][0].all_args()] == ["'abc'"]  # the literal the name stands for
    assert sites.expected == {"pkg.pkg": {"KeyError"}, "pkg.core.half": {"KeyError"}, "pkg._private": {"KeyError"}}


def test_no_probes_option_and_setting(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from reviewer.cli import app
    from reviewer.config import load_settings

    assert "--no-probes" in CliRunner().invoke(app, ["run", "--help"]).output
    monkeypatch.delenv("REVIEWER_PROBES")
    assert load_settings().probes is True  # on by default
    monkeypatch.setenv("REVIEWER_PROBES", "maybe")
    bad = CliRunner().invoke(app, ["run", str(tmp_path)])
    assert bad.exit_code == 2 and "REVIEWER_PROBES" in bad.output  # a bad value: one line naming the key
    overridden = CliRunner().invoke(app, ["run", str(tmp_path), "--no-probes"])  # the command line wins
    assert overridden.exit_code == 2 and "not a git repository" in overridden.output


def test_a_probe_script_as_repro_keeps_its_lines_in_the_reports(tmp_path):
    from reviewer.report import html_report, report

    dbp = str(tmp_path / "reviews.db")
    script = "python - <<'REVIEWER_PROBE'\nimport sys\nsys.exit(1)\nREVIEWER_PROBE"
    with db.session(dbp) as s:
        run = ReviewRun(repository_id=db.get_or_create_repository(s, "file:///x").id, commit_sha="a" * 40,
                        status="completed")
        s.add(run)
        s.flush()
        s.add(Finding(run_id=run.id, persona="smoke", title="t", severity="low", category="docs", details="d",
                      repro_command=script))
        s.commit()
    runs = report.collect_runs(dbp)
    markdown = report.render_markdown(runs, [], source=dbp)
    assert "    ```\n    python - <<'REVIEWER_PROBE'\n    import sys\n    sys.exit(1)\n    REVIEWER_PROBE\n    ```" in markdown
    html = html_report.finding_html(runs[0]["findings"][0])
    assert "<pre>python - &lt;&lt;&#x27;REVIEWER_PROBE&#x27;\nimport sys\nsys.exit(1)\nREVIEWER_PROBE</pre>" in html


def test_a_call_that_hangs_is_abandoned_and_not_reported(tmp_path):
    from reviewer.persona.probes import edge_inputs
    from reviewer.persona.probes.runner import result_line

    (tmp_path / "hangs").mkdir()
    (tmp_path / "hangs" / "__init__.py").write_text(
        "def spin(values):\n    while not values:\n        pass\n    return values[0]\n")
    site = call_site("spin([1])", "hangs.spin")
    cases = [(shown, swaps[0][1], src) for swaps in edge_inputs.variants(site)
             for src, shown in [edge_inputs.call_source(site, swaps)]]
    assert [c[0] for c in cases] == ["spin([])"]
    code = edge_inputs.edge_script(site, cases, set(), "")
    done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0 and result_line(done.stdout)["crashes"] == [], done.stdout + done.stderr


def test_an_element_getter_on_empty_input_and_a_missing_key_we_passed_are_not_crashes(tmp_path):
    """Seen on toolz: `last('')` raising IndexError (its docstring: "The last element in a sequence") and
    `topk(2, rows, key='')` raising KeyError('') are Python's contracts, not crashes; `gap([])`, with no such
    docstring, still is. Seen on pydash: `divide(20, 0)` raising ZeroDivisionError ("Divide two numbers.")."""
    (tmp_path / "seqs").mkdir()
    (tmp_path / "seqs" / "__init__.py").write_text(
        'def last(seq):\n    """The last element in a sequence."""\n    return seq[-1]\n\n\n'
        "def pick(rows, key):\n    return [r[key] for r in rows]\n\n\n"
        "def gap(values):\n    return values[1] - values[0]\n\n\n"
        'def divide(a, b):\n    """Divide two numbers."""\n    return a / b\n\n\n'
        "def share(total, parts):\n    return total / parts\n")

    def crashes(call, target):
        return [c["case"] for c in edge_result(call_site(call, target), tmp_path)["crashes"]]

    assert crashes("last('abc')", "seqs.last") == []
    assert crashes("pick([{'a': 1}], key='a')", "seqs.pick") == []
    assert crashes("gap([1, 4])", "seqs.gap") == ["gap([])"]
    # pydash.divide(20, 0): a function that says it divides keeps `/`'s contract; without that docstring it is a crash
    assert crashes("divide(20, 5)", "seqs.divide") == []
    assert crashes("share(20, 5)", "seqs.share") == ["share(20, 0)"]


def test_a_method_of_a_builtin_object_the_project_holds_is_not_probed(tmp_path):
    """Seen on inflection: its tests call `inflection.UNCOUNTABLES.add(...)`, a method of a module-level set. That is
    Python's code, not the project's, and each call changes the project's state for the next (`NAMES.pop(0)` empties
    the list); probing it spends a slot of the probes' budget on nothing. Neither probe calls it; the project's own
    functions still are."""
    from reviewer.persona.probes import scaling

    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "__init__.py").write_text("NAMES = ['a']\n\n\ndef gap(values):\n"
                                                   "    return values[1] - values[0]\n")
    held = edge_result(call_site("NAMES.pop(0)", "held.NAMES.pop"), tmp_path)
    assert held["crashes"] == [] and "built-in" in held["skipped"]
    assert [c["case"] for c in edge_result(call_site("gap([1, 4])", "held.gap"), tmp_path)["crashes"]] == ["gap([])"]
    pop = scaling.scaling_script(call_site("NAMES.pop(0)", "held.NAMES.pop"), [], 1.0, 1.0)
    assert "built-in" in run_probe_script(pop, tmp_path)["skipped"]


def test_the_projects_internals_are_not_probed(tmp_path):
    """Seen on natsort: its tests call `natsort.compat.fake_fastnumbers.fast_float`, a stand-in for an optional
    dependency whose docstring says natsort controls what is passed to it; `fast_float('')` raises IndexError, which
    no user can reach. A function neither the package exports (itself or its class) nor its module lists in
    `__all__`, nor the docs name, is not given edge inputs or sizes; exported, listed or documented ones are."""
    from reviewer.persona.probes import scaling

    (tmp_path / "inner").mkdir()
    gap = "def gap(values):\n    return values[1] - values[0]\n"
    (tmp_path / "inner" / "__init__.py").write_text("from inner.core import gap\n")
    (tmp_path / "inner" / "core.py").write_text(gap + "\n\ndef helper(values):\n    return values[0]\n")
    (tmp_path / "inner" / "listed.py").write_text("__all__ = ['head']\n\n\ndef head(values):\n    return values[0]\n")

    def crashes(call, target, named):
        return [c["case"] for c in edge_result(call_site(call, target), tmp_path, named)["crashes"]]

    internal = edge_result(call_site("helper([1, 4])", "inner.core.helper"), tmp_path, False)
    assert internal["crashes"] == [] and "internals" in internal["skipped"]
    sizes = scaling.scaling_script(call_site("helper([1, 4])", "inner.core.helper"), [], 1.0, 1.0, False)
    assert "internals" in run_probe_script(sizes, tmp_path)["skipped"]
    assert crashes("helper([1, 4])", "inner.core.helper", True) == ["helper([])"]
    assert crashes("gap([1, 4])", "inner.gap", False) == ["gap([])"]
    assert crashes("head([1, 4])", "inner.listed.head", False) == ["head([])"]
    docs = "Use `inner.core` for the details; `head` gives the first value."
    assert doctext.names(docs, "inner.core.helper") and doctext.names(docs, "inner.listed.head")
    assert not doctext.names(docs, "inner.compat.fake.helper2") and not doctext.names("see inner.core2", "inner.core.x")


def test_the_probes_stop_when_their_time_is_spent(tmp_path):
    import time

    from reviewer.persona.probes.runner import Probe
    from reviewer.persona.probes.suite import run_probes

    def never(*args):
        raise AssertionError("no command may start once the probes' time is spent")

    probe = Probe(root=tmp_path, sh=never, finding=never, measure=never, deadline=time.monotonic() + 12,
                  package="pkg")
    run_probes(probe)
    assert probe.notes == ["probes stopped at 'probe: console scripts and import of the installed project': "
                           "their time ran out"]


TOOL = '''#!/usr/bin/env python3
"""A key-value store in ./store.json: `tool set KEY VALUE` (says "saved KEY"), `tool list` (sorted keys)."""
import json, os, sys
path = "store.json"
data = json.load(open(path)) if os.path.exists(path) else None
if sys.argv[1] == "set":
    data = dict(data or {}, **{sys.argv[2]: sys.argv[3]})
    json.dump(data, open(path, "w"))
    print("saved", sys.argv[2])
elif sys.argv[1] == "list":
    if data is None:
        sys.exit("no store here: run `tool set` first")
    for key in sorted(data):
        print(f"{key}={data[key]}")
'''

SESSION_README = """# tool

```console
$ pip install tool
$ tool set NAME alice@example.com
$ tool set AGE 42
$ tool list
NAME=alice@example.com
AGE=42
```

Your own file:

```console
$ tool import path/to/your.csv
$ tool list
AGE=42
```
"""


def run_session_check(root: Path, steps: list[dict], only=None, strict=None) -> tuple[int, dict]:
    from reviewer.persona.probes import doc_sessions
    from reviewer.persona.probes.runner import result_line

    done = subprocess.run([sys.executable, "-"], input=doc_sessions.session_script(steps, only, strict),
                          capture_output=True,
                          text=True, cwd=root, env={"PATH": f"{root / 'bin'}:/usr/bin:/bin"}, timeout=120)
    return done.returncode, result_line(done.stdout)


def test_a_documented_shell_session_runs_in_order_in_one_shell(tmp_path):
    """Seen on a real project (false, high, "verified"): `tool set KEY value` twice, then `tool list`. The keys and
    the e-mail address were taken for values the reader supplies, so the `set` lines never ran and `tool list`, run
    alone with no state file, "failed". Run as a session, in order, the lines work, and what the probe missed shows:
    `list` sorts its keys, and `set` prints a line the docs do not show."""
    from reviewer.persona.probes import doc_sessions

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "tool").write_text(TOOL)
    (tmp_path / "bin" / "tool").chmod(0o755)
    (tmp_path / "README.md").write_text(SESSION_README)
    sessions = doctext.sessions(doctext.all_blocks(tmp_path), {"tool"}, None)
    assert [[(s.kind, s.run, s.filled) for s in x.steps] for x in sessions] == [
        [("setup", None, False), ("project", "tool set NAME alice@example.com", True),
         ("project", "tool set AGE 42", True), ("project", "tool list", False)],
        [("project", None, False), ("project", "tool list", False)]]
    steps = doc_sessions.session_steps(sessions[0], tmp_path, docs_claims.file_name)
    code, got = run_session_check(tmp_path, steps)
    assert code == 1
    problems = [(steps[p["step"]]["text"], p["what"], p["output"]) for p in got["problems"]]
    assert problems == [("tool set NAME alice@example.com", "unshown output", "saved NAME\n"),
                        ("tool set AGE 42", "unshown output", "saved AGE\n"),
                        ("tool list", "output", "AGE=42\nNAME=alice@example.com\n")], problems
    assert not (tmp_path / "store.json").exists()  # the session ran in a copy of the repository
    # the repro of one finding runs the lines before it and judges that line alone
    code, got = run_session_check(tmp_path, steps[:4], only=3)
    assert code == 1 and [p["step"] for p in got["problems"]] == [3]
    # and that of a `set` line, which holds no line with output, judges it as the whole session did (it had passed)
    code, got = run_session_check(tmp_path, steps[:2], only=1, strict=True)
    assert code == 1 and [(p["step"], p["what"]) for p in got["problems"]] == [(1, "unshown output")]
    # a line that cannot run (the reader's file) ends what is judged: `tool list` after it is not judged
    second = doc_sessions.session_steps(sessions[1], tmp_path, docs_claims.file_name)
    assert run_session_check(tmp_path, second) == (0, {"problems": []})
    # what the docs show is what it prints: no finding
    (tmp_path / "README.md").write_text("```console\n$ tool set NAME alice@example.com\nsaved NAME\n$ tool list\n"
                                        "NAME=alice@example.com\n```\n")
    fixed = doctext.sessions(doctext.all_blocks(tmp_path), {"tool"}, None)[0]
    assert run_session_check(tmp_path, doc_sessions.session_steps(fixed, tmp_path, docs_claims.file_name)) == (
        0, {"problems": []})


def test_a_difference_is_shown_with_what_cannot_be_seen_escaped(tmp_path):
    """Seen on a real project: three findings differed only in an invisible U+FE0F after an emoji, and expected and
    got looked the same in the report; another dumped a whole --help text without saying which lines differ."""
    from reviewer.persona.probes.runner import Probe

    pkg = {"pkg/__init__.py": "def heart():\n    return '\\u2764'\n"}
    code, got = run_examples_script(tmp_path, pkg, "```pycon\n>>> from pkg import heart\n>>> print(heart())\n"
                                                   "\u2764\ufe0f\n```\n")
    assert code == 1 and [o["kind"] for o in got["outcomes"]] == ["mismatch"]
    found = []
    probe = Probe(root=tmp_path, sh=None, finding=lambda **kw: found.append(kw), measure=None, deadline=0,
                  package="pkg")
    docs_claims.example_finding(probe, [], got["outcomes"][0])
    assert found[0]["title"] == "README.md example `print(heart())` gives \u2764, the docs say \u2764\\ufe0f"
    assert "--- docs\n+++ got\n@@ -1 +1 @@\n-\u2764\\ufe0f\n+\u2764" in found[0]["details"]
    assert "-\u2764\\ufe0f\n+\u2764" in found[0]["evidence"]
    # tabs, a carriage return and trailing spaces are escaped too; of a long output only the lines that differ show
    assert docs_claims.visible("a\tb  \r\nc\u200b") == "a\\tb\\x20\\x20\\r\nc\\u200b"
    help_text = "\n".join(f"  --option-{i}  does {i}" for i in range(80))
    diff = docs_claims.difference(help_text, help_text.replace("does 40", "does forty"))
    assert diff.splitlines() == ["--- docs", "+++ got", "@@ -39,5 +39,5 @@", "   --option-38  does 38",
                                 "   --option-39  does 39", "-  --option-40  does 40", "+  --option-40  does forty",
                                 "   --option-41  does 41", "   --option-42  does 42"]


def test_docs_that_do_not_parse_are_findings_and_fragments_are_not(tmp_path):
    """Seen on a real project: doctest's parser crashed on one .rst (`>>>x` without its blank) and only a note was
    left, although the file holds an example with an extra `)`. Every Python block now compiles; a SyntaxError is a
    finding with its line, a deliberate fragment is not, and a block doctest cannot parse is read paragraph by
    paragraph (its other examples still run)."""
    from reviewer.persona.probes.docs_examples import syntax_script
    from reviewer.persona.probes.sandboxed.doctests import doctest_examples

    (tmp_path / "README.md").write_text("""# pkg

```python
from pkg import half
print(half(4)))
```

```python
result = half(...)
def signature(x, y=2)
```

```python
client = Client(<your key>)
```

```python
    return value
```

```python
def later():
```

```pytb
Traceback (most recent call last):
  File "x", line 1
```

```python
print "python 2"
```
""")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.rst").write_text("""Guide
=====

.. code-block:: python

    >>> from pkg import half
    >>>half(2)
    1.0

    >>> print(half(2)))
""")
    blocks = [docs_claims.block_data(b) for b in doctext.all_blocks(tmp_path) if b.is_python]
    got = run_probe_script(syntax_script(blocks), tmp_path)
    assert [(e["file"], e["line"], e["msg"], e["text"]) for e in got["errors"]] == [
        ("README.md", 5, "unmatched ')'", "print(half(4)))"),
        ("README.md", 31, "Missing parentheses in call to 'print'. Did you mean print(...)?", 'print "python 2"'),
        ("docs/guide.rst", 10, "unmatched ')'", "print(half(2)))")], got
    # the .rst block doctest cannot parse still gives its examples, at their lines
    rst = next(b for b in blocks if b["file"] == "docs/guide.rst")
    assert [(rst["line"] + ex.lineno, ex.source.strip()) for ex in doctest_examples(rst["text"])] == [
        (6, "from pkg import half"), (7, "half(2)"), (10, "print(half(2)))")]
    code, result = run_examples_script(tmp_path, PKG, (tmp_path / "docs" / "guide.rst").read_text(), "docs/guide.rst")
    assert result is not None and result["checked"] >= 1, result  # the file's script no longer dies


ORDERED_SET = '''from collections.abc import MutableSet


class OrderedSet(MutableSet):
    """A set that remembers insertion order, with list-like indexing."""

    def __init__(self, items=()):
        self.items, self.map = [], {}
        for x in items:
            self.add(x)

    def add(self, key):
        if key not in self.map:
            self.map[key] = len(self.items)
            self.items.append(key)

    def discard(self, key):
        if key in self.map:
            self.pop(self.index(key))

    def pop(self, index=-1):
        """Remove and return the item at index (the last by default)."""
        if not self.items:
            raise KeyError("pop from an empty set")
        key = self.items.pop(index)
        del self.map[key]
        REINDEX
        return key

    def index(self, key):
        """The position of key.

        Raises:
            IndexError: if key is not in the set.
        """
        MISSING
        return self.map[key]

    def __getitem__(self, i):
        return self.items[i]

    def __contains__(self, key):
        return key in self.map

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)
'''

FINE_COLLECTIONS = '''import bisect
from collections.abc import MutableMapping, MutableSequence, MutableSet, Sequence


class Defaults(MutableMapping):
    """A dict with a default of 0 for a missing key (like collections.Counter)."""
    def __init__(self):
        self.data = {}
    def __missing__(self, key):
        return 0
    def __contains__(self, key):
        return key in self.data
    def __getitem__(self, key):
        return self.data[key] if key in self.data else self.__missing__(key)
    def __setitem__(self, key, value):
        self.data[key] = value
    def __delitem__(self, key):
        del self.data[key]
    def __iter__(self):
        return iter(self.data)
    def __len__(self):
        return len(self.data)


class SortedSet(MutableSet, Sequence):
    """Kept sorted, not in insertion order."""
    def __init__(self):
        self.items = []
    def add(self, x):
        if x not in self.items:
            bisect.insort(self.items, x)
    def discard(self, x):
        if x in self.items:
            self.items.remove(x)
    def __getitem__(self, i):
        return self.items[i]
    def __contains__(self, x):
        return x in self.items
    def __iter__(self):
        return iter(self.items)
    def __len__(self):
        return len(self.items)


class Readings(MutableSequence):
    """Only grows through add(); append and insert are refused."""
    def __init__(self):
        self.items = []
    def add(self, x):
        self.items.append(x)
    def insert(self, i, x):
        raise NotImplementedError("use add()")
    def __getitem__(self, i):
        return self.items[i]
    def __setitem__(self, i, x):
        raise NotImplementedError
    def __delitem__(self, i):
        del self.items[i]
    def __len__(self):
        return len(self.items)
'''


def model_results(tmp_path: Path, core: str) -> list[dict]:
    """Every collection class of `pkg` driven against its model: [(target, what it found)]."""
    from reviewer.persona.probes import models

    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "pkg" / "__init__.py").write_text("from pkg.core import *\n")
    (tmp_path / "pkg" / "core.py").write_text(core)
    classes = run_probe_script(models.discover_script("pkg", {}), tmp_path)["classes"]
    assert all(why.startswith("is a collections.abc.Mutable") for _, _, why in classes), classes
    return [(t, kind, run_probe_script(models.drive_script(t, kind), tmp_path)) for t, kind, _ in classes]


def test_a_collection_is_checked_against_the_builtin_type_as_its_model(tmp_path):
    """Missed on a real project: an ordered set whose index map is not rebuilt after pop(0), so index() is stale,
    and whose index() raises KeyError where its docstring promises IndexError. Driven with random operations against
    a list without duplicates as the model, the failing sequence is shrunk to the shortest, and its repro runs."""
    from reviewer.persona.probes import models
    from reviewer.persona.probes.runner import Probe

    stale = ORDERED_SET.replace("        REINDEX\n", "").replace("        MISSING\n", "")
    (target, kind, got), = model_results(tmp_path, stale)
    assert (target, kind) == ("pkg.core.OrderedSet", "orderedset")
    behaviour, promise = got["found"]
    assert behaviour["kind"] == "orderedset" and behaviour["failure"]["what"] in ("value", "state", "raises")
    ops = behaviour["ops"]
    # the shortest: two adds, the first removed (pop(0), remove, discard), then a use of the stale index of the second
    assert len(ops) == 4 and [n for n, _ in ops[:2]] == ["add", "add"], ops
    assert ops[2] in (["pop_at", [0]], ["pop_at", [-2]], ["remove", ops[0][1]], ["discard", ops[0][1]]), ops
    assert ops[3][0] in ("index", "discard", "remove", "pop_at") and ops[3][1] in ([ops[1][1][0]], [0], [-1]), ops
    assert promise["failure"]["what"] == "promise" and promise["failure"]["want"] == "IndexError"
    assert promise["failure"]["got"].startswith("KeyError") and len(promise["ops"]) == 1
    found = []
    probe = Probe(root=tmp_path, sh=None, finding=lambda **kw: found.append(kw), measure=None, deadline=0,
                  package="pkg")
    for f in got["found"]:
        models.model_finding(probe, target, dict(f, why="is a collections.abc.MutableSet"), got["where"])
    assert found[0]["title"].startswith("`OrderedSet` does not behave like a set kept in insertion order: `s.")
    assert "from pkg.core import OrderedSet\n    s = OrderedSet()\n    s.add(" in found[0]["details"]
    assert found[0]["details"].startswith("`pkg.core.OrderedSet` is a collections.abc.MutableSet; driven")
    assert found[0]["file"] == "pkg/core.py" and found[0]["line"] == 4 and found[0]["category"] == "correctness"
    assert found[1]["title"] == "`OrderedSet.index` raises KeyError where its docstring says IndexError"
    assert found[1]["severity"] == "low"
    # each repro is a standalone script that exits 1 while the bug is there, 0 once it is fixed
    for f in found:
        code = f["repro_command"].split("\n", 1)[1].rsplit("\n", 1)[0]
        done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, cwd=tmp_path,
                              env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=60)
        assert done.returncode == 1, done.stdout + done.stderr
    fixed = ORDERED_SET.replace("REINDEX", "self.map = {k: i for i, k in enumerate(self.items)}").replace(
        "MISSING", "if key not in self.map:\n            raise IndexError(key)")
    assert [got for _, _, got in model_results(tmp_path, fixed)] == [{"found": [], "where": ["pkg/core.py", 4]}]


def test_a_collection_model_leaves_alone_what_the_class_means_to_do_otherwise(tmp_path):
    """A default for a missing key (`__missing__`), a set kept sorted rather than in insertion order, a sequence
    that refuses append and insert: none is a difference from the model."""
    results = model_results(tmp_path, FINE_COLLECTIONS)
    assert [(t, k) for t, k, _ in results] == [("pkg.core.Defaults", "dict"), ("pkg.core.Readings", "list"),
                                               ("pkg.core.SortedSet", "orderedset")]
    assert [got["found"] for _, _, got in results] == [[], [], []], results


KV_README = """# kv

A key-value store with a command line, an ordered set and a heart.

```pycon
>>> from kv import heart
>>> print(heart())
\u2764\ufe0f
```

```python
from kv import OrderedSet
s = OrderedSet([1, 2, 3]))
```

```console
$ pip install kv
$ tool set NAME alice@example.com
$ tool set AGE 42
$ tool list
NAME=alice@example.com
AGE=42
```
"""


KV_CLI = '''"""`tool set KEY VALUE` (says "saved KEY"), `tool list` (sorted keys): TOOL as a console script."""
import json
import os
import sys


def main():
    data = json.load(open("store.json")) if os.path.exists("store.json") else None
    if sys.argv[1] == "set":
        data = dict(data or {}, **{sys.argv[2]: sys.argv[3]})
        json.dump(data, open("store.json", "w"))
        print("saved", sys.argv[2])
    elif sys.argv[1] == "list":
        if data is None:
            sys.exit("no store here: run `tool set` first")
        for key in sorted(data):
            print(f"{key}={data[key]}")
'''


def test_the_checks_of_issue_41_on_a_real_git_repository(tmp_path):
    """The smoke persona, as `reviewer run` runs it, on one git repository holding what a real round missed or got
    wrong: a README shell session (`tool set` twice, then `tool list`) run in order, an example whose output differs
    in an invisible U+FE0F (escaped in the finding), a README block that is a SyntaxError, and an ordered set whose
    index map goes stale after pop(0) (caught against its model, with a shrunk repro that runs)."""
    stale = ORDERED_SET.replace("        REINDEX\n", "").replace("        MISSING\n", "")
    repo = make_repo(tmp_path / "kv", {
        "pyproject.toml": PYPROJECT.replace('"statly"', '"kv"').replace('statly = "statly.cli', 'tool = "kv.cli'),
        "README.md": KV_README,
        "kv/__init__.py": "from kv.oset import OrderedSet\n\n\ndef heart():\n    return '\\u2764'\n",
        "kv/oset.py": stale, "kv/cli.py": KV_CLI,
        "tests/test_kv.py": "from kv import heart\n\n\ndef test_heart():\n    assert heart()\n"})
    assert "tool = \"kv.cli:main\"" in (repo / "pyproject.toml").read_text()
    findings, _, ws = review(repo, tmp_path)
    try:
        titles = sorted(f.title for f in findings)
        by = {f.title: f for f in findings}
        # the session ran in order: `tool list` is judged on its output (sorted keys), never as failing alone
        assert not any("fails" in t or "crashes" in t for t in titles), titles
        listed = by["README.md: `tool list` prints something else than the docs show"]
        assert "after `tool set NAME alice@example.com`, `tool set AGE 42`" in listed.details
        assert "-NAME=alice@example.com\n-AGE=42\n+AGE=42\n+NAME=alice@example.com" in listed.details \
            or "+AGE=42\n NAME=alice@example.com\n-AGE=42" in listed.details, listed.details
        # the invisible difference is escaped
        heart = by["README.md example `print(heart())` gives \u2764, the docs say \u2764\\ufe0f"]
        assert "-\u2764\\ufe0f\n+\u2764" in heart.details
        # the block that does not parse is a finding with its line
        assert "README.md:13: a Python example does not parse (unmatched ')')" in titles, titles
        # the ordered set against its model, with a shrunk repro that fails while the bug is there
        model = next(f for f in findings if f.title.startswith("`OrderedSet` does not behave like a set kept in "
                                                                "insertion order"))
        assert model.file == "kv/oset.py" and "s = OrderedSet()" in model.details
        assert model.details.count("\n    s.") <= 4, model.details  # shrunk: at most four operations
        assert "`OrderedSet.index` raises KeyError where its docstring says IndexError" in titles
        for f in findings:
            assert ws.run(f.repro_command, 120).exit_code != 0, f.title
    finally:
        ws.remove()


def test_what_a_round_on_real_projects_showed_the_docs_and_model_probes(tmp_path):
    """Seen on python-dotenv and ordered-set: IPython's `%load_ext dotenv` in a python block is a magic, not a
    SyntaxError; docs/index.md that is the README again is read once (each finding had come twice); "raising an
    IndexError if ..." is a promise; and a class with many methods still gets sequences that grow it (with adds one
    operation in a dozen, the collection seldom held the two elements a stale index needs)."""
    from reviewer.persona.probes.sandboxed.syntax import syntax_errors
    from reviewer.persona.probes.sandboxed.models import promised, random_ops

    magic = {"file": "README.md", "line": 1, "doctest": False, "lang": "python",
             "text": "%load_ext dotenv\n%dotenv -o\n"}
    assert syntax_errors([magic]) == []
    assert [e["msg"] for e in syntax_errors([dict(magic, text="x = 5 %\n")])] == ["invalid syntax"]
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# pkg\n\n```python\nprint(1)\n```\n")
    (tmp_path / "docs" / "index.md").write_text("# pkg\n\n```python\nprint(1)\n```\n")
    (tmp_path / "docs" / "usage.md").write_text("# usage\n")
    assert [p.relative_to(tmp_path).as_posix() for p in doctext.doc_files(tmp_path)] == ["README.md", "docs/usage.md"]
    assert promised("Get the index of a given entry, raising an IndexError if it's not present.") == {
        "IndexError"}
    names = ["add", "discard", "remove", "pop", "pop_at", "index", "__contains__", "clear", "__getitem__", "copy"]
    ops = random_ops("orderedset", names, [0, 1, 2], random.Random(1), 3000)
    adds = sum(name == "add" for name, _ in ops) / len(ops)
    assert adds > 0.3, adds


def test_slips_of_the_prompts_are_not_syntax_errors(tmp_path):
    """Seen on addict and simpleeval: continuation lines written with `>>>` (a class body), a call's second line
    without `...` (doctest takes it for output), two spaces after `>>>`. The code is right as a reader copies it, and
    "Python cannot run it" was false; an extra `)` beside them still is a finding."""
    from reviewer.persona.probes.sandboxed.syntax import syntax_errors

    rst = """.. code-block:: pycon

    >>> class NoDefault(Dict):
    >>>     def __missing__(self, key):
    >>>         raise KeyError(key)

    >>> simple_eval("'equal' if x == y else 'not equal'",
                    names={"x": 1, "y": 2})
    'not equal'

    >>>  simple_eval("foo.bar", names={"foo": {"bar": 42}})
    42

    >>> print(simple_eval("1 + 1")))
    2
"""
    (tmp_path / "README.rst").write_text(rst)
    blocks = [docs_claims.block_data(b) for b in doctext.all_blocks(tmp_path) if b.is_python]
    assert [(e["line"], e["msg"]) for e in syntax_errors(blocks)] == [(14, "unmatched ')'")]
