"""The agent loop against the scripted model, through the real openai SDK on a real socket, with a real Workspace
(real bash subprocesses) and, in one test, the real SQLite recorder of `reviewer run`."""

from __future__ import annotations

import json
import time

import pytest
from sqlmodel import select

from reviewer.config import Settings
from reviewer.llm.endpoints import open_llm
from reviewer.persona.agent import ELIDED, fit_context, parse_text_calls, run_agent
from reviewer.persona.files import Persona, load_personas
from reviewer.sandbox.command import sandbox_env
from reviewer.sandbox.workspace import Workspace
from reviewer.store import db
from tests.scripted_llm import fail, raw_tool, scripted_llm, text, tool  # noqa: F401  (scripted_llm is a fixture)

PERSONA = Persona(name="tester", description="test persona", system_prompt="You are a careful tester. SYSTEM-MARKER",
                  max_steps=10)
TASK = "Review the repository in your working directory. TASK-MARKER"


class ListRecorder:
    """The Recorder protocol kept in memory; `saves` remembers how many messages each transcript save held."""

    def __init__(self):
        self.findings, self.measurements, self.saves = [], [], []

    def record_finding(self, **kwargs) -> int:
        self.findings.append(kwargs)
        return len(self.findings)

    def record_measurement(self, **kwargs) -> int:
        self.measurements.append(kwargs)
        return len(self.measurements)

    def save_transcript(self, messages, *, steps, prompt_tokens, completion_tokens, llm_seconds,
                        tokens_estimated=False) -> None:
        self.saves.append({"messages": json.loads(json.dumps(messages)), "steps": steps,
                           "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens})


@pytest.fixture
def workspace(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "README.md").write_text("# demo\n\nline two\n")
    for folder in ("home", "tmp"):
        (tmp_path / folder).mkdir()
    env = sandbox_env(home=tmp_path / "home", tmp=tmp_path / "tmp")
    return Workspace(root=root, venv=tmp_path / "venv", env=env, commit="0" * 40, command_timeout=60)


def run(server, workspace, recorder, *, stream=True, persona=PERSONA, **kwargs):
    kwargs.setdefault("max_steps", 10)
    kwargs.setdefault("timeout", 60)
    with open_llm(Settings(llm=[server.base_url])) as llm:
        llm.stream = stream
        llm.retry.base_delay = 0.01
        return run_agent(persona, workspace, llm, recorder, task=TASK, **kwargs)


def last_message(request: dict) -> dict:
    return request["messages"][-1]


@pytest.mark.parametrize("stream", [True, False])
def test_tool_results_are_fed_back_and_records_reach_the_recorder(scripted_llm, workspace, stream):
    def after_bash(req):
        msg = last_message(req)
        assert msg["role"] == "tool"
        assert "exit code: 0" in msg["content"] and "hello-from-the-workspace" in msg["content"]
        assert str(workspace.root) in msg["content"]  # pwd ran in the workspace
        return tool("record_finding", title="median is wrong for even lengths", severity="High", category="correctness",
                    details="median([1,2,3,4]) gives 3", repro_command="python -c 'assert False'", file="core.py",
                    line=21)

    def after_finding(req):
        assert "finding #1 recorded: [high]" in last_message(req)["content"]
        return tool("record_measurement", name="mean n=1e6", value=0.25, unit="s", command="python bench.py",
                    repeats=5)

    server = scripted_llm([tool("bash", command="echo hello-from-the-workspace && pwd"), after_bash, after_finding,
                           tool("finish", summary="one bug, one number")])
    recorder = ListRecorder()
    steps_seen = []
    result = run(server, workspace, recorder, stream=stream, on_step=steps_seen.append)

    assert result.status == "completed" and result.summary == "one bug, one number" and result.error is None
    assert result.steps == 4 and [e.tool for e in steps_seen] == ["bash", "record_finding", "record_measurement",
                                                                   "finish"]
    assert recorder.findings == [{"title": "median is wrong for even lengths", "severity": "high",
                                  "category": "correctness", "details": "median([1,2,3,4]) gives 3", "evidence": None,
                                  "repro_command": "python -c 'assert False'", "file": "core.py", "line": 21}]
    assert recorder.measurements == [{"name": "mean n=1e6", "value": 0.25, "unit": "s", "command": "python bench.py",
                                      "repeats": 5}]
    # the server's own usage numbers are what is counted, and the step events carry the running totals
    assert result.prompt_tokens == sum(len(json.dumps(r["messages"])) // 4 + len(json.dumps(r["tools"])) // 4
                                       for r in server.requests)
    assert steps_seen[-1].prompt_tokens == result.prompt_tokens and result.completion_tokens > 0
    # the transcript was saved after every step, growing each time, and once more at the end
    assert [s["steps"] for s in recorder.saves] == [1, 2, 3, 4, 4]
    sizes = [len(s["messages"]) for s in recorder.saves]
    assert sizes == sorted(sizes) and sizes[-1] == 2 + 4 * 2
    assert recorder.saves[-1]["messages"][0] == {"role": "system", "content": PERSONA.system_prompt}
    assert all(r.get("stream", False) is stream for r in server.requests)
    assert server.requests[0]["tools"][0]["function"]["name"] == "bash"


def test_garbage_replies_end_with_the_step_budget_and_count_format_errors(scripted_llm, workspace):
    server = scripted_llm([], after=text("I believe the repository is fine. Nothing else to say."))
    recorder = ListRecorder()
    result = run(server, workspace, recorder, max_steps=4)
    assert result.status == "step_budget" and result.format_errors == 4 and result.steps == 4
    assert "4 of 4 replies had no usable tool call" in result.error
    assert len(server.requests) == 4
    # every reply after the first saw the correction, and the model was told when its steps ran low
    assert all("Your reply contained no tool call" in last_message(r)["content"] for r in server.requests[1:])
    assert ["steps left" in last_message(r)["content"] or "step left" in last_message(r)["content"]
            for r in server.requests] == [False, True, False, True]


def test_text_fallback_fenced_bash_tool_call_json_and_qwen_xml(scripted_llm, workspace):
    def after_fence(req):
        msg = last_message(req)
        assert msg["role"] == "user" and msg["content"].startswith("Result of bash:")
        assert "fenced-ok" in msg["content"]
        return text('Writing notes.\n<tool_call>{"name": "write_file", "arguments": '
                    '{"path": "notes/out.txt", "content": "written by the model"}}</tool_call>')

    def after_write(req):
        assert "wrote 20 characters to notes/out.txt" in last_message(req)["content"]
        return text("<think>maybe ```bash\nrm -rf /\n``` no</think>\n<tool_call>\n<function=finish>\n"
                    "<parameter=summary>\nall done\n</parameter>\n</function>\n</tool_call>")

    server = scripted_llm([text("Let me look around.\n```bash\necho fenced-ok\n```"), after_fence, after_write])
    recorder = ListRecorder()
    result = run(server, workspace, recorder)
    assert result.status == "completed" and result.summary == "all done" and result.format_errors == 0
    assert (workspace.root / "notes" / "out.txt").read_text() == "written by the model"


def test_bad_arguments_come_back_as_errors_the_model_can_read(scripted_llm, workspace):
    checks = [
        (raw_tool("bash", '{"command": "echo hi"'), "not a JSON object"),
        (tool("record_finding", title="x", severity="urgent", category="c", details="d"), "severity"),
        (tool("read_file", path="../../../etc/passwd"), "outside the workspace"),
        (tool("write_file", path="/etc/reviewer-test", content="x"), "outside the workspace"),
        (tool("bash", command="ls", cwd="/"), "cwd: Extra inputs are not permitted"),
        (tool("record_measurement", name="t", value="fast", unit="s"), "value"),
        (tool("launch_missiles"), "unknown tool 'launch_missiles'"),
        (tool("finish", summary=""), "bad arguments for finish"),
    ]
    turns = [checks[0][0]]
    for i, (_, expected) in enumerate(checks):
        nxt = checks[i + 1][0] if i + 1 < len(checks) else tool("finish", summary="done")

        def turn(req, expected=expected, nxt=nxt):
            assert expected in last_message(req)["content"], last_message(req)["content"]
            return nxt
        turns.append(turn)
    server = scripted_llm(turns)
    recorder = ListRecorder()
    result = run(server, workspace, recorder, max_steps=20)
    assert result.status == "completed", result.error
    assert recorder.findings == [] and recorder.measurements == []
    assert not (workspace.root.parent.parent / "etc").exists()
    # the broken arguments stay verbatim in the transcript but the server got valid JSON back
    assert recorder.saves[-1]["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"command": "echo hi"'
    assert server.requests[1]["messages"][2]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_read_file_shows_numbered_lines_and_pages(scripted_llm, workspace):
    (workspace.root / "long.txt").write_text("".join(f"row {i}\n" for i in range(1, 51)))

    def check_page(req):
        content = last_message(req)["content"]
        assert content.startswith("long.txt lines 11-20 of 50:")
        assert "    11\trow 11" in content and "    20\trow 20" in content and "row 21" not in content
        assert "read_file(path, offset=20)" in content
        return tool("read_file", path=".")

    def check_dir(req):
        assert "README.md" in last_message(req)["content"] and "long.txt" in last_message(req)["content"]
        return tool("finish", summary="read")

    server = scripted_llm([tool("read_file", path="long.txt", offset=10, limit=10), check_page, check_dir])
    assert run(server, workspace, ListRecorder()).status == "completed"


def test_long_bash_output_is_cut_to_head_and_tail(scripted_llm, workspace):
    def check(req):
        content = last_message(req)["content"]
        assert "characters left out ...]" in content
        assert "FIRST-LINE" in content and "LAST-LINE" in content and len(content) < 14_000
        return tool("finish", summary="ok")

    cmd = "echo FIRST-LINE; python3 -c \"print('y' * 50000)\"; echo LAST-LINE >&2; exit 3"
    server = scripted_llm([tool("bash", command=cmd), check])
    assert run(server, workspace, ListRecorder()).status == "completed"
    assert "exit code: 3" in server.requests[1]["messages"][-1]["content"]


def test_context_elision_keeps_system_task_and_latest_steps(scripted_llm, workspace):
    def big_output(i):
        return tool("bash", command=f"echo STEP-{i}-OUTPUT; python3 -c \"print('z' * 2400)\"")

    def final(req):
        messages = req["messages"]
        assert messages[0] == {"role": "system", "content": PERSONA.system_prompt}
        assert messages[1] == {"role": "user", "content": TASK}
        assert "STEP-5-OUTPUT" in messages[-1]["content"]  # the latest output, intact
        outputs = [m["content"] for m in messages if m["role"] == "tool"]
        assert not any("STEP-0-OUTPUT" in o for o in outputs)  # the oldest output is gone
        assert ELIDED in json.dumps(messages) or "earlier steps elided" in json.dumps(messages)
        return tool("finish", summary="fit")

    server = scripted_llm([big_output(i) for i in range(6)] + [final], max_context=4000)
    recorder = ListRecorder()
    result = run(server, workspace, recorder)
    assert result.status == "completed"
    # every request, with room for the reply, fitted the window (as the scripted server counts tokens)
    assert all(len(json.dumps(r["messages"])) // 4 + len(json.dumps(r["tools"])) // 4 + r["max_tokens"] <= 4000
               for r in server.requests)
    # the saved transcript is the full conversation, nothing elided
    transcript = json.dumps(recorder.saves[-1]["messages"])
    assert all(f"STEP-{i}-OUTPUT" in transcript for i in range(6)) and ELIDED not in transcript


def test_wall_clock_limit_stops_a_long_command_and_the_persona(scripted_llm, workspace):
    server = scripted_llm([], after=tool("bash", command="sleep 30"))
    recorder = ListRecorder()
    start = time.monotonic()
    result = run(server, workspace, recorder, timeout=2)
    assert result.status == "timeout" and "wall-clock" in result.error
    assert time.monotonic() - start < 20
    assert "timed out after" in recorder.saves[-1]["messages"][-1]["content"]


def test_token_budget(scripted_llm, workspace):
    server = scripted_llm([], after=tool("bash", command="echo again"))
    result = run(server, workspace, ListRecorder(), max_total_tokens=200)
    assert result.status == "token_budget"
    assert result.prompt_tokens + result.completion_tokens >= 200 and result.steps < 10


def test_repeating_the_same_call_earns_a_nudge(scripted_llm, workspace):
    def third(req):
        assert "exactly this call 3 times in a row" in last_message(req)["content"]
        return tool("finish", summary="stopped looping")

    same = tool("bash", command="echo same")
    server = scripted_llm([same, same, same, third])
    assert run(server, workspace, ListRecorder()).status == "completed"
    assert "times in a row" not in server.requests[2]["messages"][-1]["content"]


def test_server_without_tools_support_switches_to_text_calls(scripted_llm, workspace):
    def answer(req):
        if "tools" in req:
            return fail(400, "tools are not supported by this server (start it with --jinja)")
        assert "## How to call a tool" in req["messages"][0]["content"]
        if req["messages"][-1]["role"] == "user" and "Result of bash" in req["messages"][-1]["content"]:
            return text('<tool_call>{"name": "finish", "arguments": {"summary": "text mode"}}</tool_call>')
        return text("```bash\necho via-text\n```")

    server = scripted_llm([], after=answer)
    result = run(server, workspace, ListRecorder())
    assert result.status == "completed" and result.summary == "text mode"
    assert "via-text" in server.requests[-1]["messages"][-1]["content"]


def test_llm_failure_mid_run_is_a_failed_persona_with_one_line(scripted_llm, workspace):
    server = scripted_llm([tool("bash", command="echo one")], after=fail(400, "model exploded"))
    recorder = ListRecorder()
    result = run(server, workspace, recorder)
    assert result.status == "failed" and "model exploded" in result.error and "\n" not in result.error
    assert result.steps == 2 and recorder.saves  # what happened before is saved


def test_with_the_database_recorder_of_reviewer_run(scripted_llm, workspace, tmp_path):
    from reviewer.run.recorder import DbRecorder

    path = str(tmp_path / "reviews.db")
    with db.session(path) as s:
        repo = db.get_or_create_repository(s, "file:///demo")
        run_row = db.ReviewRun(repository_id=repo.id, status="running")
        s.add(run_row)
        s.commit()
        persona_row = db.PersonaRun(run_id=run_row.id, persona="tester")
        s.add(persona_row)
        s.commit()
    recorder = DbRecorder(path, run_row.id, persona_row.id, "tester")
    server = scripted_llm([
        tool("bash", command="python3 -c 'print(sorted([3,1,2]))'"),
        tool("record_finding", title="t", severity="low", category="docs", details="d", evidence="e"),
        tool("record_measurement", name="m", value=1.5, unit="ms", repeats=3),
        tool("finish", summary="stored"),
    ])
    result = run(server, workspace, recorder)
    assert result.status == "completed"
    with db.session(path) as s:
        stored = s.get(db.PersonaRun, persona_row.id)
        findings = s.exec(select(db.Finding)).all()
        measurements = s.exec(select(db.Measurement)).all()
    transcript = json.loads(stored.transcript)
    assert stored.steps == 4 and stored.prompt_tokens == result.prompt_tokens
    assert "[1, 2, 3]" in transcript[3]["content"]
    assert [(f.title, f.persona_run_id) for f in findings] == [("t", persona_row.id)]
    assert [(m.name, m.value, m.repeats) for m in measurements] == [("m", 1.5, 3)]


# --- pure functions ---

def test_parse_text_calls():
    assert parse_text_calls("no call here") == []
    [call] = parse_text_calls('x <tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>')
    assert call.name == "bash" and call.arguments == {"command": "ls"}
    [call] = parse_text_calls("<tool_call>{broken</tool_call>")
    assert call.name == "" and call.arguments is None
    [call] = parse_text_calls("```sh\npytest -q\n```\nand\n```bash\nls\n```")
    assert call.arguments == {"command": "pytest -q"}
    calls = parse_text_calls('<tool_call>{"name": "bash", "arguments": {"command": "a"}}</tool_call>'
                             '<tool_call>{"name": "finish", "arguments": {"summary": "b"}}</tool_call>')
    assert [c.name for c in calls] == ["bash", "finish"]
    [call] = parse_text_calls("<tool_call>\n<function=read_file>\n<parameter=path>\nREADME.md\n</parameter>\n"
                              "</function>\n</tool_call>")
    assert call.name == "read_file" and call.arguments == {"path": "README.md"}


def test_fit_context_sacrifices_old_outputs_then_old_steps():
    def step(i, size):
        return [{"role": "assistant", "content": "", "tool_calls": [
                    {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": f"out{i} " + "x" * size}]

    messages = [{"role": "system", "content": "S" * 100}, {"role": "user", "content": "T" * 100}]
    for i in range(6):
        messages += step(i, 1000)

    def count(m):
        return len(json.dumps(m)) // 4

    total = sum(count(m) for m in messages)
    assert fit_context(messages, total, count) == messages  # fits: untouched

    window = fit_context(messages, total - 400, count)  # a little too big: the oldest outputs are elided
    assert window[:2] == messages[:2] and len(window) == len(messages)
    assert window[3]["content"] == ELIDED and window[5]["content"] == ELIDED and window[7]["content"].startswith("out2")
    assert messages[3]["content"].startswith("out0")  # the conversation itself is not modified

    essential = sum(count(m) for m in messages[:2] + messages[-4:])
    window = fit_context(messages, essential + 40, count)  # much too big: whole old steps go, replaced by a note
    assert window[:2] == messages[:2] and sum(count(m) for m in window) <= essential + 40
    assert window[2]["content"].startswith("[") and "earlier steps elided" in window[2]["content"]
    assert window[-4:] == messages[-4:]  # the latest two steps are intact
    ids = [m["tool_call_id"] for m in window if m["role"] == "tool"]
    calls = [tc["id"] for m in window if m.get("tool_calls") for tc in m["tool_calls"]]
    assert ids == calls  # every tool result still follows its call

    window = fit_context(messages, 300, count)  # the latest steps alone are too big: their middle is cut
    assert window[0] == messages[0] and "characters left out" in window[-1]["content"]


def test_builtin_personas_load_and_say_the_rules():
    personas = load_personas()
    for name in ("performance", "correctness", "docs"):
        p = personas[name]
        assert not p.deterministic and p.max_steps >= 20 and p.focus and p.description
        assert 0 <= p.model_settings.get("temperature", 0) <= 1
        prompt = p.system_prompt
        for rule in ("record_finding", "repro_command", "finish", "evidence", "one tool call"):
            assert rule in prompt, (name, rule)
        assert "exits non-zero" in prompt or "exit non-zero" in prompt


def test_persona_can_ask_for_text_tool_calls(scripted_llm, workspace):
    persona = Persona(name="texty", description="", system_prompt="Prompt.", model_settings={"tool_format": "text",
                                                                                            "temperature": 0.1})
    server = scripted_llm([text('<tool_call>{"name": "finish", "arguments": {"summary": "plain"}}</tool_call>')])
    result = run(server, workspace, ListRecorder(), persona=persona)
    assert result.status == "completed" and result.summary == "plain"
    [req] = server.requests
    assert "tools" not in req and "tool_format" not in req and req["temperature"] == 0.1
    assert req["messages"][0]["content"].startswith("Prompt.\n\n## How to call a tool")


def test_ctrl_c_ends_the_persona_as_interrupted_with_the_transcript_saved(scripted_llm, workspace):
    def interrupt_at_step_2(event):
        if event.step == 2:
            raise KeyboardInterrupt

    server = scripted_llm([], after=tool("bash", command="echo working"))
    recorder = ListRecorder()
    result = run(server, workspace, recorder, on_step=interrupt_at_step_2)
    assert result.status == "interrupted" and result.steps == 2
    assert recorder.saves[-1]["steps"] == 2 and "working" in recorder.saves[-1]["messages"][-1]["content"]
