"""Findings tracked across commits instead of repeated: fingerprints, near-duplicate merging, and states.

A fingerprint names "the same problem" across runs: a hash of the persona, the category, the title with its variable
parts taken out, and the file. Within one run, near-duplicates (same fingerprint, or same persona and file with almost
the same title) are merged into the most severe one. Across the runs of one repository each finding is

- `new`: never seen before for this persona;
- `persisting`: also present in the previous run of this persona;
- `regressed`: absent from the previous run but present in an earlier one (it was fixed, and came back);
- `fixed`: present in the previous run and absent from this one. A fixed finding is not reported by anybody in this
  run, so we write a copy of it into this run with state `fixed`; that copy never counts as "present".

"Previous run of this persona" means the latest earlier run of the same repository in which that persona ran its
course (see RAN_ITS_COURSE): a persona that failed or was interrupted neither proves a finding gone nor hides one.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from collections.abc import Iterable, Sequence

from sqlmodel import Session, select

from reviewer.store.db import SEVERITIES, Finding, PersonaRun, ReviewRun

# Persona statuses whose findings describe the commit: the persona stopped on its own or on a budget. `failed` and
# `interrupted` runs are incomplete, so an absent finding there proves nothing.
RAN_ITS_COURSE = ("completed", "step_budget", "token_budget", "timeout")
SIMILAR_TITLE = 0.85

_QUOTED_CHARS = re.compile(r"[\"'`\u2018\u2019\u201c\u201d]")
_PATH = re.compile(r"(?:[\w.~-]*/[\w./~-]+)|(?:\b[\w-]+\.(?:py|js|ts|rs|go|c|h|cpp|md|txt|toml|json|yaml|yml|cfg|ini|sh)\b)")
_HEX = re.compile(r"\b(?:0x)?[0-9a-f]{7,}\b")
_NUMBER = re.compile(r"[-+]?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?%?")
_NON_WORD = re.compile(r"[^\w\s]|_")
_SPACES = re.compile(r"\s+")


def normalize_title(title: str) -> str:
    """Lowercase; quote characters, paths, hex ids and numbers taken out; punctuation dropped; whitespace collapsed.
    "3 tests failed in 'tests/test_core.py'" and "1 tests failed in tests/test_cli.py" both become "tests failed in"."""
    t = title.lower()
    t = _QUOTED_CHARS.sub(" ", t)
    t = _PATH.sub(" ", t)
    t = _HEX.sub(" ", t)
    t = _NUMBER.sub(" ", t)
    t = _NON_WORD.sub(" ", t)
    return _SPACES.sub(" ", t).strip()


def normalize_file(file: str | None) -> str:
    """A workspace-relative path with forward slashes and no line suffix; '' when there is none."""
    if not file:
        return ""
    f = file.strip().replace("\\", "/")
    f = re.sub(r":\d+(?::\d+)?$", "", f)
    while f.startswith("./"):
        f = f[2:]
    return f


def fingerprint(persona: str, category: str, title: str, file: str | None) -> str:
    key = "\x1f".join([persona.strip().lower(), (category or "").strip().lower(), normalize_title(title),
                       normalize_file(file)])
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def _severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity) if severity in SEVERITIES else len(SEVERITIES)


def merge_near_duplicates(findings: Sequence) -> dict[int, int]:
    """Group near-duplicates of one run; returns {duplicate id: kept id}. Works on anything with id, persona,
    category, title, file, severity (Finding rows, or plain objects in tests). The kept finding of a group is the
    most severe one (the earliest on a tie). Two findings are near-duplicates when they have the same fingerprint, or
    the same persona and file and normalized titles at least SIMILAR_TITLE alike (difflib's ratio)."""
    kept: list = []
    duplicates: dict[int, int] = {}
    for f in sorted(findings, key=lambda f: (_severity_rank(f.severity), f.id)):
        fp = fingerprint(f.persona, f.category, f.title, f.file)
        title = normalize_title(f.title)
        for k in kept:
            same_fp = fp == fingerprint(k.persona, k.category, k.title, k.file)
            similar = (f.persona == k.persona and normalize_file(f.file) == normalize_file(k.file)
                       and difflib.SequenceMatcher(None, title, normalize_title(k.title)).ratio() >= SIMILAR_TITLE)
            if same_fp or similar:
                duplicates[f.id] = k.id
                break
        else:
            kept.append(f)
    return duplicates


def _present(s: Session, run_id: int, persona: str) -> list[Finding]:
    """Findings this run reports for this persona (not merged away, not `fixed` copies)."""
    rows = s.exec(select(Finding).where(Finding.run_id == run_id, Finding.persona == persona,
                                        Finding.duplicate_of == None)).all()  # noqa: E711 (SQL NULL)
    return [f for f in rows if f.state != "fixed"]


def fingerprint_run(s: Session, run_id: int, persona: str | None = None) -> None:
    """Fill missing fingerprints (the recorder may not know how) and merge near-duplicates of this run."""
    rows = [f for f in s.exec(select(Finding).where(Finding.run_id == run_id)).all() if f.state != "fixed"]
    if persona is not None:
        rows = [f for f in rows if f.persona == persona]
    for f in rows:
        if not f.fingerprint:
            f.fingerprint = fingerprint(f.persona, f.category, f.title, f.file)
            s.add(f)
    live = [f for f in rows if f.duplicate_of is None]
    by_id = {f.id: f for f in live}
    for dup_id, kept_id in merge_near_duplicates(live).items():
        dup, kept = by_id[dup_id], by_id[kept_id]
        dup.duplicate_of = kept_id
        # Keep what the duplicate knew that the kept one did not; the duplicate row itself stays (nothing lost).
        if not kept.repro_command and dup.repro_command:
            kept.repro_command = dup.repro_command
        if not kept.file and dup.file:
            kept.file, kept.line = dup.file, dup.line
        s.add(dup)
        s.add(kept)
    s.flush()


def _history(s: Session, run: ReviewRun, persona: str) -> list[int]:
    """Ids of earlier runs of the same repository where this persona ran its course, oldest first."""
    rows = s.exec(
        select(ReviewRun.id)
        .join(PersonaRun, PersonaRun.run_id == ReviewRun.id)
        .where(ReviewRun.repository_id == run.repository_id, ReviewRun.id < run.id,
               PersonaRun.persona == persona, PersonaRun.status.in_(RAN_ITS_COURSE))  # type: ignore[attr-defined]
        .order_by(ReviewRun.id)
    ).all()
    return sorted(set(rows))


def _personas_of(s: Session, run_id: int) -> dict[str, str]:
    """persona -> status of its latest PersonaRun in this run."""
    rows = s.exec(select(PersonaRun).where(PersonaRun.run_id == run_id).order_by(PersonaRun.id)).all()
    return {p.persona: p.status for p in rows}


def assign_states(s: Session, run_id: int) -> dict[str, int]:
    """Fingerprint and merge this run's findings, then set `state` on each and write the `fixed` copies. Idempotent:
    running it again replaces this run's earlier `fixed` copies. Returns how many findings got each state."""
    run = s.get(ReviewRun, run_id)
    if run is None:
        raise ValueError(f"no run with id {run_id}")
    for old in s.exec(select(Finding).where(Finding.run_id == run_id, Finding.state == "fixed")).all():
        s.delete(old)
    s.flush()
    fingerprint_run(s, run_id)
    statuses = _personas_of(s, run_id)
    findings_personas = {f.persona for f in s.exec(select(Finding).where(Finding.run_id == run_id)).all()}
    counts = {state: 0 for state in ("new", "persisting", "fixed", "regressed")}
    for persona in sorted(set(statuses) | findings_personas):
        history = _history(s, run, persona)
        seen_before = [{f.fingerprint for f in _present(s, r, persona)} for r in history]
        previous = seen_before[-1] if seen_before else set()
        earlier = set().union(*seen_before) if seen_before else set()
        current = _present(s, run_id, persona)
        for f in current:
            f.state = "persisting" if f.fingerprint in previous else "regressed" if f.fingerprint in earlier else "new"
            counts[f.state] += 1
            s.add(f)
        if statuses.get(persona) not in RAN_ITS_COURSE or not history:
            continue  # an incomplete persona run cannot say a finding is gone
        gone = previous - {f.fingerprint for f in current}
        persona_run = s.exec(select(PersonaRun).where(PersonaRun.run_id == run_id, PersonaRun.persona == persona)
                             .order_by(PersonaRun.id.desc())).first()  # type: ignore[union-attr]
        for old in _present(s, history[-1], persona):
            if old.fingerprint in gone:
                gone.discard(old.fingerprint)
                s.add(Finding(run_id=run_id, persona_run_id=persona_run.id if persona_run else None, persona=persona,
                              title=old.title, severity=old.severity, category=old.category, details=old.details,
                              evidence=old.evidence, repro_command=old.repro_command, file=old.file, line=old.line,
                              fingerprint=old.fingerprint, state="fixed"))
                counts["fixed"] += 1
    s.flush()
    return counts


def lifecycle_of(s: Session, repository_id: int, fingerprints: Iterable[str] | None = None) -> dict[str, dict[int, str]]:
    """fingerprint -> {run id: state} over every run of a repository (for the report's lifecycle grid)."""
    run_ids = s.exec(select(ReviewRun.id).where(ReviewRun.repository_id == repository_id)).all()
    rows = s.exec(select(Finding).where(Finding.run_id.in_(run_ids), Finding.duplicate_of == None)).all()  # type: ignore[attr-defined]  # noqa: E711
    wanted = set(fingerprints) if fingerprints is not None else None
    grid: dict[str, dict[int, str]] = {}
    for f in rows:
        if f.fingerprint and (wanted is None or f.fingerprint in wanted):
            grid.setdefault(f.fingerprint, {})[f.run_id] = f.state or "-"
    return grid
