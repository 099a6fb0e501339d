"""The foundation: the CLI surface, the worker side without torch, settings, and the report on an empty database."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from reviewer.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()

# Runs Python with torch and the backend made unimportable, as on a worker box that installed only `reviewer`.
NO_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'backend', 'triton', 'reviewer_kernels'):
            raise ImportError(f'{name} is not installed on this worker box')
sys.meta_path.insert(0, Block())
sys.argv = ['reviewer'] + sys.argv[1:]
from reviewer.cli import main
main()
"""


def run_without_torch(*args, cwd):
    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_help_lists_the_seven_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("run", "loop", "report", "serve", "bench", "train", "personas"):
        assert f" {command} " in result.output, command


@pytest.mark.parametrize("command", ["run", "loop", "report", "serve", "bench", "personas", "doctor"])
def test_every_command_has_real_help(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0
    assert "Usage:" in result.output
    # The docstring becomes the help text: a sentence, not just the usage line.
    assert len(result.output.split("Usage:")[1].splitlines()[2].strip()) > 20


@pytest.mark.parametrize("command, defaults", [("run", ["reviews.db", "the default branch", "smoke, performance"]),
                                               ("loop", ["host name", "300"]), ("serve", ["the model's"])])
def test_help_shows_the_defaults_it_names(command, defaults):
    """Rich reads `[default: x]` in a help string as a markup tag and drops it (the help showed "commit to review .");
    the defaults must reach the reader."""
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"}, terminal_width=400)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for default in defaults:
        assert f"default: {default}" in text or f"Default: {default}" in text, (default, text)
    assert " . " not in text, text  # what a dropped tag leaves before its full stop


def test_worker_side_needs_no_torch(tmp_path):
    proc = run_without_torch("report", "--db", str(tmp_path / "missing.db"), "--format", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"runs": []}
    proc = run_without_torch("serve", cwd=tmp_path)
    assert proc.returncode == 2
    assert "pip install 'reviewer[backend]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_report_json_on_missing_database_does_not_create_it(tmp_path):
    db = tmp_path / "none.db"
    result = runner.invoke(app, ["report", "--db", str(db), "--format", "json"])
    assert result.exit_code == 0
    assert json.loads(result.output) == {"runs": []}
    assert not db.exists()


def test_report_json_on_empty_database(tmp_path):
    from reviewer.store import db as store

    path = tmp_path / "empty.db"
    store.get_engine(str(path))
    assert path.exists()
    result = runner.invoke(app, ["report", "--db", str(path), "--format", "json"])
    assert result.exit_code == 0
    assert json.loads(result.output) == {"runs": []}


def test_unknown_run_id_is_one_clear_line(tmp_path):
    result = runner.invoke(app, ["report", "--db", str(tmp_path / "x.db"), "--run", "42"])
    assert result.exit_code == 2
    assert "no run with id 42" in result.output
    assert "Traceback" not in result.output


def test_train_help_lists_every_knob():
    result = runner.invoke(app, ["train", "--help"])
    assert result.exit_code == 0
    for knob in ("--loss", "--attention", "--corruption", "--block-size", "--layers", "--vocab-top-k", "--seed",
                 "--from-db", "--resume", "--decay"):
        assert knob in result.output, knob


def test_bad_config_value_names_the_key(tmp_path):
    (tmp_path / "reviewer.toml").write_text('timeout = "soon"\n')
    proc = run_without_torch("report", "--format", "json", cwd=tmp_path)
    assert proc.returncode == 2
    assert "'timeout'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bad_toml_is_one_line(tmp_path):
    (tmp_path / "reviewer.toml").write_text("timeout = [\n")
    proc = run_without_torch("report", cwd=tmp_path)
    assert proc.returncode == 2
    assert "not valid TOML" in proc.stderr


def test_config_layers(tmp_path, monkeypatch):
    from reviewer.config import load_settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "reviewer").mkdir(parents=True)
    (tmp_path / "home" / "reviewer" / "config.toml").write_text('db = "home.db"\nmodel = "home-model"\n')
    (tmp_path / "reviewer.toml").write_text('db = "local.db"\n')
    monkeypatch.setenv("REVIEWER_LLM", "http://a:1/v1,http://b:2/v1")
    s = load_settings(model=None)
    assert s.db == "local.db"  # working-directory file beats the user's file
    assert s.model == "home-model"  # still read from the user's file
    assert s.llm == ["http://a:1/v1", "http://b:2/v1"]  # environment, comma separated
    assert load_settings(db="cli.db").db == "cli.db"  # command line beats everything
