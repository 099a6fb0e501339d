"""The extra set's workload-shaped prompts (`bench/train_build_prompts.py --extra-agent/--extra-readme/--extra-coding`).

The first extra prompts (`--extra N`) are code review, debugging and performance questions only. These add the
categories the reviewer's own traffic is made of, from sources the main set does not use, so the held-out prompts
keep their meaning:
  agent    a persona agent's conversation as `reviewer run` sends it (persona system prompt, tool schemas, the task
           with a README), then zero to three tool calls with their results in the tools' real formats; the
           "repository" is a real project folder on this machine (a package's or a tool's docs folder): its real
           listing, its real files read with read_file's line numbers
  readme   install / usage / docs questions on those READMEs
  coding   "write a function that ..." from the first sentence of a real function's docstring
READMEs come from markdown and reStructuredText files on disk (site-packages, /usr/share/doc, node_modules), not
from the distributions' long descriptions the main set quotes. Deterministic on one machine.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sysconfig
from pathlib import Path

DOC_ROOTS = [Path(sysconfig.get_paths()["purelib"]), Path("/usr/share/doc"), Path("/usr/lib/node_modules")]
DOC_NAMES = re.compile(r"(readme|index|usage|install|quickstart|getting[-_]started|tutorial|contributing)"
                       r"[^/]*\.(md|rst|txt)$|readme$", re.I)
SOURCE_SUFFIXES = (".py", ".js", ".ts", ".sh", ".toml", ".cfg", ".json", ".yaml", ".yml")


def doc_files(roots: list[Path] = DOC_ROOTS, exclude: set[str] = frozenset()) -> list[tuple[Path, str]]:
    """(path, text) of README-like docs of 800+ characters under roots (dist-info folders and tests left out), one per
    distinct text, minus any text that starts like one in `exclude` (the main set's READMEs)."""
    starts = {t[:400] for t in exclude}
    seen, out = set(), []
    for root in roots:
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            if (not DOC_NAMES.search(path.name) or not path.is_file()
                    or {"tests", "test", "__pycache__"} & set(path.parts)
                    or any(p.endswith((".dist-info", ".egg-info")) for p in path.parts)):
                continue
            try:
                text = path.read_text(encoding="utf-8").strip()
            except (UnicodeDecodeError, OSError):
                continue
            if len(text) < 800 or text[:400] in starts or text[:400] in seen:
                continue
            seen.add(text[:400])
            out.append((path, text))
    return out


def project_files(folder: Path, limit: int = 400) -> list[Path]:
    """Readable text files under a project folder, sorted (the files an agent could read_file)."""
    found = []
    for p in sorted(folder.rglob("*")):
        if len(found) >= limit:
            break
        if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts and p.stat().st_size < 200_000:
            found.append(p)
    return found


def read_file_output(rel: str, text: str, limit: int, max_output: int = 10_000) -> str:
    """What reviewer.persona.tools' read_file returns for the first `limit` lines of a file: the same header, the same cut
    at `max_output` characters (the Toolbox default), the same footer."""
    lines = text.splitlines()
    body, used = [], 0
    for n, line in enumerate(lines[:limit], start=1):
        row = f"{n:6}\t{line[:1000]}"
        if used + len(row) > max_output:
            break
        body.append(row)
        used += len(row) + 1
    if not lines:
        return f"{rel}: empty file"
    footer = f"\n[... {len(lines) - len(body)} more lines: read_file(path, offset={len(body)}) ...]" \
        if len(body) < len(lines) else ""
    return "\n".join([f"{rel} lines 1-{len(body)} of {len(lines)}:", *body]) + footer


def listing(folder: Path, rng: random.Random) -> str:
    rows = []
    for p in sorted(folder.iterdir())[:40]:
        kind = "d" if p.is_dir() else "-"
        size = 4096 if p.is_dir() else p.stat().st_size
        rows.append(f"{kind}rw-r--r-- 1 user user {size:>8} Nov {rng.randint(1, 28):2} 12:{rng.randint(0, 59):02} {p.name}")
    return f"total {len(rows) * 4}\n" + "\n".join(rows)


def bash_output(code: int, output: str, rng: random.Random) -> str:
    """reviewer.persona.tools' bash result: status line with the time it took, then the output."""
    return f"exit code: {code} ({rng.uniform(0.1, 40):.1f} s)\n{output if output.strip() else '(no output)'}"


def tool_turn(folder: Path, slug: str, rng: random.Random, funcs: list[tuple[str, str]], i: int) -> tuple[dict, dict]:
    """One assistant tool call and its result, on the real project folder."""
    files = project_files(folder)
    kind = rng.choice(["ls", "read", "read", "install", "pytest", "grep"] if files else ["ls", "install", "pytest"])
    if kind == "read":
        path = rng.choice(files)
        rel = str(path.relative_to(folder))
        limit = rng.choice([30, 60, 100])  # a page, not the default 400 lines: most prompts stay under 4,096 tokens
        call = ("read_file", {"path": rel, "limit": limit})
        result = read_file_output(rel, path.read_text(errors="replace"), limit)
        say = f"Let me look at {rel}."
    elif kind == "ls":
        call = ("bash", {"command": "ls -la"})
        result = bash_output(0, listing(folder, rng), rng)
        say = "First, what is in the repository?"
    elif kind == "install":
        command = rng.choice(["pip install -e . 2>&1 | tail -n 5", "pip install -e '.[test]' 2>&1 | tail -n 5",
                              "pip install -r requirements.txt 2>&1 | tail -n 5"])
        call = ("bash", {"command": command})
        if rng.random() < 0.6:
            result = bash_output(0, f"Successfully installed {slug}-{rng.randint(0, 3)}.{rng.randint(0, 20)}.0", rng)
        elif "requirements" in command:
            result = bash_output(1, "ERROR: Could not open requirements file: [Errno 2] No such file or directory: "
                                    "'requirements.txt'", rng)
        else:
            result = bash_output(1, "ERROR: Directory '.' is not installable. Neither 'setup.py' nor "
                                    "'pyproject.toml' found.", rng)
        say = "I'll install the project the way the README says."
    elif kind == "grep":
        path = rng.choice(files)
        text = path.read_text(errors="replace").splitlines()
        words = sorted({w for line in text for w in re.findall(r"\b[a-z_]{5,}\b", line)})
        word = rng.choice(words) if words else "import"
        hits = [f"{path.relative_to(folder)}:{n}:{line.strip()[:200]}" for n, line in enumerate(text, 1) if word in line]
        call = ("bash", {"command": f"grep -rn '{word}' . | head -n 20"})
        result = bash_output(0 if hits else 1, "\n".join(hits[:20]), rng)
        say = f"Where is `{word}` used?"
    else:
        name, code = funcs[(i * 31 + 7) % len(funcs)]
        failed = rng.random() < 0.5
        if failed:
            line = rng.choice(code.splitlines()[1:] or ["pass"]).strip()
            out = (f"FAILED tests/test_{slug.replace('-', '_')}.py::test_{name} - "
                   f"{rng.choice(['AssertionError', 'TypeError', 'ValueError', 'KeyError'])}: {line[:80]}\n"
                   f"{rng.randint(1, 3)} failed, {rng.randint(5, 120)} passed in {rng.uniform(0.2, 30):.2f}s")
        else:
            out = f"{rng.randint(5, 300)} passed in {rng.uniform(0.2, 30):.2f}s"
        call = ("bash", {"command": "python -m pytest -q 2>&1 | tail -n 15"})
        result = bash_output(1 if failed else 0, out, rng)
        say = "Now the test suite."
    call_id = f"call_{hashlib.sha1(f'{slug}{i}{kind}'.encode()).hexdigest()[:8]}"
    assistant = {"role": "assistant", "content": say, "tool_calls": [{"id": call_id, "type": "function",
                 "function": {"name": call[0], "arguments": json.dumps(call[1])}}]}
    return assistant, {"role": "tool", "tool_call_id": call_id, "content": result}


def task_text(persona, slug: str, top: str, readme_name: str, readme: str) -> str:
    """A persona's first user message, shaped like reviewer.run.task.build_task's (both prompt sets use it)."""
    from reviewer.run.task import README_CHARS

    return "\n".join([
        "Review this repository the way a new user would, with your focus: " + ", ".join(persona.focus) + ".",
        "", f"Repository: https://github.com/example/{slug}",
        f"Commit: {hashlib.sha1(slug.encode()).hexdigest()} (default branch main)",
        f"Working directory (a fresh clone; every path you give is relative to it): /work/{slug}",
        f"A fresh virtual environment is active: `python` and `pip` are /work/{slug}/.venv/bin/python and "
        f"/work/{slug}/.venv/bin/pip. Nothing is installed in it yet: install the project the way its README says.",
        "Each bash command runs in a new shell in the working directory (a `cd` does not carry over) with at most "
        "120 s; whatever it started in the background is stopped when it returns.",
        f"Top of the repository: {top}", "", f"{readme_name}:", "-----", readme[:README_CHARS], "-----", "",
        f"You have {persona.max_steps} steps. Confirm each problem by running something, then record it at once "
        "with record_finding (evidence: the command output; repro_command: one command that shows it). Record "
        "every number you measure with record_measurement (repeat timings and give `repeats`). When done, call "
        "finish with a short summary.",
    ])


def agent_prompts(rng: random.Random, docs: list[tuple[Path, str]], funcs: list[tuple[str, str]], n: int) -> list[dict]:
    """Persona agents' conversations, the first turn shaped like reviewer.run.task.build_task's message."""
    from reviewer.persona.files import load_personas

    personas = [p for p in load_personas().values() if not p.deterministic]
    out = []
    for i in range(n):
        persona = personas[i % len(personas)]
        path, readme = docs[rng.randrange(len(docs))]
        folder = path.parent
        slug = re.sub(r"[^a-z0-9]+", "-", folder.name.lower()).strip("-") or "project"
        top = ", ".join(p.name + ("/" if p.is_dir() else "") for p in sorted(folder.iterdir())[:30])
        task = task_text(persona, slug, top, path.name, readme)
        messages = [{"role": "system", "content": persona.system_prompt}, {"role": "user", "content": task}]
        for k in range(rng.choice([0, 1, 1, 2, 2, 3])):
            messages += tool_turn(folder, slug, rng, funcs, i * 4 + k)
        out.append({"category": "agent", "messages": messages, "tools": "agent"})
    return out


def readme_prompts(rng: random.Random, docs: list[tuple[Path, str]], asks: list[str], n: int) -> list[dict]:
    out = []
    for i in range(n):
        path, text = docs[i % len(docs)]
        name = path.parent.name
        start = 0 if i < len(docs) else rng.randrange(0, max(1, len(text) - 600))  # later passes: other sections
        cut = text[start: start + rng.choice([600, 1200, 2000, 3000])]
        out.append({"category": "readme", "messages": [{"role": "user", "content": rng.choice(asks).format(
            name=name, readme=cut)}], "tools": None})
    return out


def documented_functions(paths: list[Path]) -> list[tuple[str, str, str]]:
    """(name, signature, first docstring sentence) of public functions whose docstring opens with a usable sentence."""
    found = []
    for path in paths:
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node) or ""
            first = re.split(r"(?<=[.!?])\s|\n\n", " ".join(doc.split("\n\n")[0].split()), maxsplit=1)[0]
            if 25 <= len(first) <= 220 and not re.search(r"[>{}`|]|:param|deprecated", first, re.I):
                args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
                found.append((node.name, f"{node.name}({', '.join(args)})", first.rstrip(".")))
    return found


CODING_FROM_DOC = [
    "Write a Python function `{sig}`: {doc}.",
    "Implement `{sig}` in Python. Its docstring says: \"{doc}.\" Include type hints.",
    "Write `{sig}` ({doc}), and a pytest test for it.",
    "How would you implement a function `{sig}` that does this: {doc}?",
    "Write a short, idiomatic Python function `{sig}`. Spec: {doc}. Handle edge cases and explain them.",
]


def coding_prompts(rng: random.Random, funcs: list[tuple[str, str, str]], n: int) -> list[dict]:
    return [{"category": "coding", "messages": [{"role": "user", "content": rng.choice(CODING_FROM_DOC).format(
        sig=sig, doc=doc)}], "tools": None} for _, sig, doc in funcs[:n]]
