"""The extra training prompts shaped like the reviewer's own traffic (bench/train_extra_prompts.py): tool results in
exactly the format the real tools return, conversations whose tool calls and results pair up, docs and docstrings
read from real files."""

import json
import random
import sys
from pathlib import Path

import pytest

from reviewer.persona.tools import ReadFileArgs, Toolbox
from reviewer.sandbox.workspace import Workspace

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import train_extra_prompts as tx  # noqa: E402


@pytest.fixture
def project(tmp_path):
    """A small project folder: a README, a package with a documented function, a long file."""
    root = tmp_path / "docs" / "demo-project"
    (root / "demo").mkdir(parents=True)
    (root / "README.md").write_text("# demo-project\n\nInstall with `pip install demo-project`.\n\n" + "Usage text. " * 80)
    (root / "demo" / "core.py").write_text(
        'def parse_duration(text):\n    """Parse a duration such as 1h30m into seconds. More words."""\n'
        "    return 0\n\n\ndef _hidden():\n    \"\"\"A private helper that the prompts leave out.\"\"\"\n")
    (root / "long.py").write_text("".join(f"x{i} = {i}\n" for i in range(450)))
    (root / "wide.py").write_text("".join(f"y{i} = '{'w' * 300}'\n" for i in range(100)))  # past the 10,000 cut
    (root / "empty.py").write_text("")
    return root


def test_read_file_output_is_what_the_real_tool_returns(project, tmp_path):
    toolbox = Toolbox(Workspace(root=project, venv=tmp_path / "venv", env={}, commit="0" * 40), recorder=None)
    for rel, limit in [("long.py", 120), ("long.py", 600), ("README.md", 60), ("demo/core.py", 200), ("wide.py", 400),
                       ("empty.py", 400)]:
        real = toolbox.read_file(ReadFileArgs(path=rel, limit=limit)).output
        assert tx.read_file_output(rel, (project / rel).read_text(), limit) == real


def test_doc_files_finds_readmes_and_leaves_out_excluded_texts(project):
    found = tx.doc_files([project.parent])
    assert [p.name for p, _ in found] == ["README.md"]
    assert found[0][1].startswith("# demo-project")
    assert tx.doc_files([project.parent], exclude={found[0][1]}) == []
    assert tx.doc_files([project.parent / "missing"]) == []


def test_agent_conversations_pair_tool_calls_with_results(project):
    from reviewer.persona.tools import TOOLS

    docs = tx.doc_files([project.parent])
    funcs = [("parse_duration", "def parse_duration(text):\n    return 0\n")]
    records = tx.agent_prompts(random.Random(0), docs, funcs, 40)
    assert len(records) == 40 and all(r["category"] == "agent" and r["tools"] == "agent" for r in records)
    names = {t["function"]["name"] for t in TOOLS}
    turns = 0
    for r in records:
        m = r["messages"]
        assert [x["role"] for x in m[:2]] == ["system", "user"] and "# demo-project" in m[1]["content"]
        assert "Top of the repository: README.md, demo/, empty.py, long.py, wide.py" in m[1]["content"]
        for call, result in zip(m[2::2], m[3::2]):
            turns += 1
            [tc] = call["tool_calls"]
            assert call["role"] == "assistant" and tc["function"]["name"] in names
            assert result == {"role": "tool", "tool_call_id": tc["id"], "content": result["content"]}
            args = json.loads(tc["function"]["arguments"])
            if tc["function"]["name"] == "read_file":  # real lines of a real file of the project
                text = (project / args["path"]).read_text()
                assert result["content"] == tx.read_file_output(args["path"], text, args.get("limit", 400))
                assert not text or result["content"].splitlines()[1] == f"     1\t{text.splitlines()[0]}"
            else:
                assert result["content"].startswith("exit code: ")
        assert len(m) % 2 == 0
    assert turns > 30  # zero to three tool turns each


def test_documented_functions_and_coding_prompts(project):
    found = tx.documented_functions([project / "demo" / "core.py"])
    assert found == [("parse_duration", "parse_duration(text)", "Parse a duration such as 1h30m into seconds")]
    [record] = tx.coding_prompts(random.Random(0), found, 5)
    text = record["messages"][0]["content"]
    assert record["category"] == "coding" and "parse_duration(text)" in text and "1h30m into seconds" in text


def test_readme_prompts_quote_the_docs(project):
    docs = tx.doc_files([project.parent])
    records = tx.readme_prompts(random.Random(0), docs, ["About {name}:\n\n{readme}"], 3)
    assert [r["messages"][0]["content"].split(":")[0] for r in records] == ["About demo-project"] * 3
    bodies = [r["messages"][0]["content"].split("\n\n", 1)[1] for r in records]
    assert docs[0][1].startswith(bodies[0]) and len(bodies[0]) >= 600  # the first pass: the top of the README
    assert all(b in docs[0][1] and len(b) >= 300 for b in bodies[1:])  # later passes: other sections of it
