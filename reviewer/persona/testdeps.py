"""What a project's tests need beyond its install, as the project declares it elsewhere: tox.ini's test deps and the
requirements files they name, a PEP 735 dependency group, the pytest plugins its pytest config names, and the modules
its tests import that nothing installs; and the project's own test command. Pure file and text work; smoke.py
installs and runs them."""

from __future__ import annotations

import configparser
import re
import shlex
import sys
import tomllib
from pathlib import Path

# pytest options that plugins bring, and the plugin: a project's pytest config (addopts) often names them while only
# its tox.ini or CI installs the plugin; a fresh install that lacks it makes pytest stop before any test
PYTEST_PLUGIN_OPTIONS = {"--cov": "pytest-cov", "--no-cov": "pytest-cov", "--no-cov-on-fail": "pytest-cov",
                         "-n": "pytest-xdist", "--numprocesses": "pytest-xdist", "--dist": "pytest-xdist",
                         "--timeout": "pytest-timeout", "--benchmark": "pytest-benchmark",
                         "--reruns": "pytest-rerunfailures", "--mypy": "pytest-mypy",
                         "--doctest-plus": "pytest-doctestplus", "--randomly-seed": "pytest-randomly",
                         "--asyncio-mode": "pytest-asyncio", "--mpl": "pytest-mpl", "--snapshot-update": "syrupy"}
TEST_GROUPS = ("test", "tests", "testing", "dev")  # PEP 735 dependency groups that hold what the tests need


def tox_deps_lines(root: Path) -> list[str]:
    """The lines of tox.ini's [testenv] deps, comments removed."""
    path = root / "tox.ini"
    if not path.is_file():
        return []
    cfg = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        cfg.read_string(path.read_text(errors="replace"))
    except configparser.Error:
        return []
    lines = (line.split(" #")[0].strip() for line in cfg.get("testenv", "deps", fallback="").splitlines())
    return [line for line in lines if line]


def tox_test_deps(root: Path) -> list[str]:
    """The plain requirements of tox.ini's [testenv] deps (the test environment a project declares there), leaving
    out factor-conditional lines, substitutions and pip options."""
    deps = []
    for line in tox_deps_lines(root):
        if re.fullmatch(r"[A-Za-z0-9][\w.-]*(\[[\w,.-]+\])?\s*([<>=!~]=?\s*[\w.*+!-]+\s*,?\s*)*", line):
            deps.append(line)
    return deps


def tox_requirement_files(root: Path) -> list[str]:
    """The requirements files tox.ini's [testenv] deps name (`-r test_requirements.txt`, `-r{toxinidir}/req.txt`) and
    the repository has: funcy's tests need `whatever`, which only its tox.ini's `-r test_requirements.txt` installs."""
    found = []
    for line in tox_deps_lines(root):
        m = re.fullmatch(r"(?:-r|--requirement)\s*=?\s*(?:\{toxinidir\}/)?(\S+)", line)
        if not m or "{" in m.group(1):
            continue
        name = m.group(1)
        try:
            inside = (root / name).resolve().is_relative_to(root.resolve())
        except OSError:
            inside = False
        if inside and (root / name).is_file() and name not in found:
            found.append(name)
    return found


def dependency_groups(root: Path) -> dict:
    """pyproject.toml's PEP 735 [dependency-groups] table ({} if none or unreadable)."""
    try:
        groups = tomllib.loads((root / "pyproject.toml").read_text()).get("dependency-groups", {})
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}
    return groups if isinstance(groups, dict) else {}


def dependency_group(root: Path) -> str | None:
    """A PEP 735 dependency group of pyproject.toml that holds the tests' needs (test, tests, testing, dev)."""
    groups = dependency_groups(root)
    return next((g for g in TEST_GROUPS if g in groups), None)


def group_requirements(groups: dict, name: str, seen: frozenset = frozenset()) -> list[str]:
    """The requirement strings of a dependency group, its `{include-group = "..."}` entries expanded. pip learned
    `--group` only in 25.1 and a sandbox's fresh venv has the pip its Python bundles (tinydb's `dev` group "did not
    install: no such option: --group"), so smoke installs the strings themselves."""
    found = []
    for item in groups.get(name, []) if name not in seen else []:
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict) and isinstance(item.get("include-group"), str):
            found += group_requirements(groups, item["include-group"], seen | {name})
    return list(dict.fromkeys(found))


def plugins_for_options(output: str) -> list[str]:
    """The plugins that bring the options pytest rejected ('unrecognized arguments: --cov=x ...'), as far as known."""
    m = re.search(r"unrecognized arguments?: (.*)", output)
    found = []
    for arg in (m.group(1).split() if m else []):
        flag = arg.split("=")[0]
        plugin = next((p for opt, p in PYTEST_PLUGIN_OPTIONS.items() if flag == opt or flag.startswith(opt + "-")), None)
        if plugin and plugin not in found:
            found.append(plugin)
    return found


def declared_setup(root: Path) -> list[tuple[str, str]]:
    """(what, pip command) for what the project declares its tests need beyond its extras: a dependency group,
    tox.ini's test deps and the requirements files they name. Smoke runs them before the tests; verification before a repro that runs pytest."""
    steps = []
    group = dependency_group(root)
    requirements = group_requirements(dependency_groups(root), group) if group else []
    if requirements:
        steps.append((f"the `{group}` dependency group",
                      "python -m pip install " + " ".join(shlex.quote(r) for r in requirements)))
    deps = tox_test_deps(root)
    if deps:
        steps.append((f"tox.ini's test deps ({', '.join(deps)})",
                      "python -m pip install " + " ".join(shlex.quote(d) for d in deps)))
    for name in tox_requirement_files(root):
        steps.append((f"tox.ini's test requirements ({name})", f"python -m pip install -r {shlex.quote(name)}"))
    return steps


def project_test_commands(root: Path) -> list[str]:
    """The project's own ways to run its tests, for when pytest cannot: tox.ini's [testenv] commands (roman's
    `zope-testrunner --test-path=src {posargs:-vc}`, its `{posargs:X}` as X) and a Makefile's `test` target (toposort's
    `make -B test`: its test module calls `unittest.main()` on import, which stops pytest's collection)."""
    found = []
    path = root / "tox.ini"
    if path.is_file():
        cfg = configparser.ConfigParser(interpolation=None, strict=False)
        try:
            cfg.read_string(path.read_text(errors="replace"))
            commands = cfg.get("testenv", "commands", fallback="")
        except configparser.Error:
            commands = ""
        for line in (x.strip() for x in commands.splitlines()):
            line = re.sub(r"\{posargs(?::([^}]*))?\}", lambda m: m.group(1) or "", line)
            line = line.replace("{toxinidir}", ".").strip()
            # one plain command a fresh venv can run: no factor (`py38: ...`), substitution left or tox-only prefix
            if line and not re.match(r"^[\w.-]+:\s", line) and "{" not in line and not line.startswith(("-", "!")):
                found.append(line)
                break
    makefile = root / "Makefile"
    if makefile.is_file() and re.search(r"^test\s*:", makefile.read_text(errors="replace"), re.M):
        found.append("make -B test")  # -B: a `test/` folder would make a target without prerequisites "up to date"
    return found


# import names whose distribution on PyPI is named otherwise (the common ones; anything else is tried as named)
MODULE_DISTRIBUTIONS = {"yaml": "PyYAML", "PIL": "Pillow", "sklearn": "scikit-learn", "cv2": "opencv-python",
                        "bs4": "beautifulsoup4", "dateutil": "python-dateutil", "attr": "attrs", "jwt": "PyJWT",
                        "Crypto": "pycryptodome", "dns": "dnspython", "git": "GitPython", "serial": "pyserial",
                        "OpenSSL": "pyOpenSSL", "dotenv": "python-dotenv", "magic": "python-magic"}
# where a project names what its tests need, read as text
DECLARING_SUFFIXES = (".txt", ".in", ".toml", ".cfg", ".ini", ".yml", ".yaml")
DECLARING_NAMES = ("setup.py", "noxfile.py", "Makefile", "Pipfile")


def distribution(module: str) -> str:
    """The PyPI distribution to install for an import name."""
    return MODULE_DISTRIBUTIONS.get(module, module)


def missing_test_modules(output: str, root: Path) -> list[str]:
    """The third-party modules pytest could not import while collecting the tests ('E   ModuleNotFoundError: No
    module named 'nose2''), leaving out the standard library and the repository's own modules (dpath's tests import
    nose2, which neither its install nor anything in its sdist brings)."""
    found = []
    for name in re.findall(r"^E\s+ModuleNotFoundError: No module named '([\w.]+)'", output, re.MULTILINE):
        top = name.split(".")[0]
        local = any((base / top).is_dir() or (base / f"{top}.py").is_file()
                    for base in (root, root / "src", root / "tests", root / "test"))
        if top not in sys.stdlib_module_names and not local and top not in found:
            found.append(top)
    return found


def named_in_repository(root: Path, distribution: str) -> str | None:
    """The first file (relative path) that names `distribution` where requirements live (requirements files,
    pyproject, setup.py, tox.ini, CI workflows, a Makefile), or None."""
    word = re.compile(rf"(?<![\w-]){re.escape(distribution).replace('-', '[-_]').replace('_', '[-_]')}(?![\w-])",
                      re.IGNORECASE)
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if ".git" in rel.parts or not path.is_file() or len(rel.parts) > 4:
            continue
        if path.suffix not in DECLARING_SUFFIXES and path.name not in DECLARING_NAMES:
            continue
        try:
            if path.stat().st_size < 1_000_000 and word.search(path.read_text(errors="replace")):
                return str(rel)
        except OSError:
            continue
    return None
