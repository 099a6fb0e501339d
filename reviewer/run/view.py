"""The review on screen: a live table on a terminal, one plain line per event elsewhere (CI logs, pipes, tests)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text


@dataclass
class PersonaState:
    name: str
    status: str = "waiting"
    step: int = 0
    max_steps: int | None = None
    tool: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    llm_seconds: float = 0.0
    started: float | None = None
    ended: float | None = None
    findings: int = 0
    measurements: int = 0
    note: str = ""
    streamed: int = 0  # characters of the reply being generated
    estimated: bool = False  # the token counts are estimates (the server reported none)


STATUS_MARK = {"waiting": " ", "running": "▶", "completed": "✓", "step_budget": "◼", "token_budget": "◼",
               "timeout": "◼", "failed": "✗", "interrupted": "✗"}


STATUS_STYLE = {"completed": "green", "failed": "red", "interrupted": "red", "running": "bold cyan",
                "step_budget": "yellow", "token_budget": "yellow", "timeout": "yellow", "waiting": "dim"}


@dataclass
class LiveView:
    """Persona, step, last tool, tokens and tokens/s while the review runs: a live table on a terminal, one plain line
    per event elsewhere (CI logs, pipes, tests)."""

    console: Console
    header: str
    personas: list[PersonaState] = field(default_factory=list)
    live: Live | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> LiveView:
        if self.console.is_terminal:
            self.live = Live(console=self.console, get_renderable=self.render, refresh_per_second=4, transient=False)
            self.live.__enter__()
        else:
            self.console.print(self.header, highlight=False)
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)
            self.live = None

    def state(self, name: str) -> PersonaState:
        return next(p for p in self.personas if p.name == name)

    def say(self, text: str) -> None:
        (self.live.console if self.live else self.console).print(text, highlight=False, markup=False, soft_wrap=True)

    def start(self, name: str, max_steps: int | None) -> None:
        p = self.state(name)
        p.status, p.started, p.max_steps, p.note = "running", time.monotonic(), max_steps, "preparing workspace"
        if not self.live:
            self.say(f"▶ {name}: fresh clone and virtual environment ...")

    def step(self, name: str, step: int, tool: str | None, detail: str = "", *, prompt_tokens: int = 0,
             completion_tokens: int = 0, llm_seconds: float = 0.0, estimated: bool = False) -> None:
        p = self.state(name)
        p.step, p.tool, p.note, p.streamed = step, tool or "", detail, 0
        p.prompt_tokens, p.completion_tokens, p.llm_seconds = prompt_tokens, completion_tokens, llm_seconds
        p.estimated = estimated
        if not self.live:
            tokens = f"  {token_count(p)} tok  {tokens_per_s(p)}" if p.llm_seconds else ""
            self.say(f"  {name} step {step}: {tool or '-'}{' ' + detail if detail else ''}{tokens}")

    def delta(self, name: str, text: str) -> None:
        """Streamed text of the reply being generated: the live view shows it growing."""
        p = self.state(name)
        p.streamed += len(text)
        p.note = f"generating ({p.streamed} characters)"

    def recorded(self, name: str, kind: str, row) -> None:
        p = self.state(name)
        # Printed in both modes: on a terminal the line scrolls by above the live table.
        if kind == "finding":
            p.findings += 1
            self.say(f"  {name} found [{row.severity}] {row.title}")
        elif kind == "sandbox_event":
            self.say(f"  {name} sandbox: {row.kind}: {row.detail}")
        else:
            p.measurements += 1
            self.say(f"  {name} measured {row.name} = {row.value:.4g} {row.unit}")

    def end(self, name: str, status: str, note: str = "") -> None:
        p = self.state(name)
        p.status, p.ended, p.note = status, time.monotonic(), note
        if not self.live:
            self.say(f"{STATUS_MARK.get(status, '?')} {name} {status} in {elapsed(p)} ({p.step} steps, "
                     f"{p.findings} findings, {p.measurements} measurements){': ' + note if note else ''}")

    def render(self):
        table = Table(box=None, pad_edge=False, show_header=True, header_style="dim")
        for col in ("", "persona", "status", "step", "last tool", "tokens", "tok/s", "time", "findings", "measured", ""):
            table.add_column(col, no_wrap=col != "")
        for p in self.personas:
            style = STATUS_STYLE.get(p.status, "")
            step = f"{p.step}/{p.max_steps}" if p.max_steps and p.status == "running" else (str(p.step) if p.step else "")
            table.add_row(
                STATUS_MARK.get(p.status, "?"), Text(p.name, style="bold"), Text(p.status, style=style), step,
                p.tool, token_count(p) if p.llm_seconds else "",
                tokens_per_s(p) if p.llm_seconds else "", elapsed(p) if p.started else "",
                str(p.findings) if p.started else "", str(p.measurements) if p.started else "",
                Text(p.note[:70], style="dim"),
            )
        return Group(Text.from_markup(self.header), table)


def token_count(p: PersonaState) -> str:
    return f"~{p.prompt_tokens + p.completion_tokens}" if p.estimated else str(p.prompt_tokens + p.completion_tokens)


def tokens_per_s(p: PersonaState) -> str:
    """From the server's own counts; from estimates only marked as such (`~`, "estimated")."""
    if p.llm_seconds <= 0:
        return "-"
    rate = f"{p.completion_tokens / p.llm_seconds:.1f} tok/s"
    return f"~{rate} (estimated)" if p.estimated else rate


def elapsed(p: PersonaState) -> str:
    if p.started is None:
        return ""
    s = int((p.ended or time.monotonic()) - p.started)
    return f"{s // 60}:{s % 60:02d}"


def now_text() -> str:
    return datetime.now().strftime("%H:%M:%S")


def log(console: Console, message: str, style: str = "") -> None:
    text = f"[dim]{now_text()}[/dim] " + (f"[{style}]{escape(message)}[/]" if style else escape(message))
    console.print(text, highlight=False, soft_wrap=True)
