"""The smoke persona on real repositories: really installs into a fresh venv, really runs the tests, stores what it
finds in a real SQLite database through the same recorder `reviewer run` uses."""

import json
import shutil
from pathlib import Path

import pytest
from sqlmodel import select

from reviewer.examples import git, make_example_repo
from reviewer.persona.pytest_output import pytest_counts
from reviewer.persona.smoke import detect, importtime_us, run_smoke
from reviewer.run.recorder import DbRecorder
from reviewer.sandbox.workspace import create_workspace, resolve_target
from reviewer.store import db
from reviewer.store.db import Finding, Measurement, PersonaRun, ReviewRun


def make_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(content)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    return path


def smoke_review(repo: Path, tmp_path: Path, timeout: float = 300):
    """Run smoke on `repo` as `reviewer run` would; returns (result, findings, measurements, persona row, workspace)."""
    dbp = str(tmp_path / "reviews.db")
    target = resolve_target(str(repo))
    with db.session(dbp) as s:
        repository = db.get_or_create_repository(s, target.url)
        run = ReviewRun(repository_id=repository.id, commit_sha=target.commit)
        s.add(run)
        s.flush()
        prun = PersonaRun(run_id=run.id, persona="smoke")
        s.add(prun)
        s.commit()
    recorder = DbRecorder(dbp, run.id, prun.id, "smoke")
    ws = create_workspace(target, parent=tmp_path / "work", name="smoke")
    steps = []
    result = run_smoke(ws, recorder, timeout=timeout, probes=False,  # the probes: tests/reviewer/persona/test_probes.py
                       on_step=lambda step, tool, detail: steps.append((step, detail)))
    assert [s for s, _ in steps] == list(range(1, result.steps + 1))
    with db.session(dbp) as s:
        findings = s.exec(select(Finding).where(Finding.run_id == run.id)).all()
        measurements = {m.name: m for m in s.exec(select(Measurement).where(Measurement.run_id == run.id)).all()}
        prow = s.get(PersonaRun, prun.id)
    return result, findings, measurements, prow, ws


def test_smoke_on_the_example_project(tmp_path):
    repo = make_example_repo(tmp_path / "tinystats")
    result, findings, measurements, prow, ws = smoke_review(repo, tmp_path)
    try:
        assert result.status == "completed", result
        assert "python project (pyproject.toml)" in result.summary
        assert "1 failed, 7 passed" in result.summary
        # The deliberate defect the example's own test suite catches, with its id, counts and a repro command.
        assert len(findings) == 1, [f.title for f in findings]
        f = findings[0]
        assert f.severity == "high" and f.category == "tests"
        assert f.title == "1 of 8 tests fail (tests/test_core.py::test_percentile_unsorted)"
        assert "1 failed, 7 passed" in f.details
        assert "FAILED tests/test_core.py::test_percentile_unsorted" in f.evidence
        assert "assert 3 == 5" in f.evidence  # pytest's own explanation of the failure
        assert f.file == "tests/test_core.py" and f.line == 23
        assert f.repro_command == "python -m pytest -x tests/test_core.py::test_percentile_unsorted"
        # The repro command really reproduces it, in the workspace the finding came from.
        again = ws.run(f.repro_command, 120)
        assert again.exit_code == 1 and "1 failed" in again.output
        # Measurements: install and test times, and the import time with its repeats.
        assert set(measurements) == {"install time", "test suite time", "import time (tinystats)"}
        assert 0 < measurements["install time"].value < 300 and measurements["install time"].unit == "s"
        assert measurements["install time"].command == "python -m pip install -e '.[test]'"
        imp = measurements["import time (tinystats)"]
        assert imp.unit == "ms" and imp.repeats == 5 and len(json.loads(imp.samples)) == 5
        assert 0 < imp.value < 1000 and imp.spread is not None
        # The transcript was saved, in OpenAI message shape, with the real tool output.
        transcript = json.loads(prow.transcript)
        assert prow.steps == result.steps and len(transcript) == 2 * result.steps
        assert transcript[-1]["role"] == "tool" and "FAILED tests/test_core.py::test_percentile_unsorted" in transcript[-1]["content"]
    finally:
        ws.remove()


def test_broken_install_is_a_critical_finding(tmp_path):
    repo = make_repo(tmp_path / "broken", {"pyproject.toml": "[project\nname = 'broken'\n", "broken/__init__.py": ""})
    result, findings, measurements, _, ws = smoke_review(repo, tmp_path)
    ws.remove()
    assert result.status == "completed"
    assert [(f.severity, f.title) for f in findings] == [("critical", "Install fails in a fresh virtual environment")]
    assert findings[0].repro_command == "python -m pip install -e ."
    assert "TOMLDecodeError" in findings[0].details  # the line that says why, not pip's traceback
    assert "TOMLDecodeError" in findings[0].evidence
    assert "install time (failed)" in measurements and "test suite time" not in measurements


def test_no_tests_is_a_finding(tmp_path):
    repo = make_repo(tmp_path / "untested", {
        "pyproject.toml": '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
                          '[project]\nname = "untested"\nversion = "0.1"\n',
        "untested/__init__.py": "VALUE = 1\n",
    })
    result, findings, measurements, _, ws = smoke_review(repo, tmp_path)
    ws.remove()
    assert [(f.severity, f.title) for f in findings] == [("medium", "No tests found")]
    assert "install time" in measurements and "import time (untested)" in measurements


SETUPTOOLS = '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'


def test_unittest_tests_inside_the_package_are_found_and_run(tmp_path):
    """Seen on pytimeparse: its tests are pytimeparse/tests/testtimeparse.py, unittest's (nose's) naming, inside the
    package. They were 'No tests found' (only a top-level tests/ counted), and pytest's test_*.py pattern misses the
    file; `python -m unittest discover` runs them, and its failures are the finding."""
    repo = make_repo(tmp_path / "nested", {
        "pyproject.toml": SETUPTOOLS + '[project]\nname = "nested"\nversion = "0.1"\n'
                                       '[tool.setuptools]\npackages = ["nested", "nested.tests"]\n',
        "nested/__init__.py": "def double(x):\n    return x * 2\n",
        "nested/tests/__init__.py": "",
        "nested/tests/testdouble.py": "import unittest\nfrom .. import double\n\n\nclass TestDouble(unittest.TestCase):\n"
                                      "    def test_two(self):\n        self.assertEqual(double(2), 4)\n\n"
                                      "    def test_bad(self):\n        self.assertEqual(double(3), 7)\n",
    })
    result, findings, measurements, _, ws = smoke_review(repo, tmp_path)
    ws.remove()
    assert [(f.severity, f.title, f.repro_command) for f in findings] == [
        ("high", "1 of 2 tests fail (nested.tests.testdouble.TestDouble.test_bad)", "python -m unittest discover")]
    assert "AssertionError: 6 != 7" in findings[0].evidence
    assert measurements["test suite time"].command == "python -m unittest discover"
    # jsonpatch: tests.py at the top (its pytest.ini names it in python_files), once "No tests found"
    repo = make_repo(tmp_path / "flat", {
        "pyproject.toml": SETUPTOOLS + '[project]\nname = "flat"\nversion = "0.1"\n',
        "flat.py": "def double(x):\n    return x * 2\n",
        "pytest.ini": "[pytest]\npython_files = tests.py\n",
        "tests.py": "from flat import double\n\n\ndef test_two():\n    assert double(2) == 4\n"})
    result, findings, _, _, ws = smoke_review(repo, tmp_path / "flat-review")
    ws.remove()
    assert findings == [] and "tests pass (1 passed" in result.summary, ([f.title for f in findings], result.summary)


def test_tests_that_need_a_locale_the_machine_lacks_are_not_failing_tests(tmp_path):
    """Seen on natsort: 59 of its tests set en_US.UTF-8 or de_DE.UTF-8 in a fixture, and a machine without those
    locales errors on each; that says nothing about the project (an info finding, as a missing tool is). A real
    failure beside them is still the finding, counted without them."""
    repo = make_repo(tmp_path / "localized", {
        "pyproject.toml": SETUPTOOLS + '[project]\nname = "localized"\nversion = "0.1"\n',
        "localized/__init__.py": "def one():\n    return 1\n",
        "tests/test_one.py": "import locale\n\nimport pytest\n\nfrom localized import one\n\n\n"
                             "@pytest.fixture()\ndef klingon():\n    locale.setlocale(locale.LC_ALL, 'tlh_XX.UTF-8')\n\n\n"
                             "def test_sorted(klingon):\n    assert one() == 1\n\n\n"
                             "def test_formatted():\n    locale.setlocale(locale.LC_ALL, 'tlh_XX.UTF-8')\n\n\n"
                             "def test_one():\n    assert one() == 1\n\n\n"
                             "def test_two():\n    assert one() == 2\n",
    })
    result, findings, measurements, _, ws = smoke_review(repo, tmp_path)
    ws.remove()
    assert [(f.severity, f.title) for f in findings] == [
        ("info", "Not tested: 2 tests need a locale this machine does not have"),
        ("high", "1 of 2 tests fail (tests/test_one.py::test_two)")], [f.title for f in findings]
    assert "::test_sorted" in findings[0].details and "::test_formatted" in findings[0].details
    assert "locale.Error: unsupported locale setting" in findings[0].evidence
    assert "test_two" not in findings[0].details and "test_one.py::test_two" in findings[1].details


def test_pytest_plugins_the_config_needs_are_installed_not_reported(tmp_path):
    """A project whose pytest config names plugins (addopts = --timeout=60 --reruns=0) its install does not bring:
    smoke installs what tox.ini's testenv lists (pytest-timeout), then, on pytest's usage error, the plugin behind
    the option it still rejects (pytest-rerunfailures), so the tests run (semver's --cov, seen on a real project,
    was a false 'pytest fails' finding before)."""
    repo = make_repo(tmp_path / "plugged", {
        "pyproject.toml": '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
                          '[project]\nname = "plugged"\nversion = "0.1"\n'
                          '[tool.pytest.ini_options]\naddopts = "--timeout=60 --reruns=0"\n',
        "tox.ini": "[testenv]\ndeps =\n    pytest\n    pytest-timeout\n    py38: oldthing\n    -rrequirements.txt\n"
                   "commands = pytest\n",
        "plugged/__init__.py": "def one():\n    return 1\n",
        "tests/test_one.py": "from plugged import one\n\n\ndef test_one():\n    assert one() == 1\n",
    })
    result, findings, measurements, _, ws = smoke_review(repo, tmp_path)
    ws.remove()
    assert findings == [] and "1 passed" in result.summary, (result.summary, [f.title for f in findings])
    assert "installed tox.ini's test deps (pytest, pytest-timeout)" in result.summary
    assert "pytest's config needs pytest-rerunfailures, which the install does not bring; installed" in result.summary
    assert "test suite time" in measurements


def test_a_module_the_tests_import_and_nothing_installs(tmp_path):
    """dpath's tests import nose2, which neither its install nor anything in its sdist brings: pytest stops while
    collecting, and smoke said "6 of 6 tests fail". Now it installs the module and runs the tests again; that nothing
    in the repository names it is a low finding of its own (its repro still fails in a fresh install), and a module a
    CI workflow installs is a note. six stands in for nose2 (small, on PyPI, not in a fresh venv)."""
    from reviewer.persona.testdeps import distribution, missing_test_modules

    files = {"pyproject.toml": '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
                               '[project]\nname = "needy"\nversion = "0.1"\n',
             "needy/__init__.py": "def one():\n    return 1\n",
             "tests/test_one.py": "import six\nfrom needy import one\n\n\ndef test_one():\n    assert one() == 1\n"}
    repo = make_repo(tmp_path / "needy", files)
    # the standard library and the repository's own modules are never installed from PyPI; yaml is PyYAML there
    output = "\n".join(f"E   ModuleNotFoundError: No module named '{m}'" for m in ("os.missing", "needy.sub", "yaml"))
    assert missing_test_modules(output, repo) == ["yaml"] and distribution("yaml") == "PyYAML"
    result, findings, _, _, ws = smoke_review(repo, tmp_path)
    ws.remove()
    titles = [(f.severity, f.title) for f in findings]
    assert titles == [("low", "The tests need six, which nothing in the repository declares")], (titles, result.summary)
    assert findings[0].repro_command == "python -m pytest --collect-only -q tests/test_one.py"
    assert "1 passed" in findings[0].details and "No module named 'six'" in findings[0].evidence
    assert "1 passed" in result.summary
    files[".github/workflows/ci.yml"] = "jobs:\n  test:\n    steps:\n      - run: pip install -e . six pytest\n"
    result, findings, _, _, ws = smoke_review(make_repo(tmp_path / "named", files), tmp_path / "second")
    ws.remove()
    assert findings == [] and "1 passed" in result.summary, ([f.title for f in findings], result.summary)
    assert "the tests import six (named in .github/workflows/ci.yml), which the install does not bring; installed" \
        in result.summary


def test_what_the_tests_need_beyond_the_install(tmp_path):
    from reviewer.persona.project import python_metadata
    from reviewer.persona.testdeps import declared_setup, dependency_group, plugins_for_options, tox_test_deps

    (tmp_path / "tox.ini").write_text("[tox]\nenvlist = py3\n[testenv]\ndeps =\n    pytest>=7, <9\n    pytest-cov\n"
                                      "    {[base]deps}\n    py37: mock\n    coverage[toml] # for reports\n")
    assert tox_test_deps(tmp_path) == ["pytest>=7, <9", "pytest-cov", "coverage[toml]"]
    # funcy: `deps = -r test_requirements.txt` is where its tests' `whatever` comes from; files it lacks are left out
    (tmp_path / "test_requirements.txt").write_text("whatever==0.7\n")
    (tmp_path / "tox.ini").write_text("[testenv]\ndeps =\n    -r test_requirements.txt\n    -r{toxinidir}/missing.txt\n"
                                      "    -r ../outside.txt\n    pytest\n")
    (tmp_path.parent / "outside.txt").write_text("evil\n")
    assert declared_setup(tmp_path) == [("tox.ini's test deps (pytest)", "python -m pip install pytest"),
                                        ("tox.ini's test requirements (test_requirements.txt)",
                                         "python -m pip install -r test_requirements.txt")]
    out = ("ERROR: usage: python -m pytest [options]\npython -m pytest: error: unrecognized arguments: --no-cov-on-fail "
           "--cov=semver --cov-report=term-missing -n 4 --frobnicate\n  inifile: setup.cfg")
    assert plugins_for_options(out) == ["pytest-cov", "pytest-xdist"]  # unknown options are left alone
    assert plugins_for_options("error: unrecognized arguments: --timeout=5 --numprocesses=2") == [
        "pytest-timeout", "pytest-xdist"]
    assert dependency_group(tmp_path) is None
    (tmp_path / "pyproject.toml").write_text('[dependency-groups]\ndocs = ["sphinx"]\ndev = ["pytest"]\n')
    assert dependency_group(tmp_path) == "dev"
    # the group's requirements themselves, its includes expanded (a sandbox's pip may predate `--group`)
    (tmp_path / "tox.ini").unlink()
    (tmp_path / "pyproject.toml").write_text(
        '[dependency-groups]\ntest = ["pytest>=8", {include-group = "cov"}, {include-group = "test"}]\n'
        'cov = ["pytest-cov", "coverage[toml] >= 7"]\n')
    assert declared_setup(tmp_path) == [("the `test` dependency group",
                                         "python -m pip install 'pytest>=8' pytest-cov 'coverage[toml] >= 7'")]
    (tmp_path / "setup.py").write_text("from setuptools import setup\nsetup(name='toolz', version='1.0')\n")
    assert python_metadata(tmp_path)[0] == "toolz"  # pyproject names no project: setup.py's literal name


def test_makefile_project(tmp_path):
    repo = make_repo(tmp_path / "made", {
        "Makefile": "all:\n\techo building\n\ncheck:\n\t@echo 'checking'; exit 2\n",
    })
    assert detect(repo) == [("make", "Makefile")]
    result, findings, measurements, _, ws = smoke_review(repo, tmp_path)
    ws.remove()
    assert [(f.severity, f.title, f.repro_command) for f in findings] == [("high", "Tests fail", "make check")]
    assert "checking" in findings[0].evidence
    assert set(measurements) == {"build time", "test suite time"}


@pytest.mark.skipif(not shutil.which("cargo"), reason="cargo is not installed")
def test_rust_project_failing_test_is_named(tmp_path):
    repo = make_repo(tmp_path / "crate", {
        "Cargo.toml": '[package]\nname = "crate"\nversion = "0.1.0"\nedition = "2021"\n',
        "src/lib.rs": "pub fn add(a: i32, b: i32) -> i32 { a - b }\n#[cfg(test)]\nmod tests {\n"
                      "    #[test] fn adds() { assert_eq!(super::add(2, 2), 4); }\n"
                      "    #[test] fn zero() { assert_eq!(super::add(0, 0), 0); }\n}\n",
    })
    result, findings, _, _, ws = smoke_review(repo, tmp_path)
    ws.remove()
    assert [(f.title, f.repro_command) for f in findings] == [("Tests fail (tests::adds)", "cargo test")]


def test_pytest_summary_and_importtime_parsing():
    # Real lines from pytest 8/9 and CPython 3.11's -X importtime.
    assert pytest_counts("....F\n1 failed, 7 passed in 0.05s\n") == {"failed": 1, "passed": 7}
    assert pytest_counts("==== 2 passed, 1 skipped, 3 errors in 1.20s ====") == {"passed": 2, "skipped": 1, "errors": 3}
    assert pytest_counts("no tests ran in 0.01s") == {}
    out = ("import time:       161 |        161 |       _json\n"
           "import time:       246 |       1517 | json\n"
           "import time:       300 |        900 |   json.tool\n")
    assert importtime_us(out, "json") == 1517
    assert importtime_us(out, "json.tool") is None  # only the top-level line counts


def wheel(folder: Path, name: str, version: str, files: dict[str, str], requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel made by hand (no build, no network): what a registry's release would be."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    contents = {**files, f"{info}/METADATA": meta,
                f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    contents[f"{info}/RECORD"] = "".join(f"{p},,\n" for p in contents) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for rel, text in contents.items():
            z.writestr(rel, text)
    return path


SCM_PROJECT = {
    "pyproject.toml": '[build-system]\nrequires = ["setuptools>=64", "setuptools-scm>=8"]\n'
                      'build-backend = "setuptools.build_meta"\n[project]\nname = "scmproj"\ndynamic = ["version"]\n'
                      '[tool.setuptools_scm]\n',
    "src/scmproj/__init__.py": 'WHERE = "checkout"\n',
    "tests/test_where.py": 'import scmproj\n\n\ndef test_the_checkout_is_under_test():\n'
                           '    assert scmproj.WHERE == "checkout"\n',
    # the project's own test dependency requires the project at >=2; both wheels lie in the repository
    "requirements-test.txt": "--no-index\n--find-links wheels\nscmdep\n",
}


def test_the_code_under_test_is_the_checkouts(tmp_path):
    """Seen on a real project: a tagless clone gets setuptools-scm's version 0.1.dev1, and a test dependency that
    requires the project at >=2 made pip replace the editable install with the registry's release; the tests then
    ran against site-packages and nothing said so. Now smoke checks where the package imports from after each
    install step and installs the checkout again, as the version of the release pip chose (it satisfies the
    dependents), so the tests run against the checkout."""
    repo = tmp_path / "scmproj"
    wheel(repo / "wheels", "scmdep", "1.0", {"scmdep/__init__.py": ""}, requires=("scmproj>=2",))
    wheel(repo / "wheels", "scmproj", "2.5", {"scmproj/__init__.py": 'WHERE = "release"\n'})
    repo = make_repo(repo, SCM_PROJECT)
    result, findings, measurements, _, ws = smoke_review(repo, tmp_path)
    try:
        assert findings == [], ([f.title for f in findings], result.summary)
        assert "1 passed" in result.summary, result.summary
        assert "after the install, `import scmproj` came from" in result.summary
        assert "scmproj 2.5, not built from this checkout" in result.summary
        assert "installed the checkout again as version 2.5" in result.summary, result.summary
        redone = measurements["install time (the checkout's own code)"]
        assert redone.command == "SETUPTOOLS_SCM_PRETEND_VERSION=2.5 python -m pip install -e ."
        from reviewer.run.verify import setup_command

        with db.session(str(tmp_path / "reviews.db")) as s:  # verification installs the way it was redone
            assert setup_command(s, redone.run_id) == redone.command
        assert ws.run("python -I -c 'import scmproj; print(scmproj.WHERE)'", 60).output.strip() == "checkout"
    finally:
        ws.remove()


def test_a_run_that_cannot_test_the_checkout_says_so_in_every_finding(tmp_path):
    """A test dependency that ships a module of the project's name shadows the editable install (setuptools' editable
    finder comes after site-packages), and installing the checkout again does not remove it: the run is marked and
    its findings say that they are not about the checkout's code."""
    repo = tmp_path / "shadowed"
    wheel(repo / "wheels", "scmdep", "1.0", {"scmproj/__init__.py": 'WHERE = "release"\n'})
    files = dict(SCM_PROJECT, **{"pyproject.toml": SETUPTOOLS + '[project]\nname = "scmproj"\nversion = "3.0"\n'})
    repo = make_repo(repo, files)
    result, findings, _, _, ws = smoke_review(repo, tmp_path)
    ws.remove()
    assert "NOT THE CHECKOUT'S CODE: this run did not test the checkout's own code" in result.summary, result.summary
    assert [f.title for f in findings] == ["1 of 1 tests fail (tests/test_where.py::test_the_checkout_is_under_test)"]
    assert all("Warning: this run did not test the checkout's own code: after the install, `import scmproj` comes "
               "from" in f.details for f in findings), [f.details for f in findings]


def test_a_tagless_clone_of_an_sdist_is_installed_as_its_version(tmp_path):
    """A repository made from an sdist keeps PKG-INFO at the top: its version is used before the install, so the
    project is never 0.1.dev1 at all; the egg-info an install writes is not read (it holds that 0.1.dev1)."""
    from reviewer.persona.checkout import version_before_install

    repo = make_repo(tmp_path / "sdist", {**SCM_PROJECT, "PKG-INFO": "Metadata-Version: 2.1\nName: scmproj\n"
                                          "Version: 4.2.0\n", "src/scmproj.egg-info/PKG-INFO": "Version: 0.1.dev1\n"})
    assert version_before_install(repo, str(repo)) == ("4.2.0", "PKG-INFO")
    (repo / "PKG-INFO").unlink()
    assert version_before_install(repo, str(repo)) is None  # nothing says: the check after the install decides
    git(repo, "tag", "v3.1.0")
    assert version_before_install(repo, str(repo)) is None  # tagged: setuptools-scm reads the tag itself
    plain = make_repo(tmp_path / "plain", {"pyproject.toml": SETUPTOOLS + '[project]\nname = "p"\nversion = "1"\n',
                                           "PKG-INFO": "Version: 9\n"})
    assert version_before_install(plain, str(plain)) is None  # a static version needs nothing


def test_tests_pytest_cannot_run_are_run_the_projects_own_way(tmp_path):
    """Seen on toposort and roman: toposort's test module calls `unittest.main()` on import, which stops pytest's
    collection (exit code 3), and its Makefile's `test` target runs them (pass); roman's tests run with
    zope-testrunner, as its tox.ini's commands say, and pytest collects none. Both were findings, both false."""
    from reviewer.persona.testdeps import project_test_commands

    files = {
        "pyproject.toml": SETUPTOOLS + '[project]\nname = "topo"\nversion = "0.1"\n',
        "topo.py": "def double(x):\n    return x * 2\n",
        "test/__init__.py": "",
        "test/test_topo.py": "import unittest\n\nfrom topo import double\n\n\nclass T(unittest.TestCase):\n"
                             "    def test_two(self):\n        self.assertEqual(double(2), 4)\n\n\nunittest.main()\n",
        "Makefile": "test:\n\tpython -m test.test_topo\n"}
    result, findings, measurements, _, ws = smoke_review(make_repo(tmp_path / "topo", files), tmp_path)
    ws.remove()
    assert findings == [], ([f.title for f in findings], result.summary)
    assert "pytest fails before running the tests (exit code 3); the project's own `make -B test` runs its tests " \
           "and passes" in result.summary, result.summary
    assert measurements["test suite time"].command == "make -B test"
    # when the project's own way fails too, what pytest said stands
    broken = dict(files, **{"topo.py": "def double(x):\n    return x * 3\n"})
    result, findings, _, _, ws = smoke_review(make_repo(tmp_path / "broken", broken), tmp_path / "b")
    ws.remove()
    assert [f.title for f in findings] == ["pytest fails before running the tests (exit code 3)"], result.summary
    # tox.ini's commands, their {posargs:...} as the default; factor lines and substitutions left out
    (tmp_path / "tox.ini").write_text("[testenv]\ndeps = zope.testrunner\ncommands =\n    py38: echo old\n"
                                      "    zope-testrunner --test-path=src {posargs:-vc}\n")
    assert project_test_commands(tmp_path) == ["zope-testrunner --test-path=src -vc"]
