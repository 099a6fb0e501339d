"""Where training prompts come from: the built-in sets (backend/prompts/builtin.jsonl, made by
bench/train_build_prompts.py, and the training-only builtin_extra.jsonl.gz), the review loop's own transcripts
in reviews.db (--from-db: every assistant turn's context, with the reviewer's tools) and agent sessions replayed
through `reviewer serve` (--from-transcripts: the same, from backend/bench/replay.py's --transcripts file), each a
PromptRecord with its split (train or held out)."""

from __future__ import annotations

import gzip
import hashlib
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from backend.train.config import DataError

PROMPTS_DIR = Path(__file__).resolve().parents[1] / "prompts"  # backend/prompts
BUILTIN_PROMPTS = PROMPTS_DIR / "builtin.jsonl"
BUILTIN_EXTRA = PROMPTS_DIR / "builtin_extra.jsonl.gz"  # training-only prompts on other code (--builtin-extra)
AGENT_TOOLS = PROMPTS_DIR / "agent_tools.json"


@dataclass
class PromptRecord:
    id: str
    category: str
    split: str  # "train" | "heldout"
    messages: list[dict]
    tools: list[dict] | None = None


def _agent_tools() -> list[dict]:
    return json.loads(AGENT_TOOLS.read_text())


def load_builtin(path: Path = BUILTIN_PROMPTS) -> list[PromptRecord]:
    """The built-in prompt set (JSON lines; gzipped when the name ends in .gz): the main one by default, or
    BUILTIN_EXTRA."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"built-in prompt set not found: {path}")
    tools = None
    out = []
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            if raw.get("tools") == "agent":
                tools = tools or _agent_tools()
            out.append(PromptRecord(raw["id"], raw["category"], raw["split"], raw["messages"],
                                    tools if raw.get("tools") == "agent" else None))
        except (ValueError, KeyError) as exc:
            raise DataError(f"{path}:{n}: malformed prompt record ({exc})") from None
    return out


def _split_of(key: str, heldout_fraction: float) -> str:
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < heldout_fraction else "train"


def turn_prompts(messages: list, key: str, category: str, split: str, tools: list[dict] | None) -> list[PromptRecord]:
    """One prompt per assistant turn of a conversation: the messages before it (what the server was asked)."""
    return [PromptRecord(f"{key}-{i}", category, split, messages[:i], tools)
            for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant" and i > 0]


def load_from_db(db: str | Path, heldout_fraction: float = 0.08) -> list[PromptRecord]:
    """Prompts from the review loop's own transcripts: for every assistant turn of every persona run, the
    conversation before it (what the server was asked). Whole transcripts go to one split, so held-out prompts
    never share a prefix with training prompts. Read with sqlite3 directly: backend/ does not import reviewer/.
    The deterministic `smoke` persona is skipped: no LLM wrote its turns."""
    path = Path(db).expanduser()
    if not path.is_file():
        raise DataError(f"--from-db: no database at {path}")
    try:
        con = sqlite3.connect(str(path), timeout=30)  # only reads; WAL lets a running review keep writing
        rows = con.execute("SELECT id, run_id, persona, transcript FROM personarun ORDER BY id").fetchall()
        con.close()
    except sqlite3.Error as exc:
        raise DataError(f"--from-db: {path} is not a reviews database ({exc})") from None
    tools = _agent_tools()
    out = []
    for row_id, run_id, persona, transcript in rows:
        if persona == "smoke":
            continue
        try:
            messages = json.loads(transcript or "[]")
        except ValueError:
            continue  # a transcript cut mid-write by a crash: skip it, keep the rest
        if not isinstance(messages, list):
            continue
        native = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages if isinstance(m, dict))
        split = _split_of(f"db-{run_id}-{row_id}", heldout_fraction)
        out += turn_prompts(messages, f"db-{row_id}", f"db:{persona}", split, tools if native else None)
    return out


def load_transcripts(paths: str, heldout_fraction: float = 0.08) -> list[PromptRecord]:
    """Prompts from replayed agent sessions (`python -m backend.bench.replay --transcripts FILE`, comma-separated
    files): every assistant turn's context, with the session's tools, so contexts grow to the window the sessions
    were replayed at. A session goes to one split whole."""
    out = []
    for name in (p.strip() for p in paths.split(",") if p.strip()):
        path = Path(name).expanduser()
        if not path.is_file():
            raise DataError(f"--from-transcripts: no file at {path}")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                messages, session = raw["messages"], raw["session"]
                if not isinstance(messages, list) or not messages:
                    raise ValueError("no messages")
            except (ValueError, KeyError, TypeError) as exc:
                raise DataError(f"{path}:{n}: not a replay transcript line ({exc})") from None
            key = f"tx-{hashlib.sha256(f'{path.name}:{session}'.encode()).hexdigest()[:10]}"
            out += turn_prompts(messages, key, f"replay:{raw.get('persona', 'agent')}",
                                _split_of(key, heldout_fraction), raw.get("tools") or None)
    return out
