"""Reading reviews back: the JSON report contract, the terminal view, Markdown and HTML.

`collect_runs` is the one query every output format starts from, so the formats never disagree about what a run holds;
`measurement_history` derives the per-measurement series (and the noise verdicts) from its result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from sqlmodel import select

from reviewer import stats
from reviewer.report.html_report import render_html
from reviewer.sandbox import orphans
from reviewer.store import db, deadruns
from reviewer.store.db import Finding, Measurement, PersonaRun, Repository, ReviewRun
from reviewer.text import first_line


class ReportError(Exception):
    """Bad report options or a run that does not exist; one line for the user."""


SEVERITY_ORDER = {s: i for i, s in enumerate(db.SEVERITIES)}
SEVERITY_STYLE = {"critical": "bold red", "high": "red", "medium": "yellow", "low": "cyan", "info": "dim"}
STATE_STYLE = {"new": "blue", "persisting": "yellow", "fixed": "green", "regressed": "bold red"}
VERIFIED_TEXT = {True: "yes", False: "no", None: "-"}


@dataclass
class ReportFilter:
    repo: str | None = None
    run_id: int | None = None
    persona: str | None = None
    severity: str | None = None  # this level and worse
    state: str | None = None
    since: str | None = None  # ISO date
    verified_only: bool = False


def database_exists(path_or_url: str) -> bool:
    if "://" in path_or_url and not path_or_url.startswith("sqlite:///"):
        return True
    return Path(path_or_url.removeprefix("sqlite:///")).expanduser().exists()


def measurement_samples(m: Measurement) -> list[float]:
    """The raw repeats when they were stored, else the single value."""
    samples = db.loads(m.samples, None)
    if isinstance(samples, list) and samples and all(isinstance(v, (int, float)) for v in samples):
        return [float(v) for v in samples]
    return [float(m.value)]


@dataclass
class RunRows:
    """One run's stored rows, oldest first. findings: without the near-duplicates merged into another; merged: how
    many each kept finding absorbed (by finding id)."""

    personas: list[PersonaRun]
    findings: list[Finding]
    measurements: list[Measurement]
    events: list[db.SandboxEvent]
    merged: dict[int, int]


def load_run_rows(s, run: ReviewRun) -> RunRows:
    personas = s.exec(select(PersonaRun).where(PersonaRun.run_id == run.id).order_by(PersonaRun.id)).all()
    all_findings = s.exec(select(Finding).where(Finding.run_id == run.id).order_by(Finding.id)).all()
    measurements = s.exec(select(Measurement).where(Measurement.run_id == run.id).order_by(Measurement.id)).all()
    events = s.exec(select(db.SandboxEvent).where(db.SandboxEvent.run_id == run.id).order_by(db.SandboxEvent.id)).all()
    # Near-duplicates merged into another finding are hidden; the kept one says how many it absorbed.
    merged: dict[int, int] = {}
    for f in all_findings:
        if f.duplicate_of is not None:
            merged[f.duplicate_of] = merged.get(f.duplicate_of, 0) + 1
    findings = [f for f in all_findings if f.duplicate_of is None]
    return RunRows(list(personas), findings, list(measurements), list(events), merged)


def filter_rows(rows: RunRows, flt: ReportFilter) -> RunRows:
    """The rows the filter keeps: --persona narrows every kind of row; severity, state and verified only findings."""
    personas, findings, measurements, events = rows.personas, rows.findings, rows.measurements, rows.events
    if flt.persona:
        personas = [p for p in personas if p.persona == flt.persona]
        findings = [f for f in findings if f.persona == flt.persona]
        measurements = [m for m in measurements if m.persona == flt.persona]
        events = [e for e in events if e.persona == flt.persona]
    if flt.severity:
        limit = SEVERITY_ORDER[flt.severity]
        findings = [f for f in findings if SEVERITY_ORDER.get(f.severity, 99) <= limit]
    if flt.state:
        findings = [f for f in findings if f.state == flt.state]
    if flt.verified_only:
        findings = [f for f in findings if f.verified]
    return RunRows(personas, findings, measurements, events, rows.merged)


def event_to_dict(e: db.SandboxEvent) -> dict:
    return {"persona": e.persona, "kind": e.kind, "detail": e.detail, "command": e.command, "inferred": e.inferred,
            "at": db.iso(e.created_at)}


def persona_to_dict(p: PersonaRun) -> dict:
    return {
        "name": p.persona,
        "status": p.status,
        "steps": p.steps,
        "prompt_tokens": p.prompt_tokens,
        "completion_tokens": p.completion_tokens,
        # true: the server reported no usage and the counts are estimates; null: not recorded (before v4)
        "tokens_estimated": p.tokens_estimated,
        "llm_seconds": round(p.llm_seconds, 3),
        "summary": p.summary,
        "error": p.error,
    }


def finding_to_dict(f: Finding, duplicates: int) -> dict:
    return {
        "id": f.id,
        "persona": f.persona,
        "title": f.title,
        "severity": f.severity,
        "category": f.category,
        "details": f.details,
        "evidence": f.evidence,
        "repro_command": f.repro_command,
        "file": f.file,
        "line": f.line,
        "fingerprint": f.fingerprint,
        "state": f.state,
        "verified": f.verified,
        "verification": f.verification,
        "duplicates": duplicates,
    }


def measurement_to_dict(m: Measurement) -> dict:
    return {
        "persona": m.persona,
        "name": m.name,
        "value": m.value,
        "unit": m.unit,
        "command": m.command,
        "repeats": m.repeats,
        "spread": m.spread,
        "samples": measurement_samples(m),
    }


def run_to_dict(s, run: ReviewRun, flt: ReportFilter) -> dict:
    """One run as the JSON report contract has it, its rows narrowed by the filter."""
    repo = s.get(Repository, run.repository_id)
    rows = filter_rows(load_run_rows(s, run), flt)
    return {
        "id": run.id,
        "repo": repo.url if repo else None,
        "ref": run.ref,
        "commit": run.commit_sha,
        "started_at": db.iso(run.started_at),
        "finished_at": db.iso(run.finished_at),
        "status": run.status,
        "llm": run.llm,
        "model": run.model,
        "machine": run.machine,
        "worker": run.worker,  # the `reviewer loop` worker that ran it (None for `reviewer run`)
        "error": run.error,
        # What the sandbox blocked or contained (docs/sandbox.md); `inferred`: read from the command's output.
        "sandbox_events": [event_to_dict(e) for e in rows.events],
        "personas": [persona_to_dict(p) for p in rows.personas],
        "findings": [finding_to_dict(f, rows.merged.get(f.id, 0)) for f in rows.findings],
        "measurements": [measurement_to_dict(m) for m in rows.measurements],
    }


def collect_runs(db_path: str, flt: ReportFilter | None = None) -> list[dict]:
    """All runs matching the filter, oldest first, as plain dicts (the JSON contract)."""
    flt = flt or ReportFilter()
    if not database_exists(db_path):
        return []
    with db.session(db_path) as s:
        query = select(ReviewRun).order_by(ReviewRun.id)
        if flt.run_id is not None:
            query = query.where(ReviewRun.id == flt.run_id)
        if flt.repo:
            repo = s.exec(select(Repository).where(Repository.url == flt.repo)).first()
            if repo is None:
                return []
            query = query.where(ReviewRun.repository_id == repo.id)
        if flt.since:
            since = datetime.fromisoformat(flt.since)  # a date or a date and time; UTC unless it says otherwise
            query = query.where(ReviewRun.started_at >= (since if since.tzinfo else since.replace(tzinfo=timezone.utc)))
        return [run_to_dict(s, run, flt) for run in s.exec(query).all()]


def measurement_history(runs: list[dict]) -> list[dict]:
    """One series per (repository, persona, measurement name), a point per run in run order: the repeats' median,
    min, max and spread, and `change` against the previous point (stats.compare: changed, p, ratio, method)."""
    series: dict[tuple, dict] = {}
    for run in runs:
        per_run: dict[tuple, list[float]] = {}
        units: dict[tuple, str] = {}
        for m in run["measurements"]:
            key = (run["repo"], m["persona"], m["name"])
            per_run.setdefault(key, []).extend(m["samples"])
            units[key] = m["unit"]
        for key, samples in per_run.items():
            entry = series.setdefault(key, {"repo": key[0], "persona": key[1], "name": key[2], "unit": units[key],
                                            "points": []})
            previous = entry["points"][-1] if entry["points"] else None
            change = None
            if previous is not None:
                c = stats.compare(previous["samples"], samples)
                change = {"changed": c.changed, "p": c.p, "ratio": c.ratio, "method": c.method}
            entry["points"].append({
                "run_id": run["id"], "commit": run["commit"], "started_at": run["started_at"], "samples": samples,
                "n": len(samples), "median": stats.median(samples), "min": min(samples), "max": max(samples),
                "spread": stats.spread(samples), "change": change,
            })
    return list(series.values())


def change_text(change: dict | None) -> str:
    """'+23% (p=0.008, beyond noise)', '+2% (within noise)', 'n/a' ..."""
    if not change:
        return "first"
    pct = (change["ratio"] - 1) * 100
    if change["method"] == "too few samples":
        return f"{pct:+.1f}% (too few repeats to judge)"
    p = f"p={change['p']:.2g}, " if change["p"] is not None else ""
    return f"{pct:+.1f}% ({p}{'beyond noise' if change['changed'] else 'within noise'})"


def _changes_for_run(history: list[dict] | None, run: dict) -> dict[tuple, dict]:
    out = {}
    for h in history or []:
        for p in h["points"]:
            if p["run_id"] == run["id"]:
                out[(h["persona"], h["name"])] = p
    return out


def token_cell(p: dict) -> str:
    """Token counts, marked when they are estimates (the server reported no usage)."""
    counts = f"{p['prompt_tokens']}/{p['completion_tokens']}"
    return f"~{counts} (estimated)" if p.get("tokens_estimated") else counts


def rate_cell(p: dict) -> str:
    """Decoding speed over the persona's LLM time: from the server's counts, or marked as an estimate."""
    if not p.get("llm_seconds") or not p.get("completion_tokens"):
        return "-"
    rate = f"{p['completion_tokens'] / p['llm_seconds']:.1f}"
    return f"~{rate} (estimated)" if p.get("tokens_estimated") else rate


def print_run_summary(run: dict, console: Console, history: list[dict] | None = None) -> None:
    """The end-of-run view: personas, findings grouped by severity with state and verification, measurements."""
    console.print(
        f"[bold]Run {run['id']}[/bold] {escape(str(run['repo']))} @ {(run['commit'] or '?')[:12]}  status: {run['status']}"
        + (f"  llm: {escape(str(run['llm']))} ({escape(str(run['model']))})" if run["llm"] else "")
        + (f"  worker: {escape(str(run['worker']))}" if run.get("worker") else "")
    )
    if run.get("error"):
        console.print(f"[red]error:[/red] {escape(run['error'])}")
    personas = Table(title="Personas", show_lines=False)
    for col in ("persona", "status", "steps", "tokens (prompt/completion)", "LLM s", "tok/s"):
        personas.add_column(col)
    for p in run["personas"]:
        personas.add_row(p["name"], p["status"], str(p["steps"]), token_cell(p), f"{p['llm_seconds']:.1f}", rate_cell(p))
    console.print(personas)
    table = Table(title=f"Findings ({len(run['findings'])})")
    for col in ("severity", "persona", "title", "where", "state", "verified"):
        table.add_column(col)
    for severity in (*db.SEVERITIES, None):
        group = [f for f in run["findings"] if (f["severity"] if f["severity"] in SEVERITY_ORDER else None) == severity]
        if not group:
            continue
        if table.row_count:
            table.add_section()
        for f in group:
            where = f"{f['file']}:{f['line']}" if f["file"] and f["line"] else (f["file"] or "")
            state = f["state"] or "-"
            title = f["title"] + (f" (+{f['duplicates']} merged)" if f.get("duplicates") else "")
            table.add_row(
                f"[{SEVERITY_STYLE.get(f['severity'], '')}]{escape(f['severity'])}[/]",
                escape(f["persona"]),
                escape(title),
                escape(where),
                f"[{STATE_STYLE.get(state, '')}]{state}[/]" if state in STATE_STYLE else state,
                VERIFIED_TEXT[f["verified"]],
            )
    console.print(table)
    if run.get("sandbox_events"):
        ev_table = Table(title=f"Sandbox events ({len(run['sandbox_events'])}): blocked or contained")
        for col in ("persona", "kind", "detail", "command"):
            ev_table.add_column(col)
        for e in run["sandbox_events"]:
            style = "bold red" if e["kind"] == "isolation_disabled" else "yellow"
            ev_table.add_row(escape(e["persona"]), f"[{style}]{escape(e['kind'])}[/]" + (" (inferred)" if e["inferred"] else ""),
                             escape(e["detail"]), escape((e["command"] or "")[:60]))
        console.print(ev_table)
    if run["measurements"]:
        points = _changes_for_run(history, run)
        m_table = Table(title="Measurements")
        for col in ("persona", "name", "value", "unit", "repeats", "spread", "vs previous run", "command"):
            m_table.add_column(col)
        for m in run["measurements"]:
            point = points.get((m["persona"], m["name"]))
            spread = f"{point['spread'] * 100:.1f}%" if point and point["n"] > 1 else "-"
            m_table.add_row(
                escape(m["persona"]), escape(m["name"]), f"{m['value']:.4g}", escape(m["unit"]), str(m["repeats"] or 1),
                spread, change_text(point["change"]) if point else "-", escape((m["command"] or "")[:60]),
            )
        console.print(m_table)


def _md(text: str | None) -> str:
    """Text safe inside a Markdown table cell or list item."""
    return (text or "").replace("|", "\\|").replace("\n", " ")


def render_markdown(runs: list[dict], history: list[dict], *, source: str) -> str:
    """Markdown for pasting into an issue tracker: each run with its findings by severity, then the measurements."""
    lines = ["# Review report", "", f"{len(runs)} run(s) from `{source}`.", ""]
    if not runs:
        lines.append("No reviews match. Start one with `reviewer run <repo>`.")
    for run in runs:
        lines += [f"## Run {run['id']}: {run['repo']} @ `{(run['commit'] or '?')[:12]}` ({run['status']})", ""]
        lines.append(f"Started {run['started_at']}" + (f", LLM {run['llm']} ({run['model']})" if run["llm"] else "") + ".")
        if run.get("error"):
            lines.append(f"Error: {_md(run['error'])}")
        lines.append("")
        if run["personas"]:
            lines += ["| persona | status | steps | tokens (prompt/completion) | tok/s |", "|---|---|---|---|---|"]
            lines += [f"| {p['name']} | {p['status']} | {p['steps']} | {token_cell(p)} | {rate_cell(p)} |"
                      for p in run["personas"]]
            lines.append("")
        if run.get("sandbox_events"):
            lines += [f"### Sandbox events ({len(run['sandbox_events'])})", "", "| persona | kind | detail | command |",
                      "|---|---|---|---|"]
            lines += [f"| {e['persona']} | {e['kind']}{' (inferred)' if e['inferred'] else ''} | {_md(e['detail'])} | "
                      f"`{_md((e['command'] or '')[:80])}` |" for e in run["sandbox_events"]]
            lines.append("")
        lines += [f"### Findings ({len(run['findings'])})", ""]
        for severity in db.SEVERITIES:
            group = [f for f in run["findings"] if f["severity"] == severity]
            if not group:
                continue
            lines += [f"#### {severity.capitalize()} ({len(group)})", ""]
            for f in group:
                where = f" in `{f['file']}{':' + str(f['line']) if f['line'] else ''}`" if f["file"] else ""
                verified = {True: "verified", False: "not reproduced", None: "unverified"}[f["verified"]]
                lines.append(f"- **{_md(f['title'])}**{where} ({f['persona']}, {f['category']}) - "
                             f"state: **{f['state'] or '-'}**, {verified}")
                if f["details"]:
                    lines += ["", *[f"  > {line}" for line in f["details"].strip().splitlines()[:20]], ""]
                if f["repro_command"] and "\n" in f["repro_command"]:  # a probe's script: a fenced block
                    lines += ["  - reproduce:", "", "    ```", *[f"    {ln}" for ln in f["repro_command"].splitlines()],
                              "    ```", ""]
                elif f["repro_command"]:
                    lines.append(f"  - reproduce: `{_md(f['repro_command'])}`")
            lines.append("")
        if run["measurements"]:
            points = _changes_for_run(history, run)
            lines += ["### Measurements", "", "| persona | name | median | unit | n | spread | vs previous run |",
                      "|---|---|---|---|---|---|---|"]
            seen = set()
            for m in run["measurements"]:
                key = (m["persona"], m["name"])
                if key in seen:
                    continue
                seen.add(key)
                p = points.get(key)
                if p is None:
                    continue
                spread = f"{p['spread'] * 100:.1f}%" if p["n"] > 1 else "-"
                lines.append(f"| {m['persona']} | {_md(m['name'])} | {p['median']:.4g} | {m['unit']} | {p['n']} | "
                             f"{spread} | {change_text(p['change'])} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def validate(flt: ReportFilter) -> None:
    if flt.severity and flt.severity not in db.SEVERITIES:
        raise ReportError(f"unknown severity '{flt.severity}' (one of: {', '.join(db.SEVERITIES)})")
    if flt.state and flt.state not in db.FINDING_STATES:
        raise ReportError(f"unknown state '{flt.state}' (one of: {', '.join(db.FINDING_STATES)})")
    if flt.since:
        try:
            date.fromisoformat(flt.since[:10])
            datetime.fromisoformat(flt.since)
        except ValueError:
            raise ReportError(f"--since must be an ISO date like 2026-11-29, got '{flt.since}'") from None


def known_repositories(db_path: str) -> list[str]:
    if not database_exists(db_path):
        return []
    with db.session(db_path) as s:
        return list(s.exec(select(Repository.url).order_by(Repository.id)).all())


def filters_text(flt: ReportFilter) -> str:
    given = [f"{k}={v}" for k, v in vars(flt).items() if v not in (None, False)]
    return f" (filters: {', '.join(given)})" if given else ""


def check_output(output: Path | None) -> None:
    """The folder of -o must exist: a typo in it is an error, not a folder made on the way (nothing is written)."""
    if output is not None and not output.expanduser().parent.is_dir():
        raise ReportError(f"cannot write {output}: the folder {output.expanduser().parent} does not exist")


def check_database_path(db_path: str) -> None:
    """A database file that is not there yet means no reviews yet; a folder that is not there is a typo."""
    if "://" in db_path and not db_path.startswith("sqlite:///"):
        return
    path = Path(db_path.removeprefix("sqlite:///")).expanduser()
    if not path.exists() and not path.parent.is_dir():
        raise ReportError(f"no database at {db_path}: the folder {path.parent} does not exist")


def write_text(text: str, output: Path | None) -> None:
    if output is None:
        print(text, end="" if text.endswith("\n") else "\n")
        return
    try:
        output.expanduser().write_text(text if text.endswith("\n") else text + "\n")
    except OSError as e:
        raise ReportError(f"cannot write {output}: {e.strerror or e}") from None


def open_and_reconcile(db_path: str, workdir: Path | None = None) -> None:
    """Open the database (a file that is not one is a one-line ReportError), then mark the runs of this machine whose
    process is gone `interrupted` (store/deadruns.py) and remove the workspaces (and their mounted disk images) and
    sandbox folders of dead processes (sandbox/orphans.py), the same two calls `reviewer run` makes before it starts:
    a report never shows a killed review as running, and the first command to notice it is dead cleans up after it.
    What it says about them goes to stderr (stdout may be JSON)."""
    try:
        db.get_engine(db_path)
    except Exception as e:  # noqa: BLE001 - not a database, a newer schema, unreadable: one line
        raise ReportError(f"cannot open the database {db.display_url(db_path)}: {first_line(e)}") from None
    err = Console(stderr=True)
    try:
        with db.session(db_path) as s:
            dead = deadruns.interrupt_dead_runs(s)
            s.commit()
        for run in dead:
            err.print(f"[yellow]{escape(run.message)}[/yellow]", highlight=False, soft_wrap=True)
    except Exception as e:  # noqa: BLE001 - a read-only database: report what is stored, and say why it may be stale
        err.print(f"[yellow]warning:[/yellow] could not mark dead runs interrupted: {escape(first_line(e))}",
                  highlight=False)
    if removed := orphans.remove_orphans([workdir]):
        err.print(f"[yellow]{escape(orphans.removed_note(removed))}[/yellow]", highlight=False, soft_wrap=True)


def report_command(db_path: str, flt: ReportFilter, fmt: str, output: Path | None, console: Console,
                   workdir: Path | None = None) -> None:
    """`reviewer report`: validate, reconcile dead runs (and clean up after them), collect, render in the asked format
    to stdout or a file. `workdir`: where reviews make their workspaces (besides the temporary folder)."""
    validate(flt)
    if fmt not in ("table", "markdown", "json", "html"):
        raise ReportError(f"unknown format '{fmt}' (one of: table, markdown, json, html)")
    check_output(output)
    check_database_path(db_path)
    if database_exists(db_path):
        open_and_reconcile(db_path, workdir)
    if flt.repo and database_exists(db_path) and flt.repo not in (repos := known_repositories(db_path)):
        known = ", ".join(repos) if repos else "none yet"
        raise ReportError(f"no reviews of {flt.repo} in {db_path} (repositories: {known})")
    runs = collect_runs(db_path, flt)
    if flt.run_id is not None and not runs:
        raise ReportError(f"no run with id {flt.run_id} in {db_path}")
    if fmt == "json":
        write_text(json.dumps({"runs": runs}, indent=2), output)
        return
    # Noise verdicts compare each run with the previous one of its repository, whatever the run/date/finding filters.
    history = measurement_history(collect_runs(db_path, ReportFilter(repo=flt.repo, persona=flt.persona)))
    if fmt == "markdown":
        write_text(render_markdown(runs, history, source=db_path), output)
        return
    if fmt == "html":
        write_text(render_html(runs, history, source=db_path, filters=filters_text(flt)), output)
        if output is not None:
            console.print(f"Wrote {output} ({len(runs)} run(s)).")
        return
    if output is None:
        print_table(runs, history, db_path, console)
        return
    try:
        with output.expanduser().open("w") as handle:
            print_table(runs, history, db_path, Console(file=handle, width=160))
    except OSError as e:
        raise ReportError(f"cannot write {output}: {e.strerror or e}") from None


def print_table(runs: list[dict], history: list[dict], db_path: str, out: Console) -> None:
    if not runs:
        out.print(f"No reviews in {db_path} yet. Start one with `reviewer run <repo>`.")
    for r in runs:
        print_run_summary(r, out, history)
