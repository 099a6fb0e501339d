"""Reading reviews back: the JSON report contract and the terminal view.

`collect_runs` is the one query every output format starts from, so the formats never disagree about what a run holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from rich.console import Console
from rich.table import Table
from sqlmodel import select

from reviewer import db
from reviewer.db import Finding, Measurement, PersonaRun, Repository, ReviewRun



class ReportError(Exception):
    """Bad report options or a run that does not exist; one line for the user."""


SEVERITY_ORDER = {s: i for i, s in enumerate(db.SEVERITIES)}
SEVERITY_STYLE = {"critical": "bold red", "high": "red", "medium": "yellow", "low": "cyan", "info": "dim"}


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


def run_to_dict(s, run: ReviewRun, flt: ReportFilter) -> dict:
    repo = s.get(Repository, run.repository_id)
    personas = s.exec(select(PersonaRun).where(PersonaRun.run_id == run.id).order_by(PersonaRun.id)).all()
    findings = s.exec(select(Finding).where(Finding.run_id == run.id).order_by(Finding.id)).all()
    measurements = s.exec(select(Measurement).where(Measurement.run_id == run.id).order_by(Measurement.id)).all()
    if flt.persona:
        personas = [p for p in personas if p.persona == flt.persona]
        findings = [f for f in findings if f.persona == flt.persona]
        measurements = [m for m in measurements if m.persona == flt.persona]
    if flt.severity:
        limit = SEVERITY_ORDER[flt.severity]
        findings = [f for f in findings if SEVERITY_ORDER.get(f.severity, 99) <= limit]
    if flt.state:
        findings = [f for f in findings if f.state == flt.state]
    if flt.verified_only:
        findings = [f for f in findings if f.verified]
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
        "error": run.error,
        "personas": [
            {
                "name": p.persona,
                "status": p.status,
                "steps": p.steps,
                "prompt_tokens": p.prompt_tokens,
                "completion_tokens": p.completion_tokens,
                "llm_seconds": round(p.llm_seconds, 3),
                "summary": p.summary,
                "error": p.error,
            }
            for p in personas
        ],
        "findings": [
            {
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
            }
            for f in findings
        ],
        "measurements": [
            {
                "persona": m.persona,
                "name": m.name,
                "value": m.value,
                "unit": m.unit,
                "command": m.command,
                "repeats": m.repeats,
                "spread": m.spread,
            }
            for m in measurements
        ],
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
            from datetime import datetime

            query = query.where(ReviewRun.started_at >= datetime.fromisoformat(flt.since))
        return [run_to_dict(s, run, flt) for run in s.exec(query).all()]


def print_run_summary(run: dict, console: Console) -> None:
    """The end-of-run view: personas, findings by severity, measurements."""
    console.print(
        f"[bold]Run {run['id']}[/bold] {run['repo']} @ {(run['commit'] or '?')[:12]}  status: {run['status']}"
        + (f"  llm: {run['llm']} ({run['model']})" if run["llm"] else "")
    )
    if run.get("error"):
        console.print(f"[red]error:[/red] {run['error']}")
    personas = Table(title="Personas", show_lines=False)
    for col in ("persona", "status", "steps", "tokens (prompt/completion)", "LLM s"):
        personas.add_column(col)
    for p in run["personas"]:
        personas.add_row(
            p["name"], p["status"], str(p["steps"]), f"{p['prompt_tokens']}/{p['completion_tokens']}", f"{p['llm_seconds']:.1f}"
        )
    console.print(personas)
    findings = sorted(run["findings"], key=lambda f: SEVERITY_ORDER.get(f["severity"], 99))
    table = Table(title=f"Findings ({len(findings)})")
    for col in ("severity", "persona", "title", "where", "state", "verified"):
        table.add_column(col)
    for f in findings:
        where = f"{f['file']}:{f['line']}" if f["file"] and f["line"] else (f["file"] or "")
        verified = {True: "yes", False: "no", None: "-"}[f["verified"]]
        table.add_row(
            f"[{SEVERITY_STYLE.get(f['severity'], '')}]{f['severity']}[/]",
            f["persona"],
            f["title"],
            where,
            f["state"] or "-",
            verified,
        )
    console.print(table)
    if run["measurements"]:
        m_table = Table(title="Measurements")
        for col in ("persona", "name", "value", "unit", "repeats", "command"):
            m_table.add_column(col)
        for m in run["measurements"]:
            m_table.add_row(
                m["persona"], m["name"], f"{m['value']:.4g}", m["unit"], str(m["repeats"] or 1), (m["command"] or "")[:60]
            )
        console.print(m_table)


def validate(flt: ReportFilter) -> None:
    if flt.severity and flt.severity not in db.SEVERITIES:
        raise ReportError(f"unknown severity '{flt.severity}' (one of: {', '.join(db.SEVERITIES)})")
    if flt.state and flt.state not in db.FINDING_STATES:
        raise ReportError(f"unknown state '{flt.state}' (one of: {', '.join(db.FINDING_STATES)})")
    if flt.since:
        try:
            date.fromisoformat(flt.since[:10])
        except ValueError:
            raise ReportError(f"--since must be an ISO date like 2026-11-29, got '{flt.since}'") from None


def report_command(db_path: str, flt: ReportFilter, fmt: str, output: Path | None, console: Console) -> None:
    """`reviewer report`: validate, collect, render in the asked format to stdout or a file."""
    validate(flt)
    if fmt in ("markdown", "html"):
        raise ReportError(f"--format {fmt} lands with the `reviewer loop` / `reviewer report` issue; use table or json")
    runs = collect_runs(db_path, flt)
    if flt.run_id is not None and not runs:
        raise ReportError(f"no run with id {flt.run_id} in {db_path}")
    if fmt == "json":
        text = json.dumps({"runs": runs}, indent=2)
        if output:
            output.write_text(text + "\n")
        else:
            print(text)
        return
    out = Console(file=output.open("w"), width=160) if output else console
    if not runs:
        out.print(f"No reviews in {db_path} yet. Start one with `reviewer run <repo>`.")
    for r in runs:
        print_run_summary(r, out)
