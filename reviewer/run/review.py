"""`reviewer run`: one review of one commit, persona after persona, stored as it happens.

The order matters and is the point of this module:
1. check everything the user gave (personas, target, ref, isolation) — bad input costs one line and writes nothing;
2. take the machine (reviewer.run.lock), so no other review disturbs the measurements;
3. open the LLM if an LLM persona is selected (an unreachable one is still bad input: nothing written yet);
4. create the run row, then for each persona a fresh workspace, a PersonaRun row, and a recorder that writes every
   finding, measurement and transcript step at once in its own short transaction (a crash keeps all of it);
5. print the summary (or the run as JSON) from what the database holds — the same query `reviewer report` uses.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from sqlmodel import select

from reviewer.store import db

from reviewer.sandbox import isolation
from reviewer.store.db import Finding, Measurement, PersonaRun, ReviewRun, SandboxEvent
from reviewer.run.lock import LockBusy, lock_path, review_lock
from reviewer.persona.files import Persona, PersonaError, select_personas
from reviewer.persona.smoke import run_smoke
from reviewer.sandbox.workspace import Target, Workspace, WorkspaceError, create_workspace, resolve_target

DETERMINISTIC = {"smoke": run_smoke}  # personas that run code instead of a model
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BUSY, EXIT_INTERRUPTED = 0, 1, 2, 75, 130
README_CHARS = 4000
ENDED = ("completed", "step_budget", "token_budget", "timeout")


class UserError(Exception):
    """Bad input found before anything is written; one line."""


# --- storage -----------------------------------------------------------------------------------------------------------

class DbRecorder:
    """The agent's Recorder: every call is its own short transaction, so a crash loses at most the step in flight."""

    def __init__(self, db_path: str, run_id: int, persona_run_id: int, persona: str, on_record=None):
        self.db, self.run_id, self.persona_run_id, self.persona = db_path, run_id, persona_run_id, persona
        self.on_record = on_record or (lambda kind, row: None)
        self.findings = 0
        self.measurements = 0
        self.titles: list[str] = []  # "[severity] title" of each finding, for the next personas' task

    def record_finding(self, *, title, severity, category, details, evidence=None, repro_command=None, file=None,
                       line=None) -> int:
        severity = str(severity or "").strip().lower()
        if severity not in db.SEVERITIES:
            raise ValueError(f"severity must be one of {', '.join(db.SEVERITIES)}, got {severity!r}")
        if not str(title or "").strip():
            raise ValueError("a finding needs a title")
        try:
            line = int(line) if line not in (None, "") else None
        except (TypeError, ValueError):
            line = None
        row = Finding(run_id=self.run_id, persona_run_id=self.persona_run_id, persona=self.persona,
                      title=str(title).strip(), severity=severity, category=str(category or "other").strip(),
                      details=str(details or ""), evidence=evidence, repro_command=repro_command,
                      file=str(file) if file else None, line=line)
        with db.session(self.db) as s:
            s.add(row)
            s.commit()
        self.findings += 1
        self.titles.append(f"[{row.severity}] {row.title}")
        self.on_record("finding", row)
        return row.id

    def record_measurement(self, *, name, value, unit, command=None, repeats=None, spread=None, samples=None) -> int:
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"a measurement value must be a number, got {value!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"a measurement value must be finite, got {value}")
        if not str(name or "").strip():
            raise ValueError("a measurement needs a name")
        try:
            repeats = int(repeats) if repeats not in (None, "") else None
        except (TypeError, ValueError):
            repeats = None
        row = Measurement(run_id=self.run_id, persona_run_id=self.persona_run_id, persona=self.persona,
                          name=str(name).strip(), value=value, unit=str(unit or ""), command=command, repeats=repeats,
                          spread=spread, samples=json.dumps(samples) if samples else None)
        with db.session(self.db) as s:
            s.add(row)
            s.commit()
        self.measurements += 1
        self.on_record("measurement", row)
        return row.id

    def record_sandbox_event(self, event, command: str | None = None) -> int:
        """A reviewer.sandbox.limits.Event the sandbox raised while one of this persona's commands ran."""
        row = SandboxEvent(run_id=self.run_id, persona_run_id=self.persona_run_id, persona=self.persona,
                           kind=event.kind, detail=event.detail, command=(command or "")[:2000] or None,
                           inferred=event.inferred, created_at=event.time)
        with db.session(self.db) as s:
            s.add(row)
            s.commit()
        self.on_record("sandbox_event", row)
        return row.id

    def save_transcript(self, messages: list[dict], *, steps: int, prompt_tokens: int, completion_tokens: int,
                        llm_seconds: float, tokens_estimated: bool = False) -> None:
        with db.session(self.db) as s:
            row = s.get(PersonaRun, self.persona_run_id)
            row.transcript = json.dumps(messages, default=str)
            row.steps, row.prompt_tokens, row.completion_tokens = steps, prompt_tokens, completion_tokens
            row.llm_seconds, row.tokens_estimated = llm_seconds, tokens_estimated
            s.add(row)
            s.commit()


def update_row(db_path: str, model, row_id: int, **values) -> None:
    with db.session(db_path) as s:
        row = s.get(model, row_id)
        for k, v in values.items():
            setattr(row, k, v)
        s.add(row)
        s.commit()


def machine_fingerprint(isolation_mode: str = "bwrap") -> dict:
    """What the measurements were taken on: enough to tell two machines (or two container limits) apart."""
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = round(int(line.split()[1]) / 1024 / 1024, 1)
    quota = None
    with contextlib.suppress(OSError, ValueError):
        q, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        quota = None if q == "max" else round(int(q) / int(period), 2)
    return {
        "hostname": socket.gethostname(),
        "cpu": cpu or platform.machine(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_quota": quota,
        "memory_gib": memory,
        "os": platform.platform(),
        "python": platform.python_version(),
        "isolation": isolation_mode,
    }


# --- what the LLM personas are told --------------------------------------------------------------------------------

def build_task(persona: Persona, ws: Workspace, target: Target, *, max_steps: int, baseline: list[str]) -> str:
    """The first user message of an LLM persona: where it is, what it has, what is known already, what to do."""
    top = sorted(p.name + ("/" if p.is_dir() else "") for p in ws.root.iterdir() if p.name != ".git")
    readme = next((p for p in sorted(ws.root.iterdir()) if p.is_file() and p.name.lower().startswith("readme")), None)
    lines = [
        "Review this repository the way a new user would, with your focus: " + (", ".join(persona.focus) or persona.description) + ".",
        "",
        f"Repository: {target.url}",
        f"Commit: {target.commit}" + (f" ({target.ref})" if target.ref else f" (default branch {target.branch})" if target.branch else ""),
        f"Working directory (a fresh clone; every path you give is relative to it): {ws.root}",
        f"A fresh virtual environment is active: `python` and `pip` are {ws.venv}/bin/python and {ws.venv}/bin/pip. "
        "Nothing is installed in it yet: install the project the way its README says.",
        f"Each bash command runs in a new shell in the working directory (a `cd` does not carry over) with at most "
        f"{ws.command_timeout:g} s; whatever it started in the background is stopped when it returns.",
        f"Top of the repository: {', '.join(top)}",
    ]
    lines += [f"Note: {n}" for n in ws.notes]
    if readme:
        text = readme.read_text(errors="replace")
        cut = f"\n[... {len(text) - README_CHARS} more characters: read_file {readme.name} ...]" if len(text) > README_CHARS else ""
        lines += ["", f"{readme.name}:", "-----", text[:README_CHARS] + cut, "-----"]
    else:
        lines += ["", "The repository has no README."]
    if baseline:
        lines += ["", "Already known from the deterministic smoke check of this commit (do not repeat it; go further):"]
        lines += [f"- {b}" for b in baseline]
    lines += [
        "",
        f"You have {max_steps} steps. Confirm each problem by running something, then record it at once with "
        "record_finding (evidence: the command output; repro_command: one command that shows it). Record every number "
        "you measure with record_measurement (repeat timings and give `repeats`). When done, call finish with a short "
        "summary.",
    ]
    return "\n".join(lines)


# --- on screen -----------------------------------------------------------------------------------------------------

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


# --- the run -----------------------------------------------------------------------------------------------------------

def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip(": ")


def error_exit(message: str, code: int = EXIT_USAGE) -> int:
    """One line on stderr, like every other `reviewer` error."""
    Console(stderr=True).print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return code


def check_inputs(target: str, settings, ref: str | None) -> tuple[list[Persona], Target]:
    """Everything that can be wrong with what the user typed, before the lock and before the database."""
    try:
        personas = select_personas(list(dict.fromkeys(settings.personas)), settings.personas_dir)  # each once
    except PersonaError as e:
        raise UserError(str(e)) from None
    if not personas:
        raise UserError("no persona selected")
    for p in personas:
        if p.deterministic and p.name not in DETERMINISTIC:
            raise UserError(f"persona {p.name!r} ({p.source}) says `deterministic: true`, but only "
                            f"{', '.join(DETERMINISTIC)} run without an LLM")
    try:
        isolation.Policy.from_settings(settings)  # bubblewrap missing or broken: one line, before anything is written
    except isolation.IsolationError as e:
        raise UserError(str(e)) from None
    try:
        return personas, resolve_target(target, ref)
    except WorkspaceError as e:
        raise UserError(str(e)) from None


_sigterm_received = threading.Event()


def stop_requested() -> bool:
    """True once SIGTERM has arrived under sigterm_as_interrupt. Its KeyboardInterrupt can be lost on the way: raised
    in the middle of a database call, it leaves the connection busy, and a library's cleanup that then fails raises an
    ordinary error in its place (SQLAlchemy's pool pre-ping restoring psycopg's autocommit: "can't change 'autocommit'
    now: connection in transaction status ACTIVE"). Code that handles an error and carries on asks this first."""
    return _sigterm_received.is_set()


def _on_sigterm(signum, frame):
    _sigterm_received.set()  # first: the exception below may not survive, the flag does
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt():
    """`kill PID` stops a review like Ctrl-C does: rows marked interrupted, workspace removed, lock released."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        _sigterm_received.clear()  # the outermost command of this process: a signal from an earlier one is done with
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_command(target: str, settings, *, ref: str | None = None, no_wait: bool = False, json_output: bool = False,
                console: Console | None = None, lock_held: bool = False, worker: str | None = None) -> int:
    """`reviewer run TARGET`: returns the exit code (0 completed, 1 failed, 2 bad input, 75 machine busy with
    --no-wait, 130 interrupted). `reviewer loop` calls it with `lock_held` (it holds the machine lock from claiming a
    queue row to verification) and its `worker` name, stored on the run."""
    console = console or Console()
    ui = Console(stderr=True) if json_output else console  # with --json, stdout carries only the JSON
    try:
        personas, tgt = check_inputs(target, settings, ref)
    except UserError as e:
        return error_exit(str(e))
    llm_personas = [p for p in personas if not p.deterministic]
    where = f"{tgt.url} @ {tgt.commit[:12]}" + (f" ({tgt.ref})" if tgt.ref else f" ({tgt.branch})" if tgt.branch else "")
    run_id = None
    try:
        with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
            llm = None
            # A remote LLM is checked before waiting for the machine (a typo should not cost a whole queue wait); the
            # embedded one is started only once the machine is ours, since loading it would disturb another review.
            local_llm = "embedded" in settings.llm
            if llm_personas and not local_llm:
                llm = open_llm_or_fail(stack, settings, ui, llm_personas)
            if not lock_held:
                stack.enter_context(review_lock(lock_path(settings), wait=not no_wait,
                                                on_wait=lambda m: ui.print(m, highlight=False),
                                                holder={"target": tgt.url, "commit": tgt.commit}))
            if llm_personas and local_llm:
                llm = open_llm_or_fail(stack, settings, ui, llm_personas)
            try:
                db.get_engine(settings.db)
            except Exception as e:  # noqa: BLE001 - unwritable path, newer schema: one line, nothing written
                raise UserError(f"cannot open the database {db.display_url(settings.db)}: {one_line(e)}") from None
            from reviewer.run.loop import recover, remove_orphans

            recover(settings.db, [], ui)  # runs a killed reviewer left `running` on this machine: interrupted
            remove_orphans([settings.workdir], ui)  # and the workspaces and sandbox folders it left behind
            run_id = create_run(settings, tgt, ref, llm, worker)
            status = review_personas(run_id, personas, tgt, settings, llm, ui, where)
    except LockBusy as e:
        return error_exit(str(e), EXIT_BUSY)
    except UserError as e:
        return error_exit(str(e))
    except KeyboardInterrupt:
        if run_id is None:
            ui.print("interrupted before the review started; nothing was written")
            return EXIT_INTERRUPTED
        status = "interrupted"
        close_open_rows(settings.db, run_id, status, "interrupted by the user")
    except Exception as e:  # noqa: BLE001 - a bug or a broken database mid-run: the run says so, the lock is released
        if run_id is None:
            raise
        status = "interrupted" if stop_requested() else "failed"  # interrupted: a SIGTERM came out as `e`
        close_open_rows(settings.db, run_id, status, one_line(e))
        ui.print(f"[red]error:[/red] {escape(one_line(e))}")
    return finish(run_id, status, settings, console, ui, json_output)


def close_open_rows(db_path: str, run_id: int, status: str, error: str) -> None:
    """Whatever is still `running` in this run ends with `status` (Ctrl-C or a crash between two rows)."""
    with db.session(db_path) as s:
        for row in s.exec(select(PersonaRun).where(PersonaRun.run_id == run_id, PersonaRun.status == "running")).all():
            row.status, row.error, row.finished_at = status, error, db.utcnow()
            s.add(row)
        run = s.get(ReviewRun, run_id)
        if run.status == "running":
            run.status, run.error, run.finished_at = status, error, db.utcnow()
            s.add(run)
        s.commit()


def open_llm_or_fail(stack: contextlib.ExitStack, settings, ui: Console, llm_personas: list[Persona]):
    """The LLM client for the review (kept open by `stack`); UserError when it cannot be reached."""
    from reviewer.llm.client import LLMError, open_llm

    try:
        return stack.enter_context(open_llm(settings, ui))
    except LLMError as e:
        raise UserError(str(e)) from None


def create_run(settings, tgt: Target, ref: str | None, llm, worker: str | None = None) -> int:
    with db.session(settings.db) as s:
        repo = db.get_or_create_repository(s, tgt.url)
        run = ReviewRun(repository_id=repo.id, ref=ref or tgt.branch, commit_sha=tgt.commit, status="running",
                        llm=llm.name if llm else None, model=llm.model if llm else None,
                        machine=json.dumps(machine_fingerprint(isolation.Policy.from_settings(settings).mode), sort_keys=True), pid=os.getpid(), worker=worker)
        s.add(run)
        s.commit()
        return run.id


def sandbox_line(policy) -> str:
    if policy.mode == "none":
        return ("[bold red]isolation none: the repository's code runs WITHOUT a sandbox, as you, with your files, keys "
                "and network[/bold red] (limits still apply; recorded on every persona run)")
    allow = ", ".join(isolation.egress_proxy.expand_allowlist(policy.network_allow)) or "nothing"
    return f"[dim]sandbox: bubblewrap; network only to {escape(allow)}; see docs/sandbox.md[/dim]"


def review_personas(run_id: int, personas: list[Persona], tgt: Target, settings, llm, ui: Console, where: str) -> str:
    """Run every persona in order; returns the run status. Ctrl-C marks the persona and the run interrupted."""
    header = (f"[bold]Reviewing[/bold] {escape(where)}  run {run_id}  personas: {', '.join(p.name for p in personas)}"
              + (f"  llm: {escape(llm.name)} ({escape(llm.model)})" if llm else "")
              + "\n" + sandbox_line(isolation.Policy.from_settings(settings)))
    view = LiveView(ui, header, [PersonaState(p.name) for p in personas])
    baseline: list[str] = []
    failures: list[str] = []
    with view:
        for persona in personas:
            status, error = run_persona(run_id, persona, tgt, settings, llm, view, baseline)
            if status == "failed":
                failures.append(f"{persona.name}: {error}")
            if status == "interrupted" or stop_requested():  # the latter: a SIGTERM that came out as an error
                raise KeyboardInterrupt  # the persona row is marked; run_command marks the run interrupted
    status = "failed" if failures else "completed"
    update_row(settings.db, ReviewRun, run_id, status=status, finished_at=db.utcnow(),
               error="; ".join(failures) if failures else None)
    return status


def run_persona(run_id: int, persona: Persona, tgt: Target, settings, llm, view: LiveView,
                baseline: list[str]) -> tuple[str, str | None]:
    """One persona in its own fresh workspace; returns (status, error). The workspace is removed afterwards unless
    the persona failed (then it is kept, and its path printed, for a look at what went wrong)."""
    with db.session(settings.db) as s:
        row = PersonaRun(run_id=run_id, persona=persona.name, status="running")
        s.add(row)
        s.commit()
        persona_run_id = row.id
    recorder = DbRecorder(settings.db, run_id, persona_run_id, persona.name,
                          on_record=lambda kind, r: view.recorded(persona.name, kind, r))
    max_steps = settings.max_steps or persona.max_steps
    view.start(persona.name, None if persona.deterministic else max_steps)
    ws = None
    status, error, summary = "failed", None, None
    try:
        ws = create_workspace(tgt, parent=settings.workdir, name=persona.name, command_timeout=settings.command_timeout,
                              policy=isolation.Policy.from_settings(settings))
        ws.on_event = recorder.record_sandbox_event
        if persona.deterministic:
            result = DETERMINISTIC[persona.name](
                ws, recorder, timeout=settings.timeout, probes=settings.probes,
                on_step=lambda step, tool, detail: view.step(persona.name, step, tool, detail))
        else:
            from reviewer.persona.agent import run_agent

            def on_step(e) -> None:
                view.step(persona.name, e.step, e.tool, prompt_tokens=e.prompt_tokens,
                          completion_tokens=e.completion_tokens, llm_seconds=e.llm_seconds, estimated=e.tokens_estimated)

            result = run_agent(persona, ws, llm, recorder, max_steps=max_steps, timeout=settings.timeout,
                               task=build_task(persona, ws, tgt, max_steps=max_steps, baseline=baseline),
                               on_step=on_step, command_timeout=settings.command_timeout,
                               on_delta=(lambda text: view.delta(persona.name, text)) if view.live else None,
                               on_note=lambda message: view.say(f"  {persona.name} note: {message}"))
        status, error, summary = result.status, result.error, result.summary
        values = dict(steps=result.steps, prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                      llm_seconds=result.llm_seconds, tokens_estimated=getattr(result, "tokens_estimated", False))
        update_row(settings.db, PersonaRun, persona_run_id, status=status, error=error, summary=summary,
                   finished_at=db.utcnow(), **values)
        if summary and persona.deterministic:
            baseline.append(f"{persona.name}: {summary}")
            baseline.extend(f"{persona.name} found: {t}" for t in recorder.titles)
        # Findings are checked, not trusted: each repro_command is re-run in a fresh clone of the same commit.
        from reviewer.run.verify import verify_findings

        verify_findings(settings.db, run_id, persona=persona.name, settings=settings,
                        on_progress=lambda msg: view.step(persona.name, result.steps, "verify", msg,
                                                          prompt_tokens=result.prompt_tokens,
                                                          completion_tokens=result.completion_tokens,
                                                          llm_seconds=result.llm_seconds,
                                                          estimated=values["tokens_estimated"]))
    except KeyboardInterrupt:
        status, error = "interrupted", "interrupted by the user"
        update_row(settings.db, PersonaRun, persona_run_id, status=status, error=error, finished_at=db.utcnow())
    except Exception as e:  # noqa: BLE001 - a persona's crash is recorded and the review goes on with the next one
        status, error = "failed", one_line(e)
        detail = "".join(traceback.format_exception(e)[-3:]).strip() if not isinstance(e, WorkspaceError) else error
        update_row(settings.db, PersonaRun, persona_run_id, status=status, error=detail, finished_at=db.utcnow())
    finally:
        if status == "interrupted":
            # Rows first, cleanup after: a second signal (or a SIGKILL after SIGTERM) must not leave them `running`.
            close_open_rows(settings.db, run_id, "interrupted", f"interrupted during persona {persona.name}")
        note = error or summary or ""
        if ws is not None and status == "failed":
            ws.keep()
            note += f" (workspace kept: {ws.path})"
        elif ws is not None:
            ws.remove()
        view.end(persona.name, status, note)
    return status, error


def finish(run_id: int, status: str, settings, console: Console, ui: Console, json_output: bool) -> int:
    """Assign finding states against earlier runs, then show the run from the database."""
    from reviewer.report import report

    try:
        from reviewer.store import lifecycle

        with db.session(settings.db) as s:
            lifecycle.assign_states(s, run_id)
            s.commit()
    except Exception as e:  # noqa: BLE001 - the findings are stored; only their new/persisting state is missing
        ui.print(f"[yellow]warning:[/yellow] could not compare findings with earlier runs: {escape(one_line(e))}")
    runs = report.collect_runs(settings.db, report.ReportFilter(run_id=run_id))
    if json_output:
        print(json.dumps({"runs": runs}, indent=2))
    else:
        console.print()
        for run in runs:
            # The repository's earlier runs give each measurement its "vs previous run" column.
            earlier = report.collect_runs(settings.db, report.ReportFilter(repo=run["repo"]))
            report.print_run_summary(run, console, report.measurement_history([r for r in earlier if r["id"] <= run_id]))
        where_db = escape(db.display_url(str(settings.db)))  # a PostgreSQL URL's password stays off the screen
        console.print(f"[dim]Stored as run {run_id} in {where_db}; see it again with "
                      f"`reviewer report --db {where_db} --run {run_id}`.[/dim]")
    return {"completed": EXIT_OK, "interrupted": EXIT_INTERRUPTED}.get(status, EXIT_FAILED)
