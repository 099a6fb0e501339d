"""bench/figures.py: docs/figures.md generated from the records in bench/results/, run as the user runs it (a real
subprocess) on the real records and on copies of them with a record added, broken or stripped."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "figures.py"
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))
import figures  # noqa: E402


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_the_real_records_parse_and_the_served_replay_comes_first():
    page = figures.collect(RESULTS)
    assert page.unreadable == []
    assert figures.render(page).split("\n## ")[1].startswith("Served replay")
    replays = sorted(RESULTS.glob("serve_replay_*.json"))
    assert replays and len(page.tables["serve_replay"].rows) == len(replays)
    record = json.loads(replays[0].read_text())
    row = next(r for r in page.tables["serve_replay"].rows if replays[0].name in r[0])
    assert row[4] == figures.fmt(record["speedup"]) and row[6] == f"{record['identical']}/{record['replies']}"
    listed = {f for rs in page.listed.values() for f, _, _ in rs} | set(page.unknown)
    tabled = {r[0].split("]")[0][1:] for t in page.tables.values() for r in t.rows}
    assert listed | tabled == {p.name for p in RESULTS.glob("*.json")}  # every record appears somewhere


def test_forced_conditions_are_said():
    page = figures.collect(RESULTS)
    forced = [r for r in page.tables["spec_e2e"].rows if r[4].startswith("forced_tau")]
    assert forced and all("forced tau" in r[-1] for r in forced)
    traced = [r for r in page.tables["spec_e2e"].rows if "routing_trace" in r[0]]
    assert traced and all("routing trace" in r[-1] for r in traced)
    embedded = [r for r in page.tables["serve_replay"].rows if "embedded" in r[0]]
    assert embedded and all(r[-1] == "measured" for r in embedded)


def test_the_committed_page_is_current():
    result = run("--check")
    assert result.returncode == 0, result.stderr + " (run python bench/figures.py and commit docs/figures.md)"


def test_output_is_stable_and_a_stale_page_is_detected(tmp_path):
    results, out = tmp_path / "results", tmp_path / "figures.md"
    shutil.copytree(RESULTS, results)
    assert run("--results", str(results), "--out", str(out)).returncode == 0
    first = out.read_text()
    assert run("--results", str(results), "--out", str(out)).returncode == 0
    assert out.read_text() == first
    assert run("--results", str(results), "--out", str(out), "--check").returncode == 0
    record = json.loads((RESULTS / "serve_replay_embedded_h200_20261203.json").read_text())
    record["speedup"] = 9.99
    (results / "serve_replay_zz_new.json").write_text(json.dumps(record))
    stale = run("--results", str(results), "--out", str(out), "--check")
    assert stale.returncode == 1 and "stale" in stale.stderr
    assert out.read_text() == first  # --check writes nothing
    assert run("--results", str(results), "--out", str(out)).returncode == 0
    assert "serve_replay_zz_new.json" in out.read_text() and "| 9.99 |" in out.read_text()


def test_a_malformed_record_is_reported_by_name(tmp_path):
    results, out = tmp_path / "results", tmp_path / "figures.md"
    results.mkdir()
    shutil.copy(RESULTS / "serve_replay_embedded_h200_20261203.json", results)
    (results / "broken.json").write_text('{"benchmark": "spec_e2e", ')
    (results / "no_summary.json").write_text(json.dumps({"benchmark": "spec_e2e", "date": "2026-12-03"}))
    (results / "a_list.json").write_text("[1, 2]")
    (results / "mystery.json").write_text(json.dumps({"speed": 3}))
    (results / "new_kind.json").write_text(json.dumps({"benchmark": "new_kind", "date": "2026-12-04",
                                                       "machine": {"cpu": "Some CPU"}}))
    result = run("--results", str(results), "--out", str(out))
    assert result.returncode == 0 and "Traceback" not in result.stderr
    text = out.read_text()
    unreadable = text.split("## Records that could not be read")[1]
    for name in ("broken.json", "no_summary.json", "a_list.json"):
        assert f"`{name}`" in unreadable and name in result.stderr
    assert "[mystery.json]" in text.split("## Records of no known shape")[1]
    assert "| 2026-12-04 | Some CPU | new_kind |" in text.split("## Other records")[1]
    assert "serve_replay_embedded_h200_20261203.json" in text.split("## Served replay")[1]


def test_a_missing_results_folder_is_one_line(tmp_path):
    result = run("--results", str(tmp_path / "nowhere"), "--out", str(tmp_path / "f.md"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "f.md").exists()
