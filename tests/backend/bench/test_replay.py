"""The serve replay (backend/bench/replay.py, sessions.py): the session builder (turn structure, held-out chunks,
growth, stopping before the window), the record writer (fields, identical count, speedup), and one replay through
real `reviewer serve` subprocesses with a tiny scripted model over real sockets."""
import json
import signal
import sys
from pathlib import Path

import pytest

from backend.bench import replay
from backend.bench.sessions import (Chunk, Reply, SessionError, TurnRow, anthropic_body, build_sessions, chunk_file,
                                    feed_back, load_tools, persona_prompt, repo_files, stdlib_tests)

ROOT = Path(__file__).resolve().parents[3]
READ_CALL = '{"name": "read_file", "arguments": {"path": "a.py"}}'
SCRIPT = ["Reading.", "<tool_call>", READ_CALL, "</tool_call>"]  # the scripted model's reply every turn


def small_repo(tmp_path: Path, files: int = 2, lines: int = 60) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    for f in range(files):
        (repo / f"mod{f}.py").write_text("\n".join(f"value_{f}_{i} = {i} * {f + 1}  # line {i} of a small module" for i in range(lines)))
    return repo


def small_persona(tmp_path: Path) -> Path:
    folder = tmp_path / "personas"
    folder.mkdir()
    (folder / "tester.md").write_text("---\nname: tester\ndescription: d\nfocus: [tests, edge cases]\n---\n"
                                      "You test projects. One tool call per reply.\n")
    return folder


def test_the_real_personas_give_the_system_prompt_and_the_tools_match_the_agent():
    system, focus = persona_prompt("correctness")
    body = (ROOT / "personas" / "correctness.md").read_text().split("---", 2)[2].strip()
    assert system == body and "edge cases" in focus
    from reviewer.persona.tools import TOOLS  # the agent's own schemas: the replay sends the same

    assert load_tools() == TOOLS


def test_sessions_take_different_files_in_order_and_drop_chunks_seen_in_training(tmp_path):
    repo = small_repo(tmp_path, files=4)
    source = repo_files(repo)
    whole = chunk_file(repo / "mod0.py", "mod0.py", 200)
    assert [c.first_line for c in whole[1:]] == [c.last_line + 1 for c in whole[:-1]]  # consecutive, whole lines
    assert "\n".join(c.text for c in whole) == (repo / "mod0.py").read_text()
    seen = {whole[1].text.split("\n")[0].strip()}  # one line of the second chunk "was in the training prompts"
    sessions = build_sessions(2, source, chunk_chars=200, seen=seen)
    assert [s.persona for s in sessions] == ["correctness", "performance"]
    assert sessions[0].files == ["mod0.py", "mod2.py"] and sessions[1].files == ["mod1.py", "mod3.py"]
    assert sessions[0].dropped_seen == 1 and whole[1] not in sessions[0].chunks and whole[2] in sessions[0].chunks
    opening = sessions[0].opening()
    assert opening[0] == {"role": "system", "content": persona_prompt("correctness")[0]}
    assert opening[1]["role"] == "user" and opening[1]["content"].startswith("Review this repository")
    with pytest.raises(SessionError, match="seen in training"):
        build_sessions(1, repo_files(repo), chunk_chars=10_000, seen={l.strip() for l in
                       "\n".join((repo / f"mod{i}.py").read_text() for i in range(4)).split("\n")})


def test_the_default_source_is_held_out_from_the_training_prompts():
    try:
        source = stdlib_tests()
    except SessionError:
        pytest.skip("this interpreter has no Lib/test")
    assert all("/test/" in str(p) for p in source.files) and "builtin.jsonl" in source.held_out
    (session,) = build_sessions(1, source, chunk_chars=400, max_chunks=30)
    from backend.bench.sessions import training_lines

    seen = training_lines()
    assert len(seen) > 1000  # the training prompts were read
    assert not any(line.strip() in seen for c in session.chunks for line in c.text.split("\n")
                   if len(line.strip()) >= 32)


def test_a_reply_is_fed_back_as_the_server_returned_it_then_the_chunk_as_tool_result():
    chunk = Chunk("a.py", 11, 12, 40, "x = 1\ny = 2")
    plain = feed_back(Reply("I will read it."), chunk, 0)
    assert plain[0] == {"role": "assistant", "content": "I will read it."} and plain[1]["role"] == "user"
    assert "a.py lines 11-12 of 40:\n    11\tx = 1\n    12\ty = 2" in plain[1]["content"]
    assert "read_file(path, offset=12)" in plain[1]["content"]  # the agent's footer: more lines follow
    calls = [{"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
             {"id": None, "type": "function", "function": {"name": "bash", "arguments": "not json"}}]
    fed = feed_back(Reply("", calls), chunk, 3)
    assert [m["role"] for m in fed] == ["assistant", "tool", "tool"]
    assert fed[0]["tool_calls"][1] == {"id": "call_3_1", "type": "function",
                                       "function": {"name": "bash", "arguments": "{}"}}
    assert fed[1]["tool_call_id"] == "c1" and fed[1]["content"] == chunk.tool_output()
    assert fed[2]["tool_call_id"] == "call_3_1" and "not run" in fed[2]["content"]
    body = anthropic_body([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, *fed], load_tools(), "m")
    assert body["system"] == "S" and [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert [b["type"] for b in body["messages"][1]["content"]] == ["tool_use", "tool_use"]
    assert [b["tool_use_id"] for b in body["messages"][2]["content"]] == ["c1", "call_3_1"]


def row(config, session, turn, sha, wall=1.0, cycles=0, accepted=0):
    spec = {"spec_cycles": cycles, "draft_n": 15 * cycles, "draft_n_accepted": accepted} if cycles else None
    return TurnRow(config=config, session=session, turn=turn, context_tokens=100 * (turn + 1), counted_tokens=None,
                   cached_tokens=None, completion_tokens=10, ttft_s=0.1, decode_tok_s=50.0,
                   decode_tok_s_source="timings", wall_s=wall, finish_reason="stop", tool_calls=0, reply_sha256=sha,
                   spec=spec)


def test_the_record_counts_identical_replies_and_divides_walls(tmp_path):
    sessions = build_sessions(2, repo_files(small_repo(tmp_path)), chunk_chars=300, seen=set())
    a, b = sessions[0].name, sessions[1].name
    rows = [row("none", a, 0, "x"), row("none", a, 1, "y"), row("none", b, 0, "z"),
            row("auto", a, 0, "x", cycles=4, accepted=8), row("auto", a, 1, "DIFFERENT", cycles=2, accepted=1),
            row("auto", b, 0, "z", cycles=4, accepted=3), row("auto", b, 1, "w")]
    runs = {"none": {"ready_s": 5.0, "sessions_wall_s": {a: 6.0, b: 3.0}, "captures_after_ready": 0.0},
            "auto": {"ready_s": 7.0, "sessions_wall_s": {a: 2.0, b: 4.0}, "captures_after_ready": None}}
    record = replay.build_record(runs, rows, sessions, model="m", command="c", held_out="h", interface="i",
                                 forced_tau=None, settings={})
    for key in ["benchmark", "machine", "model", "command", "date", "forced_tau", "sessions", "replies", "identical",
                "speedup", "first_session_speedup", "ready_s", "captures_after_ready", "max_context_tokens",
                "held_out", "turns"]:
        assert key in record, key
    assert record["benchmark"] == "serve_replay" and record["machine"]["cpu"]
    assert (record["replies"], record["identical"]) == (3, 2)  # auto's turn 1 of b has no reference: not counted
    assert record["speedup"] == pytest.approx(9 / 6) and record["first_session_speedup"] == pytest.approx(3.0)
    assert record["ready_s"] == {"none": 5.0, "auto": 7.0} and record["captures_after_ready"]["none"] == 0.0
    assert record["max_context_tokens"] == 210
    assert record["tau"] == {"none": None, "auto": pytest.approx((12 + 10) / 10)}  # per cycle: accepted drafts + 1
    assert [r["identical_to_none"] for r in record["turns"] if r["config"] == "auto"] == [True, False, True, None]
    path = replay.write_record(record, tmp_path / "out")
    assert path.name.startswith("serve_replay-m-") and json.loads(path.read_text())["identical"] == 2
    assert "1.50x" in replay.format_table(record) and " 2.20 " in replay.format_table(record)


def test_a_session_replayed_through_real_serve_subprocesses(tmp_path, tiny_model):
    """Two cold `reviewer serve` processes (tiny scripted model: a tool call every turn), sessions of real files
    that grow until the next turn would not fit the 2,048-token window."""
    model = tiny_model("llama", template="hermes", script=SCRIPT)
    persona_dir = small_persona(tmp_path)
    sessions = build_sessions(2, repo_files(small_repo(tmp_path, files=2, lines=200)), chunk_chars=150,
                              personas=("tester",), persona_dir=persona_dir, seen=set())
    tools = [t for t in load_tools() if t["function"]["name"] == "read_file"]
    done = replay.serve_replay(str(model), sessions, drafters=("none", "auto"), serve_args=["--device", "cpu"],
                               max_tokens=32, max_turns=None, ready_timeout=120, request_timeout=60, tools=tools,
                               on_config=lambda m: None)
    runs, rows, name = done.runs, done.rows, done.model
    assert set(runs) == {"none", "auto"} and name == model.name
    for cfg, run in runs.items():
        assert run["ready_line"].startswith("reviewer serve: ready: ") and run["ready_s"] > 0
        # stopped by SIGTERM: uvicorn re-raises it after its graceful shutdown (a shell sees 143), as a user's server
        assert run["exit_code"] == -signal.SIGTERM and run["window"] == 2048
        assert run["metrics_after"]["reviewer_requests_total" + '{outcome="tool_calls",route="chat"}'] > \
            run["metrics_before"].get("reviewer_requests_total" + '{outcome="tool_calls",route="chat"}', 0)
        assert replay.CAPTURES_METRIC in run["metrics_after"] or run["captures_after_ready"] is None
        for s in sessions:
            got = [r for r in rows if r.config == cfg and r.session == s.name]
            assert len(got) >= 3 and "would not fit" in run["stop_reasons"][s.name]
            contexts = [r.context_tokens for r in got]
            assert contexts == sorted(contexts) and len(set(contexts)) == len(contexts)  # it grows every turn
            assert all(r.counted_tokens == r.context_tokens for r in got)  # count_tokens = what the server rendered
            assert contexts[-1] + 32 <= 2048 and all(r.tool_calls == 1 and r.ttft_s for r in got)
            assert all(r.decode_tok_s_source == "timings" for r in got)
    record = replay.build_record(runs, rows, sessions, model=name, command="test", held_out="h",
                                 interface="serve", forced_tau=None, settings={})
    assert record["replies"] == len([r for r in rows if r.config == "none"]) == record["identical"]
    assert record["speedup"] > 0
    check_transcripts(tmp_path, done, sessions, tools)


def check_transcripts(tmp_path, done, sessions, tools):
    """--transcripts: each session whole as the server got it, ending at its last reply; read back by `reviewer
    train --from-transcripts` as one prompt per reply, each the context before it, the session's tools with it."""
    from backend.train.prompts import load_transcripts

    path = replay.write_transcripts(tmp_path / "tx" / "sessions.jsonl", done.sessions["none"], sessions, tools,
                                    config="none", model="m", source="small repo")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [x["session"] for x in lines] == [s.name for s in sessions] and not path.with_name("sessions.jsonl.tmp").exists()
    records = load_transcripts(str(path))
    by_session: dict[str, list] = {}
    for r in records:
        by_session.setdefault(r.id.rsplit("-", 1)[0], []).append(r)
    assert len(by_session) == len(sessions)
    for prompts, line, ran in zip(by_session.values(), lines, done.sessions["none"]):
        messages = line["messages"]
        assert messages[0]["role"] == "system" and messages[-1]["role"] == "assistant" and line["tools"] == tools
        assert len(prompts) == len(ran.rows) == sum(m["role"] == "assistant" for m in messages)  # one per reply
        assert len(prompts[0].messages) == 2  # the first reply's context: the system prompt and the task
        for r in prompts:  # the context before a reply, as sent
            assert messages[:len(r.messages)] == r.messages and messages[len(r.messages)]["role"] == "assistant"
            assert r.tools == tools and r.category == "replay:tester" and r.split == prompts[0].split


def test_a_drafter_given_as_a_folder_logs_beside_the_others(tmp_path):
    """--drafters none,auto,/some/folder: each server's log is one file in the log folder (a path was a
    FileNotFoundError on the H200, 2026-12-05)."""
    names = {d: replay.server_log_path(tmp_path, d) for d in ("none", "auto", "/tmp/drafters/no-window")}
    assert all(p.parent == tmp_path for p in names.values()) and len(set(names.values())) == 3
    assert names["none"].name == "serve-none.log" and names["/tmp/drafters/no-window"].name == "serve-tmp_drafters_no-window.log"
    names["/tmp/drafters/no-window"].write_text("log")


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert replay.main(["--repo", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert replay.main(["--forced-tau", "4.9", "--out", str(out)]) == 2
    assert replay.main(["--interface", "engine", "--transcripts", str(tmp_path / "t.jsonl"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "not a folder" in err[0] and "--interface engine" in err[1]
    assert "--transcripts needs --interface serve" in err[2] and not (tmp_path / "t.jsonl").exists()
    assert not out.exists()


def test_the_engine_replay_runs_each_configuration_in_its_own_process(tmp_path):
    """--interface engine (tiny random target on the CPU): a fresh spawned process per configuration, the --drafter
    none replies passed on as the reference, the record saying how the processes were arranged."""
    out = tmp_path / "r.json"
    code = replay.main(["--interface", "engine", "--model", "tiny-moe", "--device", "cpu", "--sessions", "1",
                        "--max-turns", "2", "--max-context", "8192", "--max-tokens", "4", "--repo",
                        str(small_repo(tmp_path)), "--out", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["settings"]["processes"].startswith("each configuration in its own process")
    assert set(record["configs"]) == {"none", "auto"} and record["replies"] == 2 == record["identical"]
    assert record["interface"] == "engine in-process" and record["speedup"] > 0


def test_reviewer_bench_replay_is_the_replay_with_the_bench_options(tmp_path):
    """`reviewer bench --replay`: a real subprocess of the CLI; its bad input is the replay's one line."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "reviewer.cli", "bench", "--replay", "--model", "tiny-moe",
                           "--forced-tau", "4.9,6.4", "--json-out", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "one --forced-tau value" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr and not (tmp_path / "r.json").exists()
    done = subprocess.run([sys.executable, "-m", "reviewer.cli", "bench", "--help"], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "COLUMNS": "200"})
    assert "--replay" in done.stdout and "product figure" in done.stdout
