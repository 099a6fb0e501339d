"""The replay's agent sessions (backend/bench/replay.py): a persona's real system prompt and tool schemas, a first turn
asking to review a repository, then one file chunk per turn as a tool result, the context growing to the window.

The files are public text the drafter did not train on: by default the running interpreter's own test suite
(`Lib/test/test_*.py`), which the drafter's prompt builder leaves out (bench/train_build_prompts.py quotes functions of
the standard library *outside* its tests, and of some packages), or the files of a `--repo PATH`. Each chunk is also
checked against the training prompts themselves (backend/prompts/builtin.jsonl and builtin_extra.jsonl.gz): one that
shares a line of HELD_OUT_LINE characters or more with them is dropped, and the record says how many were.

The system prompt is read from personas/<name>.md as `reviewer run` reads it (the body after the YAML front matter),
the tool schemas from backend/prompts/agent_tools.json (a copy of reviewer.persona.tools.TOOLS that
tests/backend/train checks), and the first turn follows reviewer/run/task.py's shape: the backend does not import
`reviewer/`, so it reads these as data.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PERSONAS_DIR = ROOT / "personas"
PROMPTS_DIR = ROOT / "backend" / "prompts"
TOOLS_FILE = PROMPTS_DIR / "agent_tools.json"
TRAINING_PROMPTS = (PROMPTS_DIR / "builtin.jsonl", PROMPTS_DIR / "builtin_extra.jsonl.gz")
PERSONAS = ("correctness", "performance", "docs")  # the LLM personas (smoke is deterministic: no model)
HELD_OUT_LINE = 32  # a shared line this long or longer marks a chunk as seen in training
# The interpreter's tests, in a fixed order; session k takes every n-th one starting at k (different files each)
TEST_FILES = ("test_textwrap", "test_shlex", "test_heapq", "test_fnmatch", "test_bisect", "test_glob",
              "test_difflib", "test_calendar", "test_csv", "test_configparser", "test_statistics", "test_argparse",
              "test_json/test_decode", "test_json/test_scanstring")
FILE_SUFFIXES = (".py", ".md", ".rst", ".txt", ".toml", ".cfg", ".ini", ".json", ".yaml", ".yml", ".sh", ".c", ".h",
                 ".js", ".ts", ".go", ".rs", ".java")


class SessionError(Exception):
    """No usable files or personas: one line for the user."""


class ReplayError(Exception):
    """The server would not start, or a setup mistake: one line, no traceback."""


@dataclass
class TurnRow:
    config: str
    session: str
    turn: int
    context_tokens: int  # prompt_tokens from the server's usage
    counted_tokens: int | None  # /v1/messages/count_tokens before the turn (what decided that it fits)
    cached_tokens: int | None
    completion_tokens: int
    ttft_s: float | None
    decode_tok_s: float | None
    decode_tok_s_source: str  # "timings" (the server's predicted_per_second) or "client" (tokens / streamed time)
    wall_s: float
    finish_reason: str | None
    tool_calls: int
    reply_sha256: str
    spec: dict | None = None  # the server's speculative timings (cycles, drafts accepted) when it drafted
    identical_to_none: bool | None = None


@dataclass
class Chunk:
    path: str  # relative to the session's repository root
    first_line: int  # 1-based
    last_line: int
    total_lines: int
    text: str  # the file's lines first_line..last_line

    def tool_output(self) -> str:
        """As the agent's read_file tool shows it (reviewer/persona/tools.py): a header, numbered lines, a footer."""
        body = [f"{n:6}\t{line[:1000]}" for n, line in enumerate(self.text.split("\n"), start=self.first_line)]
        footer = (f"\n[... {self.total_lines - self.last_line} more lines: read_file(path, offset={self.last_line}) ...]"
                  if self.last_line < self.total_lines else "")
        return "\n".join([f"{self.path} lines {self.first_line}-{self.last_line} of {self.total_lines}:", *body]) + footer

    def call_arguments(self) -> str:
        return json.dumps({"path": self.path, "offset": self.first_line - 1, "limit": self.last_line - self.first_line + 1})


@dataclass
class Session:
    name: str
    persona: str
    system: str
    task: str
    chunks: list[Chunk]
    dropped_seen: int = 0  # chunks left out because they share a line with the training prompts
    files: list[str] = field(default_factory=list)

    def opening(self) -> list[dict]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.task}]


@dataclass
class Reply:
    """What the server answered at one turn (the part that is fed back)."""
    content: str
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI shape: id, type, function{name, arguments}

    def sha256(self) -> str:
        text = json.dumps({"content": self.content, "tool_calls": [c["function"] for c in self.tool_calls]},
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


# ---- what a session is made of --------------------------------------------------------------------------------------


def persona_prompt(name: str, folder: Path = PERSONAS_DIR) -> tuple[str, list[str]]:
    """(system prompt, focus) of personas/<name>.md: the body after the front matter, as reviewer/persona/files.py."""
    path = folder / f"{name}.md"
    try:
        _, front, body = path.read_text(encoding="utf-8").split("---", 2)
    except (OSError, ValueError):
        raise SessionError(f"persona file {path} is missing or has no front matter") from None
    meta = yaml.safe_load(front) or {}
    focus = meta.get("focus", [])
    return body.strip(), [focus] if isinstance(focus, str) else list(focus)


def load_tools(path: Path = TOOLS_FILE) -> list[dict]:
    return json.loads(path.read_text())


def task_message(focus: list[str], repo: str, root: str, top: list[str], max_steps: int) -> str:
    """The first user turn, in reviewer/run/task.py's shape (no README, no smoke baseline)."""
    return "\n".join([
        "Review this repository the way a new user would, with your focus: " + ", ".join(focus) + ".",
        "",
        f"Repository: {repo}",
        f"Working directory (a fresh clone; every path you give is relative to it): {root}",
        "A fresh virtual environment is active: `python` and `pip` are its own. Nothing is installed in it yet: "
        "install the project the way its README says.",
        "Each bash command runs in a new shell in the working directory (a `cd` does not carry over) with at most "
        "600 s; whatever it started in the background is stopped when it returns.",
        f"Top of the repository: {', '.join(top)}",
        "",
        "The repository has no README.",
        "",
        f"You have {max_steps} steps. Confirm each problem by running something, then record it at once with "
        "record_finding (evidence: the command output; repro_command: one command that shows it). Record every number "
        "you measure with record_measurement (repeat timings and give `repeats`). When done, call finish with a short "
        "summary.",
    ])


def training_lines(paths=TRAINING_PROMPTS, min_len: int = HELD_OUT_LINE) -> set[str]:
    """Every stripped line of min_len characters or more in the drafter's training prompts. None of the files there:
    an error, since the record would claim a check that was not made."""
    if not any(Path(p).is_file() for p in paths):
        raise SessionError(f"the drafter's training prompts ({', '.join(map(str, paths))}) are missing: cannot check "
                           "that the sessions are held out from them")
    lines: set[str] = set()
    for path in paths:
        if not Path(path).is_file():
            continue
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as fh:
            for row in fh:
                for message in json.loads(row).get("messages", []):
                    for line in str(message.get("content") or "").split("\n"):
                        line = line.strip()
                        if len(line) >= min_len:
                            lines.add(line)
    return lines


def chunk_file(path: Path, rel: str, chunk_chars: int) -> list[Chunk]:
    """Consecutive whole-line chunks of about chunk_chars characters (a longer line is a chunk by itself)."""
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    out, start, size = [], 0, 0
    for i, line in enumerate(lines):
        size += len(line) + 1
        if size >= chunk_chars or i == len(lines) - 1:
            text = "\n".join(lines[start:i + 1])
            if text.strip():
                out.append(Chunk(rel, start + 1, i + 1, len(lines), text))
            start, size = i + 1, 0
    return out


def seen_in_training(chunk: Chunk, seen: set[str]) -> bool:
    return any(len(s) >= HELD_OUT_LINE and s in seen for s in (line.strip() for line in chunk.text.split("\n")))


# ---- sources ----------------------------------------------------------------------------------------------------------


@dataclass
class Source:
    """Where the files come from: a root, how to name it to the model, and its files in order."""
    repo: str
    root: Path
    files: list[Path]
    held_out: str


def stdlib_tests() -> Source:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [lib / "test" / f"{name}.py" for name in TEST_FILES if (lib / "test" / f"{name}.py").is_file()]
    if len(files) < 3:
        raise SessionError(f"this interpreter has no test suite under {lib / 'test'} (a distribution that strips "
                           "it): give --repo PATH, a folder of real files the drafter did not train on")
    return Source(repo=f"cpython {sysconfig.get_python_version()} Lib/test (the interpreter's own test suite)",
                  root=lib, files=files,
                  held_out="files of the running interpreter's own test suite (Lib/test), which the drafter's prompt "
                           "builder leaves out (bench/train_build_prompts.py takes functions of the standard library "
                           "outside its tests); every chunk sharing a stripped line of "
                           f"{HELD_OUT_LINE}+ characters with backend/prompts/builtin.jsonl or builtin_extra.jsonl.gz "
                           "was dropped as well")


def repo_files(root: Path) -> Source:
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise SessionError(f"--repo {root}: not a folder")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in FILE_SUFFIXES
                   and not {".git", ".venv", "node_modules", "__pycache__"} & set(p.relative_to(root).parts))
    if not files:
        raise SessionError(f"--repo {root}: no text files ({', '.join(FILE_SUFFIXES)})")
    return Source(repo=root.name, root=root, files=files,
                  held_out=f"files of --repo {root} (the user's choice); every chunk sharing a stripped line of "
                           f"{HELD_OUT_LINE}+ characters with backend/prompts/builtin.jsonl or builtin_extra.jsonl.gz "
                           "was dropped")


def build_sessions(n: int, source: Source, *, chunk_chars: int = 700, max_chunks: int = 200,
                   personas: tuple[str, ...] = PERSONAS, persona_dir: Path = PERSONAS_DIR,
                   seen: set[str] | None = None) -> list[Session]:
    """n sessions, persona k % len(personas), files source.files[k::n] (all files when there are fewer than n),
    chunks in order, those seen in training dropped."""
    if n < 1:
        raise SessionError("--sessions must be at least 1")
    seen = training_lines() if seen is None else seen
    tools_top = sorted({p.relative_to(source.root).parts[0] for p in source.files})
    sessions = []
    for k in range(n):
        persona = personas[k % len(personas)]
        system, focus = persona_prompt(persona, persona_dir)
        files = source.files[k::n] if len(source.files) >= n else source.files
        chunks, dropped = [], 0
        for path in files:
            for c in chunk_file(path, str(path.relative_to(source.root)), chunk_chars):
                if seen_in_training(c, seen):
                    dropped += 1
                elif len(chunks) < max_chunks:
                    chunks.append(c)
        if not chunks:
            raise SessionError(f"session {k}: every chunk of {len(files)} file(s) was seen in training")
        task = task_message(focus, source.repo, str(source.root), tools_top, max_steps=40)
        sessions.append(Session(f"s{k}-{persona}", persona, system, task, chunks, dropped,
                                [str(p.relative_to(source.root)) for p in files]))
    return sessions


# ---- one turn fed back ------------------------------------------------------------------------------------------------


def assistant_message(reply: Reply, turn: int) -> dict:
    """The model's reply as the next request carries it: its text, and its tool calls (ids filled in, arguments that
    do not parse as a JSON object sent back as {}, as servers re-parse the history through a chat template)."""
    if not reply.tool_calls:
        return {"role": "assistant", "content": reply.content}
    calls = []
    for i, c in enumerate(reply.tool_calls):
        args = c["function"].get("arguments") or "{}"
        try:
            if not isinstance(json.loads(args), dict):
                args = "{}"
        except json.JSONDecodeError:
            args = "{}"
        calls.append({"id": c.get("id") or f"call_{turn}_{i}", "type": "function",
                      "function": {"name": c["function"]["name"], "arguments": args}})
    return {"role": "assistant", "content": reply.content, "tool_calls": calls}


def feed_back(reply: Reply, chunk: Chunk, turn: int) -> list[dict]:
    """The messages a turn adds: the model's own reply, then the next file chunk as a tool result. A reply with tool
    calls gets the chunk as its first call's result (a further call: a one-line refusal, as the agent allows one call
    per reply); a reply without them gets the chunk as a user turn holding the read_file output."""
    said = assistant_message(reply, turn)
    if "tool_calls" not in said:
        return [said, {"role": "user", "content": f"read_file({chunk.call_arguments()}) returned:\n{chunk.tool_output()}"}]
    return [said] + [{"role": "tool", "tool_call_id": c["id"],
                      "content": chunk.tool_output() if i == 0 else "error: one tool call per reply; this one was not run"}
                     for i, c in enumerate(said["tool_calls"])]


def anthropic_body(messages: list[dict], tools: list[dict], model: str) -> dict:
    """The same conversation as an Anthropic count_tokens body (the server turns it back into these messages)."""
    out: list[dict] = []
    for m in messages[1:]:
        if m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [{"type": "text", "text": m["content"]}] if m["content"] else []
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"] or "{}")} for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": blocks})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return {"model": model, "system": messages[0]["content"], "messages": out,
            "tools": [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                       "input_schema": t["function"]["parameters"]} for t in tools]}
