"""Reading the docs: which files, their code blocks (Markdown and reStructuredText), the commands and Python examples
in them, and the sentences that claim something. Pure text work on the host; nothing here runs the project."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from reviewer.persona.probes.thresholds import MAX_DOC_BYTES, MAX_DOC_FILES, NOT_DOCS

DOC_SUFFIXES = (".md", ".markdown", ".rst", ".txt", "")
PYTHON_LANGS = {"python", "py", "python3", "pycon", "pytb", "ipython", "doctest", "pyrepl"}
SHELL_LANGS = {"", "bash", "sh", "shell", "console", "shell-session", "zsh", "terminal", "text", "none", "cli"}
# Pipeline stages that only shape text: a documented `echo x | tool | head` may run. Anything else in a documented
# command line (pip, git, curl, make, ...) sets up or fetches rather than uses the project, and is left alone.
TEXT_WORDS = {"echo", "printf", "cat", "head", "tail", "grep", "sort", "uniq", "wc", "cut", "tr", "jq"}
UNLABELED = {"", "text", "none"}
# First words of the lines of an untyped block that make it a block of commands.
COMMAND_WORDS = {"pip", "pip3", "pipx", "python", "python3", "py", "pytest", "uv", "conda", "git", "cd", "export",
                 "source", "make", "docker", "curl", "wget", "echo", "cat", "mkdir", "sudo", "apt", "apt-get", "brew",
                 "npm", "poetry", "tox", "nox"}
# A documented argument that stands for something the reader supplies.
PLACEHOLDER = re.compile(r"^<.*>$|^\[.*\]$|^\{.*\}$|^[A-Z][A-Z0-9_]{2,}$|path/to|your[-_]|my[-_]|\.\.\.|example\.(com|org)|^\$")


@dataclass
class Block:
    file: str  # relative to the repository root
    line: int  # first line of the block's content, 1-based
    lang: str
    text: str  # dedented content
    setup: bool = False  # Sphinx `.. testsetup::`: code the file's doctests run after, never shown to the reader

    @property
    def is_python(self) -> bool:
        return self.lang in PYTHON_LANGS or bool(re.search(r"^\s*>>> ", self.text, re.MULTILINE))

    @property
    def is_doctest(self) -> bool:
        return bool(re.search(r"^\s*>>> ", self.text, re.MULTILINE))


@dataclass
class Command:
    file: str
    line: int
    text: str  # the command line as documented (prompt removed, continuations joined)
    expected: str | None = None  # the output the docs show after it (only after a `$ ` prompt)
    argv: list[str] = field(default_factory=list)  # the stage that runs the project's script, split
    prompted: bool = False  # after a `$ ` prompt: one step of a shell session (its run is the session's, see Step)


@dataclass
class Step:
    """One `$ ` line of a documented shell session, as the session runs it."""

    line: int
    text: str  # as documented (prompt removed, continuations joined)
    expected: str | None  # the output the docs show after it
    kind: str  # project (runs the project: judged) | aux (cd, export, echo, ...: run, not judged) | setup (skipped)
    run: str | None  # the line as run, placeholders filled; None: it cannot run (what follows is not judged)
    filled: bool = False  # a value the reader supplies was filled in: a failure may be our value's, not judged


@dataclass
class Session:
    """A block of `$ ` lines: one shell, one working directory, in order (a `set` before a `list`)."""

    file: str
    line: int
    steps: list[Step]


def doc_files(root: Path) -> list[Path]:
    """README* at the top, then docs/ and doc/ (Markdown, reST, text), skipping changelogs and the like."""
    found = [p for p in sorted(root.iterdir()) if p.is_file() and p.name.lower().startswith("readme")
             and p.suffix.lower() in DOC_SUFFIXES]
    for folder in ("docs", "doc"):
        base = root / folder
        if base.is_dir():
            found += sorted(p for p in base.rglob("*") if p.is_file() and p.suffix.lower() in (".md", ".rst")
                            and not any(part.startswith((".", "_")) for part in p.relative_to(base).parts))
    found = [p for p in found if not NOT_DOCS.search(p.stem) and p.stat().st_size <= MAX_DOC_BYTES]
    # a docs page that is the README again (python-dotenv's docs/index.md) is read once: its findings are the same
    texts, unique = set(), []
    for p in found:
        body = p.read_bytes()
        if body not in texts:
            texts.add(body)
            unique.append(p)
    return unique[:MAX_DOC_FILES]


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def dedent(lines: list[str]) -> str:
    widths = [len(ln) - len(ln.lstrip()) for ln in lines if ln.strip()]
    cut = min(widths) if widths else 0
    return "\n".join(ln[cut:] for ln in lines).strip("\n") + "\n"


def blocks(path: Path, root: Path) -> list[Block]:
    rel = str(path.relative_to(root))
    lines = read(path).splitlines()
    return rst_blocks(rel, lines) if path.suffix.lower() == ".rst" else markdown_blocks(rel, lines)


def markdown_blocks(rel: str, lines: list[str]) -> list[Block]:
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*\{?\.?([\w+-]*)", lines[i])
        if m:
            fence, start = m.group(2), i + 1
            j = start
            while j < len(lines) and not lines[j].strip().startswith(fence):
                j += 1
            out.append(Block(rel, start + 1, m.group(3).lower(), dedent(lines[start:j])))
            i = j + 1
            continue
        # An indented block after a blank line (not inside a list item: those are indented prose).
        if lines[i].startswith("    ") and lines[i].strip() and (i == 0 or not lines[i - 1].strip()) and \
                not (i >= 2 and re.match(r"^\s*([-*+]|\d+\.)\s", lines[i - 2])):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            out.append(Block(rel, i + 1, "", dedent(lines[i:j])))
            i = j
            continue
        i += 1
    return out


def rst_blocks(rel: str, lines: list[str]) -> list[Block]:
    out: list[Block] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = re.match(r"^(\s*)\.\. (code-block|code|sourcecode|doctest|testcode|testsetup)::\s*(\S*)", line)
        literal = not directive and line.rstrip().endswith("::") and not line.lstrip().startswith("..")
        doctest_para = line.lstrip().startswith(">>> ") and (i == 0 or not lines[i - 1].strip())
        if not (directive or literal or doctest_para):
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        if doctest_para:  # a bare doctest paragraph: up to the next blank line
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            out.append(Block(rel, i + 1, "python", dedent(lines[i:j])))
            i = j
            continue
        setup = bool(directive) and directive.group(2) == "testsetup"
        if setup:
            lang = "python"  # its argument names doctest groups, not a language
        else:
            lang = (directive.group(3) or ("python" if directive.group(2) in ("doctest", "testcode") else "")).lower() \
                if directive else ""
        j = i + 1
        while j < len(lines) and re.match(r"^\s+:[\w-]+:", lines[j]):  # directive options
            j += 1
        start = j
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            j += 1
        body = lines[start:j]
        if any(ln.strip() for ln in body):
            first = next(k for k, ln in enumerate(body) if ln.strip())
            out.append(Block(rel, start + first + 1, lang, dedent(body), setup=setup))
        i = j
    return out


def text(root: Path) -> str:
    """All the doc files' text, prose and code."""
    return "\n".join(read(path) for path in doc_files(root))


def names(doc_text: str, target: str) -> bool:
    """Do the docs name `target` (`pkg.sub.mod.func`): the function's own name, or one of its modules under the
    package (`pkg.sub`, `pkg.sub.mod`)? What the docs name is the project's API, whatever the package exports."""
    parts = target.split(".")
    if re.search(rf"(?<![\w.]){re.escape(parts[-1])}(?!\w)", doc_text):
        return True
    return any(re.search(rf"(?<![\w.]){re.escape('.'.join(parts[:k]))}(?!\w)", doc_text)
               for k in range(2, len(parts)))


def all_blocks(root: Path) -> list[Block]:
    return [b for path in doc_files(root) for b in blocks(path, root)]


def commands(blocks_: list[Block], scripts: set[str], package: str | None) -> list[Command]:
    """Documented command lines that run the project: one of its console scripts, or `python -m` its package."""
    found: list[Command] = []
    for block in blocks_:
        if block.is_python or block.lang not in SHELL_LANGS:
            continue
        lines = block.text.splitlines()
        prompted = any(re.match(r"^\s*[$%] ", ln) for ln in lines)
        if not prompted and block.lang in UNLABELED and not all(
                looks_like_command(ln, scripts) for ln in lines if ln.strip() and not ln.strip().startswith("#")):
            continue  # an untyped block of output, a table, a help text: not commands
        k = 0
        while k < len(lines):
            raw, line_no = lines[k], block.line + k
            k += 1
            text = raw.strip()
            if prompted:
                if not re.match(r"^[$%] ", text):
                    continue
                text = text[2:].strip()
            while text.endswith("\\") and k < len(lines):  # continuation lines
                text = text[:-1].rstrip() + " " + lines[k].strip().removeprefix("> ")
                k += 1
            if not text or text.startswith("#"):
                continue
            argv = project_stage(text, scripts, package)
            if argv is None:
                continue
            expected = None
            if prompted:
                out = []
                while k < len(lines) and not re.match(r"^\s*[$%] ", lines[k]):
                    out.append(lines[k])
                    k += 1
                expected = "\n".join(out).strip() or None
            found.append(Command(block.file, line_no, text, expected, argv, prompted=prompted))
    return found


# Session lines that install, fetch or set up rather than use the project: skipped, and nothing after them depends on
# them (the review has installed the project already)
SETUP_WORDS = {"pip", "pip3", "pipx", "uv", "conda", "git", "curl", "wget", "make", "sudo", "apt", "apt-get", "brew",
               "npm", "poetry", "docker", "tox", "nox", "source", ".", "virtualenv", "pyenv", "hatch", "pdm"}
# Session lines run for their effect on the shell or the files, not judged
AUX_WORDS = TEXT_WORDS | {"cd", "export", "mkdir", "touch", "ls", "pwd", "cp", "mv", "rm", "unset", "set"}
# A value the reader supplies that a session keeps as written: an upper-case key (`tool set API_KEY value`), an e-mail
# or example.com address; they are strings to the command, and the output the docs show is for them
VERBATIM = re.compile(r"^[A-Z][A-Z0-9_]{2,}(=\S*)?$|^[\w.+-]+@[\w-]+(\.[\w-]+)+$|^[\w.-]*example\.(com|org)$")
ANGLE = re.compile(r"<([A-Za-z][\w-]*)>")


def fill(text: str) -> tuple[str | None, bool]:
    """(the line as a session runs it, whether a value was filled in): `<name>` becomes `name`, upper-case keys and
    example addresses stay as written; a path, URL or `...` to supply makes it None (it cannot run)."""
    run = ANGLE.sub(r"\1", text)
    try:
        tokens = shlex.split(run)
    except ValueError:
        return None, False
    filled = run != text
    for token in tokens:
        if VERBATIM.match(token):
            filled = True
        elif is_placeholder(token) or "://" in token:
            return None, False
    return run, filled


def sessions(blocks_: list[Block], scripts: set[str], package: str | None) -> list[Session]:
    """The documented shell sessions that run the project: blocks of `$ ` lines, every line a step."""
    found = []
    for block in blocks_:
        if block.is_python or block.lang not in SHELL_LANGS:
            continue
        lines = block.text.splitlines()
        if not any(re.match(r"^\s*[$%] ", ln) for ln in lines):
            continue
        steps, k = [], 0
        while k < len(lines):
            line_no, text = block.line + k, lines[k].strip()
            k += 1
            if not re.match(r"^[$%] ", text):
                continue
            text = text[2:].strip()
            while text.endswith("\\") and k < len(lines):
                text = text[:-1].rstrip() + " " + lines[k].strip().removeprefix("> ")
                k += 1
            out = []
            while k < len(lines) and not re.match(r"^\s*[$%] ", lines[k]):
                out.append(lines[k])
                k += 1
            if text and not text.startswith("#"):
                steps.append(step(line_no, text, "\n".join(out).strip() or None, scripts, package))
        if any(s.kind == "project" for s in steps):
            found.append(Session(block.file, block.line, steps))
    return found


def step(line: int, text: str, expected: str | None, scripts: set[str], package: str | None) -> Step:
    try:
        first = shlex.split(text)[0]
    except (ValueError, IndexError):
        return Step(line, text, expected, "aux", None)
    if first in SETUP_WORDS or (first.startswith("python") and re.match(r"\S+ -m (pip|venv)\b", text)):
        return Step(line, text, expected, "setup", None)
    kind = "project" if project_stage(text, scripts, package) is not None else "aux"
    if kind == "aux" and (first not in AUX_WORDS or re.search(r"\$\(|`", text)):
        return Step(line, text, expected, "aux", None)  # something we cannot tell is harmless: not run
    run, filled = fill(text)
    return Step(line, text, expected, kind, run, filled)


def project_stage(text: str, scripts: set[str], package: str | None) -> list[str] | None:
    """The argv of the pipeline stage that runs the project, or None when the line does not run it (or runs
    something that sets up, fetches, or that we cannot tell is harmless)."""
    bare = re.sub(r"'[^']*'|\"[^\"]*\"", "", text)  # what is outside quotes
    if re.search(r"[;&`()]|\$\(|>|<", bare.replace("->", "")):  # sequences, redirections, substitutions, a table row
        return None
    stages = []
    for stage in text.split("|"):
        try:
            stages.append(shlex.split(stage))
        except ValueError:
            return None
    if not stages or not all(stages):
        return None
    mine = None
    for argv in stages:
        word = argv[0]
        if word in scripts or (word in ("python", "python3") and len(argv) > 2 and argv[1] == "-m"
                               and package and argv[2].split(".")[0] == package):
            if mine is not None:
                return None
            mine = argv
        elif word not in TEXT_WORDS:
            return None
    return mine


def looks_like_command(line: str, scripts: set[str]) -> bool:
    word = line.strip().split()[0]
    return word in scripts or word in COMMAND_WORDS


def sentences(root: Path) -> list[tuple[str, int, str]]:
    """(file, line, sentence) of the prose in the doc files: code blocks left out."""
    out = []
    for path in doc_files(root):
        rel = str(path.relative_to(root))
        in_fence = False
        para: list[tuple[int, str]] = []
        for n, line in enumerate(read(path).splitlines(), start=1):
            if re.match(r"^\s*(`{3,}|~{3,})", line):
                in_fence = not in_fence
                continue
            if in_fence or line.startswith("    ") or line.lstrip().startswith(">>>"):
                continue
            if line.strip():
                para.append((n, line.strip()))
                continue
            out += split_sentences(rel, para)
            para = []
        out += split_sentences(rel, para)
    return out


def split_sentences(rel: str, para: list[tuple[int, str]]) -> list[tuple[str, int, str]]:
    if not para:
        return []
    text = " ".join(t for _, t in para)
    return [(rel, para[0][0], s.strip()) for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


def claims(sentences_: list[tuple[str, int, str]], pattern: re.Pattern, name: str | None = None) -> list[str]:
    """Sentences matching `pattern` (and naming `name` as a word, when given), as 'file:line: sentence'."""
    found = []
    for rel, line, s in sentences_:
        if pattern.search(s) and (name is None or re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", s)):
            found.append(f"{rel}:{line}: {s[:300]}")
    return found


def is_placeholder(token: str) -> bool:
    return bool(PLACEHOLDER.search(token))
