"""`reviewer report` in every format and with every filter, on a real SQLite history (tests/report_data.py)."""

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from reviewer.cli import app
from reviewer.report.report import ReportFilter, collect_runs, measurement_history, report_command
from tests.report_data import COMMITS, OTHER, REPO, fill

runner = CliRunner()


@pytest.fixture(scope="module")
def history_db(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("report") / "reviews.db")
    fill(path)
    return path


def report(db, *args):
    result = runner.invoke(app, ["report", "--db", db, *args])
    return result


def test_json_has_states_and_verification(history_db):
    result = report(history_db, "--format", "json", "--repo", REPO)
    assert result.exit_code == 0, result.output
    runs = json.loads(result.output)["runs"]
    assert [r["commit"] for r in runs] == COMMITS
    by_run = [{(f["title"], f["state"], f["verified"]) for f in r["findings"]} for r in runs]
    assert by_run[0] == {("1 tests failed", "new", True), ("install takes over a minute", "new", None),
                         ("README claims moving_average is linear", "new", False)}
    assert by_run[1] == {("2 tests failed", "persisting", True), ("install takes over a minute", "persisting", None),
                         ("README claims moving_average is linear", "fixed", None)}
    assert by_run[2] == {("1 tests failed", "persisting", True), ("install takes over a minute", "fixed", None)}
    assert by_run[3] == {("2 tests failed", "persisting", True),
                         ("README claims moving_average is linear", "regressed", False)}
    assert runs[0]["measurements"][0]["samples"] and len(runs[0]["measurements"][0]["samples"]) == 5


def test_measurement_history_flags_only_the_real_change(history_db):
    series = {(h["persona"], h["name"]): h for h in measurement_history(collect_runs(history_db, ReportFilter(repo=REPO)))}
    imports = series[("performance", "import_seconds")]["points"]
    assert [p["change"]["changed"] if p["change"] else None for p in imports] == [None, False, True, False]
    assert imports[2]["change"]["ratio"] == pytest.approx(1.3, rel=0.05)
    assert imports[2]["change"]["p"] < 0.01
    installs = series[("smoke", "install_seconds")]["points"]
    assert not any(p["change"]["changed"] for p in installs[1:])  # 3% jitter, never a change


def test_table_groups_by_severity_with_state_and_verification(history_db):
    result = report(history_db, "--repo", REPO, "--run", "4")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Run 4" in out and "Findings (2)" in out
    assert out.index("high") < out.index("medium")  # grouped most severe first
    assert "regressed" in out and "persisting" in out
    wide = Console(file=io.StringIO(), width=200)
    report_command(history_db, ReportFilter(run_id=3), "table", None, wide)
    run3 = wide.file.getvalue()
    # The slow-down shows in the measurement table of its run, with its p; install time's jitter does not.
    assert "+32.9% (p=0.0079, beyond noise)" in run3
    assert "within noise" in run3


def test_markdown_for_an_issue_tracker(history_db):
    result = report(history_db, "--format", "markdown", "--repo", REPO)
    assert result.exit_code == 0, result.output
    md = result.output
    assert md.startswith("# Review report")
    assert f"## Run 3: {REPO} @ `{COMMITS[2][:12]}` (completed)" in md
    assert "#### High (1)" in md and "#### Medium (1)" in md
    assert "- **2 tests failed** in `tests/test_core.py` (smoke, tests) - state: **persisting**, verified" in md
    assert "state: **regressed**, not reproduced" in md
    assert "beyond noise" in md and "within noise" in md
    assert "reproduce: `python -m pytest -q`" in md


@pytest.mark.parametrize("args,titles", [
    (["--state", "fixed"], {"README claims moving_average is linear", "install takes over a minute"}),
    (["--verified-only"], {"1 tests failed", "2 tests failed"}),
    (["--severity", "medium"], {"1 tests failed", "2 tests failed", "README claims moving_average is linear"}),
    (["--persona", "performance"], {"README claims moving_average is linear"}),
])
def test_filters(history_db, args, titles):
    result = report(history_db, "--format", "json", *args)
    assert result.exit_code == 0, result.output
    runs = json.loads(result.output)["runs"]
    assert {f["title"] for r in runs for f in r["findings"]} == titles


def test_since_and_repo_filters(history_db):
    assert json.loads(report(history_db, "--format", "json", "--since", "2999-01-01").output) == {"runs": []}
    runs = json.loads(report(history_db, "--format", "json", "--repo", OTHER).output)["runs"]
    assert [r["status"] for r in runs] == ["failed"]


@pytest.mark.parametrize("args,message", [
    (["--run", "999"], "no run with id 999"),
    (["--severity", "urgent"], "unknown severity 'urgent'"),
    (["--state", "open"], "unknown state 'open'"),
    (["--since", "yesterday"], "--since must be an ISO date"),
    (["--repo", "https://nowhere/x.git"], "no reviews of https://nowhere/x.git"),
])
def test_bad_input_is_one_clear_line(history_db, args, message):
    result = report(history_db, *args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_unwritable_output_is_a_clear_error(history_db, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = report(history_db, "--format", "markdown", "--output", str(blocker / "report.md"))
    assert result.exit_code == 2 and "cannot write" in result.output


def test_empty_database_in_every_format(tmp_path):
    from reviewer.store import db

    path = str(tmp_path / "empty.db")
    db.get_engine(path)
    assert "No reviews in" in report(path).output
    assert "No reviews match" in report(path, "--format", "markdown").output
    out = tmp_path / "r.html"
    assert report(path, "--format", "html", "--output", str(out)).exit_code == 0
    assert "No reviews match" in out.read_text()


def test_output_file(history_db, tmp_path):
    out = tmp_path / "report.md"
    result = report(history_db, "--format", "markdown", "--output", str(out))
    assert result.exit_code == 0 and result.output == ""
    assert out.read_text().startswith("# Review report")
    table = tmp_path / "report.txt"
    assert report(history_db, "--output", str(table)).exit_code == 0
    assert "Findings" in table.read_text()
