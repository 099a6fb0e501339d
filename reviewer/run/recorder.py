"""Where a persona's findings, measurements, sandbox events and transcript go: the database, one short transaction
per record, so a crash loses at most the step in flight."""

from __future__ import annotations

import json
import math

from reviewer.store import db
from reviewer.store.db import Finding, Measurement, PersonaRun, SandboxEvent


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
        line = optional_int(line)
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
        repeats = optional_int(repeats)
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


def optional_int(value) -> int | None:
    """A line number or a repeat count as the model gave it: a number, a numeric string, or nothing usable (None)."""
    try:
        return int(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None
