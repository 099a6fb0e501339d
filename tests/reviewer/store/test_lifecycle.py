"""Finding lifecycle on a real SQLite database: fingerprints, near-duplicate merging, new/persisting/fixed/regressed."""

import sqlite3
from types import SimpleNamespace

from sqlmodel import select

from reviewer.store import db
from reviewer.store.lifecycle import (
    assign_states,
    fingerprint,
    lifecycle_of,
    merge_near_duplicates,
    normalize_file,
    normalize_title,
)


def test_normalized_title_drops_the_variable_parts():
    assert normalize_title("3 tests failed in 'tests/test_core.py'") == "tests failed in"
    assert normalize_title("1 Tests  FAILED in tests/test_cli.py") == "tests failed in"
    assert normalize_title('Crash at 0xdeadbeef after "12.5" s') == "crash at after s"
    assert normalize_title("Crash at 0x1f2e3d4c5b") == normalize_title("crash at 0xabcdef0123")


def test_fingerprint_is_stable_and_discriminating():
    a = fingerprint("smoke", "tests", "2 tests failed", "tests/test_core.py:12")
    assert a == fingerprint("smoke", "tests", "5 tests failed", "./tests/test_core.py")
    assert a != fingerprint("docs", "tests", "2 tests failed", "tests/test_core.py")  # other persona
    assert a != fingerprint("smoke", "install", "2 tests failed", "tests/test_core.py")  # other category
    assert a != fingerprint("smoke", "tests", "2 tests failed", "tests/test_cli.py")  # other file
    assert a != fingerprint("smoke", "tests", "2 tests passed", "tests/test_core.py")  # other title
    assert normalize_file(None) == "" and normalize_file(r".\pkg\a.py:3:7") == "pkg/a.py"


def F(id, title, persona="correctness", file="tinystats/core.py", severity="medium", category="bug"):
    return SimpleNamespace(id=id, title=title, persona=persona, file=file, severity=severity, category=category)


def test_near_duplicates_merge_into_the_most_severe():
    findings = [
        F(1, "percentile() ignores the order of its input"),
        F(2, "percentile ignores the order of the input", severity="high"),  # similar title, same file: merged
        F(3, "percentile() ignores the order of its input", file="tinystats/cli.py"),  # other file: kept
        F(4, "moving_average is quadratic"),  # other title: kept
        F(5, "Percentile() ignores the ORDER of its input!", persona="docs"),  # other persona: kept
        F(6, "percentile() ignores the order of its input", severity="low"),  # same fingerprint as 1
    ]
    assert merge_near_duplicates(findings) == {1: 2, 6: 2}


def add_run(s, repo, commit, findings, persona_status="completed", personas=("smoke",)):
    run = db.ReviewRun(repository_id=repo.id, commit_sha=commit, status="completed")
    s.add(run)
    s.flush()
    for p in personas:
        s.add(db.PersonaRun(run_id=run.id, persona=p, status=persona_status))
    for persona, title in findings:
        s.add(db.Finding(run_id=run.id, persona=persona, title=title, severity="high", category="tests",
                         file="tests/test_core.py"))
    s.flush()
    return run


def states(s, run_id):
    rows = s.exec(select(db.Finding).where(db.Finding.run_id == run_id, db.Finding.duplicate_of == None)).all()  # noqa: E711
    return sorted((f.title, f.state) for f in rows)


def test_states_across_runs(tmp_path):
    path = str(tmp_path / "r.db")
    with db.session(path) as s:
        repo = db.get_or_create_repository(s, "file:///repo")
        other = db.get_or_create_repository(s, "file:///other")
        r1 = add_run(s, repo, "c1", [("smoke", "2 tests failed"), ("smoke", "install slow")])
        assert assign_states(s, r1.id) == {"new": 2, "persisting": 0, "fixed": 0, "regressed": 0}
        # Another repository's runs never count as history.
        o1 = add_run(s, other, "x1", [("smoke", "3 tests failed")])
        assign_states(s, o1.id)
        assert states(s, o1.id) == [("3 tests failed", "new")]

        r2 = add_run(s, repo, "c2", [("smoke", "3 tests failed")])  # same problem, other count
        assert assign_states(s, r2.id) == {"new": 0, "persisting": 1, "fixed": 1, "regressed": 0}
        assert states(s, r2.id) == [("3 tests failed", "persisting"), ("install slow", "fixed")]

        # A failed persona run is not history: it neither proves "install slow" gone nor hides the failures.
        r3 = add_run(s, repo, "c3", [], persona_status="failed")
        assert assign_states(s, r3.id) == {"new": 0, "persisting": 0, "fixed": 0, "regressed": 0}

        r4 = add_run(s, repo, "c4", [("smoke", "install slow"), ("smoke", "README is wrong")])
        counts = assign_states(s, r4.id)
        assert states(s, r4.id) == [("3 tests failed", "fixed"), ("README is wrong", "new"),
                                    ("install slow", "regressed")]
        assert counts == {"new": 1, "persisting": 0, "fixed": 1, "regressed": 1}
        # Idempotent: a second pass gives the same rows, not a second `fixed` copy.
        assert assign_states(s, r4.id) == counts
        assert states(s, r4.id) == [("3 tests failed", "fixed"), ("README is wrong", "new"),
                                    ("install slow", "regressed")]

        # A `fixed` copy is not "present": the next run does not call the test failures persisting or fixed again.
        r5 = add_run(s, repo, "c5", [("smoke", "install slow"), ("smoke", "README is wrong")])
        assert assign_states(s, r5.id) == {"new": 0, "persisting": 2, "fixed": 0, "regressed": 0}

        fp = fingerprint("smoke", "tests", "1 tests failed", "tests/test_core.py")
        assert lifecycle_of(s, repo.id, [fp]) == {fp: {r1.id: "new", r2.id: "persisting", r4.id: "fixed"}}
        s.commit()


def test_duplicates_in_a_run_are_merged_not_deleted(tmp_path):
    path = str(tmp_path / "r.db")
    with db.session(path) as s:
        repo = db.get_or_create_repository(s, "file:///repo")
        run = add_run(s, repo, "c1", [("smoke", "2 tests failed"), ("smoke", "2 test failed")])
        s.add(db.Finding(run_id=run.id, persona="smoke", title="2 tests failed", severity="low", category="tests",
                         file="tests/test_core.py", repro_command="pytest -x"))
        s.flush()
        assign_states(s, run.id)
        s.commit()
        rows = s.exec(select(db.Finding).where(db.Finding.run_id == run.id).order_by(db.Finding.id)).all()
        assert [f.duplicate_of for f in rows] == [None, rows[0].id, rows[0].id]
        assert rows[0].state == "new"
        assert rows[0].repro_command == "pytest -x"  # taken over from the duplicate that had one


def test_version_1_database_upgrades_in_place(tmp_path):
    """A database written by schema version 1 (no verification/duplicate_of, no reviewqueue) keeps its rows."""
    path = tmp_path / "v1.db"
    with db.session(str(path)) as s:
        repo = db.get_or_create_repository(s, "file:///x")
        run = db.ReviewRun(repository_id=repo.id, commit_sha="abc", status="completed")
        s.add(run)
        s.flush()
        s.add(db.Finding(run_id=run.id, persona="smoke", title="t", severity="high", category="tests",
                         verified=True))
        s.commit()
    db._engines[db.database_url(str(path))].dispose()
    db._engines.clear()
    con = sqlite3.connect(path)
    con.execute("ALTER TABLE finding DROP COLUMN verification")
    con.execute("ALTER TABLE finding DROP COLUMN duplicate_of")
    con.execute("DROP TABLE reviewqueue")
    con.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    con.commit()
    con.close()

    engine = db.get_engine(str(path))
    con = sqlite3.connect(path)
    columns = {r[1] for r in con.execute("PRAGMA table_info(finding)")}
    assert {"verification", "duplicate_of"} <= columns
    assert con.execute("SELECT title, verified FROM finding").fetchall() == [("t", 1)]
    assert con.execute("SELECT commit_sha FROM reviewrun").fetchall() == [("abc",)]
    assert con.execute("SELECT count(*) FROM reviewqueue").fetchone() == (0,)
    assert con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(db.SCHEMA_VERSION)
    con.close()
    engine.dispose()
    db._engines.clear()
