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
import os
import traceback

from rich.console import Console
from rich.markup import escape
from sqlmodel import select

from reviewer.llm.endpoints import open_llm
from reviewer.llm.errors import LLMError
from reviewer.persona.agent import run_agent
from reviewer.persona.files import Persona
from reviewer.persona.smoke import run_smoke
from reviewer.report import report
from reviewer.run.inputs import DETERMINISTIC_NAMES, CheckedInputs, UserError, check_inputs
from reviewer.run.lock import LockBusy, lock_path, review_lock
from reviewer.run.machine import machine_fingerprint
from reviewer.run.recorder import DbRecorder, update_row
from reviewer.run.recovery import recover, remove_orphans
from reviewer.run.signals import sigterm_as_interrupt, stop_requested
from reviewer.run.task import build_task
from reviewer.run.verify import verify_findings
from reviewer.run.view import LiveView, PersonaState
from reviewer.sandbox import isolation
from reviewer.sandbox.workspace import Target, WorkspaceError, create_workspace, resolve_target
from reviewer.store import db, lifecycle
from reviewer.store.db import PersonaRun, ReviewRun
from reviewer.text import first_line

DETERMINISTIC = {"smoke": run_smoke}  # personas that run code instead of a model
assert tuple(DETERMINISTIC) == DETERMINISTIC_NAMES  # inputs.py checks names without importing the runners
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BUSY, EXIT_INTERRUPTED = 0, 1, 2, 75, 130
ENDED = ("completed", "step_budget", "token_budget", "timeout")


# --- the run -----------------------------------------------------------------------------------------------------------

def error_exit(message: str, code: int = EXIT_USAGE) -> int:
    """One line on stderr, like every other `reviewer` error."""
    Console(stderr=True).print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return code


def run_command(target: str, settings, *, ref: str | None = None, no_wait: bool = False, json_output: bool = False,
                console: Console | None = None, lock_held: bool = False, worker: str | None = None,
                checked: CheckedInputs | None = None) -> int:
    """`reviewer run TARGET`: returns the exit code (0 completed, 1 failed, 2 bad input, 75 machine busy with
    --no-wait, 130 interrupted). `reviewer loop` calls it with `lock_held` (it holds the machine lock from claiming a
    queue row to verification) and its `worker` name, stored on the run. `checked`: the inputs, if the caller checked
    them already (cli.py does, before importing this module)."""
    console = console or Console()
    ui = Console(stderr=True) if json_output else console  # with --json, stdout carries only the JSON
    try:
        checked = checked or check_inputs(target, settings, ref)
    except UserError as e:
        return error_exit(str(e))
    personas, tgt, policy = checked.personas, checked.target, checked.policy
    if checked.note:
        ui.print(f"[yellow]note:[/yellow] {escape(checked.note)}", highlight=False, soft_wrap=True)
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
                raise UserError(f"cannot open the database {db.display_url(settings.db)}: "
                                f"{first_line(e, with_type=True)}") from None
            recover(settings.db, [], ui)  # runs a killed reviewer left `running` on this machine: interrupted
            remove_orphans([settings.workdir], ui)  # and the workspaces and sandbox folders it left behind
            run_id = create_run(settings, tgt, ref, llm, policy, worker)
            status = review_personas(run_id, personas, tgt, settings, llm, ui, where, policy)
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
        close_open_rows(settings.db, run_id, status, first_line(e, with_type=True))
        ui.print(f"[red]error:[/red] {escape(first_line(e, with_type=True))}")
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
    try:
        return stack.enter_context(open_llm(settings, ui))
    except LLMError as e:
        raise UserError(str(e)) from None


def create_run(settings, tgt: Target, ref: str | None, llm, policy: isolation.Policy, worker: str | None = None) -> int:
    with db.session(settings.db) as s:
        repo = db.get_or_create_repository(s, tgt.url)
        run = ReviewRun(repository_id=repo.id, ref=ref or tgt.branch, commit_sha=tgt.commit, status="running",
                        llm=llm.name if llm else None, model=llm.model if llm else None,
                        machine=json.dumps(machine_fingerprint(policy.mode), sort_keys=True), pid=os.getpid(),
                        worker=worker)
        s.add(run)
        s.commit()
        return run.id


def sandbox_line(policy) -> str:
    if policy.mode == "none":
        return ("[bold red]isolation none: the repository's code runs WITHOUT a sandbox, as you, with your files, keys "
                "and network[/bold red] (limits still apply; recorded on every persona run)")
    allow = ", ".join(isolation.egress_proxy.expand_allowlist(policy.network_allow)) or "nothing"
    return f"[dim]sandbox: bubblewrap; network only to {escape(allow)}; see docs/sandbox.md[/dim]"


def review_personas(run_id: int, personas: list[Persona], tgt: Target, settings, llm, ui: Console, where: str,
                    policy: isolation.Policy) -> str:
    """Run every persona in order; returns the run status. Ctrl-C marks the persona and the run interrupted."""
    header = (f"[bold]Reviewing[/bold] {escape(where)}  run {run_id}  personas: {', '.join(p.name for p in personas)}"
              + (f"  llm: {escape(llm.name)} ({escape(llm.model)})" if llm else "")
              + "\n" + sandbox_line(policy))
    view = LiveView(ui, header, [PersonaState(p.name) for p in personas])
    baseline: list[str] = []
    failures: list[str] = []
    with view:
        for persona in personas:
            status, error = run_persona(run_id, persona, tgt, settings, llm, view, baseline, policy)
            if status == "failed":
                failures.append(f"{persona.name}: {error}")
            if status == "interrupted" or stop_requested():  # the latter: a SIGTERM that came out as an error
                raise KeyboardInterrupt  # the persona row is marked; run_command marks the run interrupted
    status = "failed" if failures else "completed"
    update_row(settings.db, ReviewRun, run_id, status=status, finished_at=db.utcnow(),
               error="; ".join(failures) if failures else None)
    return status


def run_persona(run_id: int, persona: Persona, tgt: Target, settings, llm, view: LiveView, baseline: list[str],
                policy: isolation.Policy) -> tuple[str, str | None]:
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
                              policy=policy)
        ws.on_event = recorder.record_sandbox_event
        if persona.deterministic:
            result = DETERMINISTIC[persona.name](
                ws, recorder, timeout=settings.timeout, probes=settings.probes,
                on_step=lambda step, tool, detail: view.step(persona.name, step, tool, detail))
        else:
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
        verify_findings(settings.db, run_id, persona=persona.name, settings=settings, policy=policy,
                        on_progress=lambda msg: view.step(persona.name, result.steps, "verify", msg,
                                                          prompt_tokens=result.prompt_tokens,
                                                          completion_tokens=result.completion_tokens,
                                                          llm_seconds=result.llm_seconds,
                                                          estimated=values["tokens_estimated"]))
    except KeyboardInterrupt:
        status, error = "interrupted", "interrupted by the user"
        update_row(settings.db, PersonaRun, persona_run_id, status=status, error=error, finished_at=db.utcnow())
    except Exception as e:  # noqa: BLE001 - a persona's crash is recorded and the review goes on with the next one
        status, error = "failed", first_line(e, with_type=True)
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
    try:
        with db.session(settings.db) as s:
            lifecycle.assign_states(s, run_id)
            s.commit()
    except Exception as e:  # noqa: BLE001 - the findings are stored; only their new/persisting state is missing
        ui.print(f"[yellow]warning:[/yellow] could not compare findings with earlier runs: "
                 f"{escape(first_line(e, with_type=True))}")
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
