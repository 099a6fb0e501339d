"""Storage: schema creation, WAL, the stored version, and in-place upgrades that never drop data."""

import sqlite3

import pytest
from sqlmodel import select

from reviewer.store import db


def test_new_database_is_wal_and_versioned(tmp_path):
    path = tmp_path / "r.db"
    db.get_engine(str(path))
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(db.SCHEMA_VERSION)
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"repository", "reviewrun", "personarun", "finding", "measurement", "meta"} <= tables


def test_upgrade_keeps_rows_and_adds_columns(tmp_path, monkeypatch):
    path = tmp_path / "old.db"
    with db.session(str(path)) as s:
        repo = db.get_or_create_repository(s, "file:///x")
        s.add(db.ReviewRun(repository_id=repo.id, commit_sha="abc", status="completed"))
        s.commit()
    db._engines.clear()

    # A future schema version that adds a column: the upgrade must add it and keep the old row.
    future = db.SCHEMA_VERSION + 1

    def add_note(conn):
        db.add_column(conn, "reviewrun", "note", "TEXT")

    monkeypatch.setattr(db, "SCHEMA_VERSION", future)
    monkeypatch.setitem(db.MIGRATIONS, future, add_note)
    engine = db.get_engine(str(path))
    con = sqlite3.connect(path)
    assert "note" in {r[1] for r in con.execute("PRAGMA table_info(reviewrun)")}
    assert con.execute("SELECT commit_sha FROM reviewrun").fetchall() == [("abc",)]
    assert con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(future)
    engine.dispose()
    db._engines.clear()


def test_newer_database_is_refused(tmp_path):
    path = tmp_path / "new.db"
    db.get_engine(str(path))
    db._engines.clear()
    con = sqlite3.connect(path)
    con.execute("UPDATE meta SET value='999' WHERE key='schema_version'")
    con.commit()
    with pytest.raises(RuntimeError, match="newer than this reviewer"):
        db.get_engine(str(path))
    db._engines.clear()


def test_rows_round_trip(tmp_path):
    path = str(tmp_path / "r.db")
    with db.session(path) as s:
        repo = db.get_or_create_repository(s, "https://example.org/x.git")
        run = db.ReviewRun(repository_id=repo.id, status="running")
        s.add(run)
        s.flush()
        s.add(db.Finding(run_id=run.id, persona="smoke", title="t", severity="high", category="tests"))
        s.add(db.Measurement(run_id=run.id, persona="smoke", name="install_seconds", value=1.5, unit="s"))
        s.commit()
    with db.session(path) as s:
        assert db.get_or_create_repository(s, "https://example.org/x.git").id == repo.id
        assert s.exec(select(db.Finding)).one().title == "t"
        assert s.exec(select(db.Measurement)).one().value == 1.5
