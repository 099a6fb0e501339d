"""The product benchmark: agent sessions replayed through `reviewer serve`, cold, with `--drafter none` and `--drafter
auto` side by side in one run (issue 39).

For each configuration it starts the server as a user does (`python -m reviewer.cli serve --port 0 ...`, the model
loaded once), times the ready line from the process start, replays the same sessions over HTTP with the official
OpenAI client (greedy, streamed: TTFT; the server's `timings`: decode tok/s), scrapes /metrics before and after, and
stops the server with SIGTERM. The sessions (backend/bench/sessions.py): a persona's system prompt and tool schemas, a
first turn asking to review a repository, then per turn the model's own reply fed back and a real file's next chunk as
the tool result, until the next turn would not fit the window. The record (bench/results/serve_replay-<model>-<date>
.json) holds the per-turn rows, identical replies against --drafter none's, and the speedup in total session wall.
`--transcripts FILE` also writes the first configuration's sessions whole, one JSON line each: training data for
`reviewer train --from-transcripts` when the sources are not the held-out ones (docs/training.md).

`--interface engine` drives the same session structure through `Engine.generate` in-process instead (the GPU shapes
with random weights, where serving over HTTP measures nothing more), with --forced-tau (backend/bench/replay_engine.py).

    python -m backend.bench.replay --model embedded --sessions 3 --out bench/results/
    python -m backend.bench.replay --interface engine --model qwen3.6-35b-a3b-shape --forced-tau 4.9 --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from backend.bench.replay_engine import engine_replay, isolated_replay
from backend.bench.report import cpu_model
from backend.bench.sessions import (Reply, ReplayError, Session, SessionError, TurnRow, anthropic_body,
                                    assistant_message, build_sessions, feed_back, load_tools, repo_files,
                                    stdlib_tests)

CAPTURES_METRIC = "reviewer_graph_captures_after_ready_total"
COMPILATIONS_METRIC = "reviewer_compilations_after_ready_total"
CONFIGS = ("none", "auto")  # --drafter values; "none" first: the reference replies


@dataclass
class ConfigRun:
    drafter: str
    command: list[str]
    ready_s: float
    ready_line: str
    sessions_wall_s: dict[str, float] = field(default_factory=dict)
    metrics_before: dict[str, float] = field(default_factory=dict)
    metrics_after: dict[str, float] = field(default_factory=dict)
    captures_after_ready: float | None = None
    compilations_after_ready: float | None = None
    stop_reasons: dict[str, str] = field(default_factory=dict)
    exit_code: int | None = None
    window: int | None = None  # the server's max_context (/v1/models)
    served_model: str | None = None


@dataclass
class SessionRun:
    """One session against one server: its turns, its wall, why it stopped, and the whole conversation it built
    (every reply included), which `--transcripts` writes."""
    name: str
    rows: list[TurnRow]
    wall_s: float
    stop_reason: str
    messages: list[dict]


@dataclass
class ServeReplay:
    """Every configuration's run: the runs as dicts (for the record), the served model's name, and each
    configuration's sessions (their turn rows in `rows`)."""
    runs: dict[str, dict]
    model: str
    sessions: dict[str, list[SessionRun]]

    @property
    def rows(self) -> list[TurnRow]:
        return [r for done in self.sessions.values() for d in done for r in d.rows]


# ---- the server as a user starts it ---------------------------------------------------------------------------------


@dataclass
class Server:
    process: subprocess.Popen
    lines: queue.Queue
    url: str
    started: float
    log_path: Path


def server_log_path(log_dir: Path, drafter: str) -> Path:
    """The server's stderr file for one --drafter value, which may be a path (a drafter folder) as well as a name."""
    return log_dir / f"serve-{re.sub(r'[^A-Za-z0-9_.-]+', '_', drafter).strip('_')}.log"


def start_server(model: str, drafter: str, serve_args: list[str], log_dir: Path, timeout: float) -> tuple[Server, ConfigRun]:
    """`reviewer serve` in a subprocess on a free port; returns once the ready line is out (ready_s from Popen)."""
    command = [sys.executable, "-m", "reviewer.cli", "serve", "--model", model, "--drafter", drafter,
               "--host", "127.0.0.1", "--port", "0", *serve_args]
    log_path = server_log_path(log_dir, drafter)
    log = open(log_path, "w")
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
                               start_new_session=True)
    log.close()
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout] + [lines.put(None)], daemon=True).start()
    url = ready = None
    deadline = started + timeout
    while ready is None:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.perf_counter()))
        except queue.Empty:
            stop_server(process)
            raise ReplayError(f"`{shlex.join(command)}` printed no ready line within {timeout:g} s (log: {log_path})")
        if line is None:
            process.wait()
            raise ReplayError(f"`{shlex.join(command)}` exited with status {process.returncode} before it was ready: "
                              f"{last_line(log_path)}")
        if m := re.search(r"reviewer serve: listening on (http://\S+)", line):
            url = m.group(1)
        elif line.startswith("reviewer serve: ready: "):
            ready = line.strip()
    run = ConfigRun(drafter=drafter, command=command, ready_s=round(time.perf_counter() - started, 3), ready_line=ready)
    return Server(process, lines, url, started, log_path), run


def last_line(path: Path) -> str:
    text = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    return text[-1] if text else "(no output)"


def stop_server(process: subprocess.Popen, timeout: float = 60) -> int:
    """SIGTERM (what a service manager sends) and wait; SIGKILL only if it does not exit."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def scrape_metrics(http) -> dict[str, float]:
    """Every unlabelled sample of /metrics, and labelled ones keyed name{a="b"}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


# ---- one session over HTTP ----------------------------------------------------------------------------------------


def stream_turn(client, model: str, messages: list[dict], tools: list[dict], max_tokens: int) -> tuple[Reply, dict]:
    """One streamed, greedy chat completion: the reply, and what was measured (ttft, wall, usage, timings)."""
    t0 = time.perf_counter()
    ttft = None
    content, calls, usage, timings, finish = [], {}, None, None, None
    stream = client.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0,
                                            max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        extra = chunk.model_extra or {}
        timings = extra.get("timings") or timings
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if ttft is None and (delta.content or delta.tool_calls):
                ttft = time.perf_counter() - t0
            if delta.content:
                content.append(delta.content)
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["function"]["name"] += tc.function.name or ""
                    call["function"]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    wall = time.perf_counter() - t0
    reply = Reply("".join(content), [calls[i] for i in sorted(calls)])
    return reply, {"ttft": ttft, "wall": wall, "usage": usage, "timings": timings, "finish": finish}


def count_tokens(http, messages: list[dict], tools: list[dict], model: str) -> int:
    response = http.post("/v1/messages/count_tokens", json=anthropic_body(messages, tools, model))
    response.raise_for_status()
    return int(response.json()["input_tokens"])


def turn_row(config: str, session: str, turn: int, reply: Reply, got: dict, counted: int | None) -> TurnRow:
    usage, timings = got["usage"], got["timings"] or {}
    completion = usage.completion_tokens if usage else 0
    if timings.get("predicted_per_second"):
        tok_s, source = float(timings["predicted_per_second"]), "timings"
    else:
        streamed = got["wall"] - (got["ttft"] or 0.0)
        tok_s, source = (completion / streamed if streamed > 0 and completion else None), "client"
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    spec = {k: timings[k] for k in ("spec_cycles", "draft_n", "draft_n_accepted", "draft_ms", "verify_ms")
            if k in timings} if timings.get("spec_cycles") else None
    return TurnRow(config=config, session=session, turn=turn, context_tokens=usage.prompt_tokens if usage else 0,
                   counted_tokens=counted, cached_tokens=getattr(details, "cached_tokens", None),
                   completion_tokens=completion, ttft_s=None if got["ttft"] is None else round(got["ttft"], 4),
                   decode_tok_s=None if tok_s is None else round(tok_s, 2), decode_tok_s_source=source,
                   wall_s=round(got["wall"], 4), finish_reason=got["finish"], tool_calls=len(reply.tool_calls),
                   reply_sha256=reply.sha256(), spec=spec)


def replay_session(client, http, model: str, session: Session, tools: list[dict], config: str, *, max_tokens: int,
                   max_context: int, max_turns: int | None) -> SessionRun:
    """Turns until the next would not fit (counted prompt + max_tokens > max_context), the chunks run out, or
    max_turns."""
    messages, rows, t0 = session.opening(), [], time.perf_counter()
    why = "chunks exhausted"
    for turn in range(len(session.chunks) + 1):
        if max_turns is not None and turn >= max_turns:
            why = f"max_turns {max_turns}"
            break
        counted = count_tokens(http, messages, tools, model)
        if counted + max_tokens > max_context:
            why = f"next turn would not fit: {counted} + {max_tokens} > {max_context}"
            break
        reply, got = stream_turn(client, model, messages, tools, max_tokens)
        rows.append(turn_row(config, session.name, turn, reply, got, counted))
        if turn == len(session.chunks):
            messages.append(assistant_message(reply, turn))
            break
        messages += feed_back(reply, session.chunks[turn], turn)
    while rows and messages[-1]["role"] != "assistant":  # end at the last reply: what came after it was never sent
        messages.pop()
    return SessionRun(session.name, rows, time.perf_counter() - t0, why, messages)


def run_config(model: str, drafter: str, sessions: list[Session], tools: list[dict], *, serve_args: list[str],
               max_tokens: int, max_turns: int | None, log_dir: Path, ready_timeout: float,
               request_timeout: float) -> tuple[ConfigRun, list[SessionRun]]:
    """One cold server: ready, every session in order, metrics around them, SIGTERM."""
    import httpx
    import openai

    server, run = start_server(model, drafter, serve_args, log_dir, ready_timeout)
    done: list[SessionRun] = []
    try:
        with httpx.Client(base_url=server.url, timeout=request_timeout) as http:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=http, max_retries=0)
            served = client.models.list().data[0]
            run.served_model = served.id
            window = run.window = int((served.model_extra or {}).get("max_context") or 0)
            if not window:
                raise ReplayError("the server's /v1/models gives no max_context: cannot tell when a session is full")
            run.metrics_before = scrape_metrics(http)
            for s in sessions:
                done.append(replay_session(client, http, served.id, s, tools, drafter, max_tokens=max_tokens,
                                           max_context=window, max_turns=max_turns))
                run.sessions_wall_s[s.name] = round(done[-1].wall_s, 4)
                run.stop_reasons[s.name] = done[-1].stop_reason
            run.metrics_after = scrape_metrics(http)
            run.captures_after_ready = run.metrics_after.get(CAPTURES_METRIC)
            run.compilations_after_ready = run.metrics_after.get(COMPILATIONS_METRIC)
    finally:
        run.exit_code = stop_server(server.process)
    return run, done


# ---- the record ---------------------------------------------------------------------------------------------------


def machine() -> dict:
    """The CPU's name, and the GPUs' names from nvidia-smi when there is one (no torch import: the bench process
    need not touch CUDA)."""
    info = {"cpu": cpu_model() or platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(), "gpu": None}
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30).stdout
            info["gpu"] = [x.strip() for x in out.splitlines() if x.strip()] or None
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def mark_identical(rows: list[TurnRow], reference: str = "none") -> tuple[int, int]:
    """Sets identical_to_none on every row of another configuration that has a reference row at the same (session,
    turn); returns (replies compared, identical)."""
    ref = {(r.session, r.turn): r.reply_sha256 for r in rows if r.config == reference}
    replies = identical = 0
    for r in rows:
        if r.config != reference and (r.session, r.turn) in ref:
            r.identical_to_none = r.reply_sha256 == ref[(r.session, r.turn)]
            replies += 1
            identical += r.identical_to_none
    return replies, identical


def speedups(walls: dict[str, dict[str, float]], reference: str = "none", other: str = "auto") -> tuple:
    """(total wall of `reference` over `other` on the sessions both ran, the same for the first session); None
    where a configuration is missing."""
    if reference not in walls or other not in walls:
        return None, None
    common = [s for s in walls[reference] if s in walls[other]]
    if not common:
        return None, None
    total = sum(walls[reference][s] for s in common) / sum(walls[other][s] for s in common)
    first = walls[reference][common[0]] / walls[other][common[0]]
    return round(total, 4), round(first, 4)


def session_tau(rows: list[dict]) -> float | None:
    """Tokens a speculative cycle committed over these turns (a record's turn rows: accepted drafts + the verify's own
    token, per cycle); None without cycles (--drafter none)."""
    specs = [r["spec"] for r in rows]
    cycles = sum(s["spec_cycles"] for s in specs if s)
    accepted = sum(s["draft_n_accepted"] for s in specs if s)
    return round((accepted + cycles) / cycles, 3) if cycles else None


def build_record(runs: dict[str, dict], rows: list[TurnRow], sessions: list[Session], *, model: str, command: str,
                 held_out: str, interface: str, forced_tau: float | None, settings: dict) -> dict:
    """The serve_replay record: issue 39's fields, then the configurations' details and the per-turn rows."""
    replies, identical = mark_identical(rows)
    walls = {cfg: run["sessions_wall_s"] for cfg, run in runs.items()}
    drafted = [cfg for cfg in runs if cfg != "none"]  # the speedup is of the first drafter over --drafter none
    speedup, first = speedups(walls, other=drafted[0]) if drafted else (None, None)
    turns = [asdict(r) for r in rows]
    return {
        "benchmark": "serve_replay", "interface": interface, "machine": machine(), "model": model,
        "command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "forced_tau": forced_tau, "sessions": len(sessions), "replies": replies, "identical": identical,
        "speedup": speedup, "first_session_speedup": first,
        "ready_s": {cfg: run["ready_s"] for cfg, run in runs.items()},
        "tau": {cfg: session_tau([r for r in turns if r["config"] == cfg]) for cfg in runs},
        "captures_after_ready": {cfg: run.get("captures_after_ready") for cfg, run in runs.items()},
        "compilations_after_ready": {cfg: run.get("compilations_after_ready") for cfg, run in runs.items()},
        "max_context_tokens": max((r.context_tokens + r.completion_tokens for r in rows), default=0),
        "held_out": held_out, "settings": settings,
        "session_details": [{"name": s.name, "persona": s.persona, "files": s.files, "chunks": len(s.chunks),
                             "chunks_dropped_seen_in_training": s.dropped_seen,
                             "turns": {cfg: sum(r.session == s.name for r in rows if r.config == cfg) for cfg in runs}}
                            for s in sessions],
        "configs": runs, "turns": turns,
    }


def format_table(record: dict) -> str:
    lines = [f"serve_replay: {record['model']} ({record['interface']}), {record['sessions']} session(s), "
             f"max context {record['max_context_tokens']} tokens" +
             (f", forced tau {record['forced_tau']:g}" if record["forced_tau"] else ""),
             f"{'config':<8}{'ready_s':>9}{'turns':>7}{'wall_s':>9}{'ttft_ms':>9}{'tok/s':>8}{'tau':>6}{'captures':>10}  "
             "sessions (wall s)"]
    for cfg, run in record["configs"].items():
        rows = [r for r in record["turns"] if r["config"] == cfg]
        ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
        rates = [r["decode_tok_s"] for r in rows if r["decode_tok_s"]]
        caps = run.get("captures_after_ready")
        tau = session_tau(rows)
        lines.append(f"{cfg:<8}{run['ready_s']:>9.1f}{len(rows):>7}{sum(run['sessions_wall_s'].values()):>9.2f}"
                     f"{1e3 * sum(ttfts) / max(len(ttfts), 1):>9.0f}{sum(rates) / max(len(rates), 1):>8.0f}"
                     f"{'-' if tau is None else f'{tau:.2f}':>6}"
                     f"{'n/a' if caps is None else f'{caps:g}':>10}  "
                     + ", ".join(f"{k} {v:.2f}" for k, v in run["sessions_wall_s"].items()))
    if record["speedup"] is not None:
        lines.append(f"speedup (none wall / auto wall): {record['speedup']:.2f}x, first session "
                     f"{record['first_session_speedup']:.2f}x; identical replies {record['identical']}/"
                     f"{record['replies']}")
    return "\n".join(lines)


def write_record(record: dict, out: Path) -> Path:
    """out: a .json file, or a folder (serve_replay-<model>-<date>.json in it); written whole or not at all."""
    out = Path(out)
    if out.suffix != ".json":
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d_%H%M%S")
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(record["model"]))
        out = out / f"serve_replay-{safe}-{stamp}.json"
    return write_whole(out, json.dumps(record, indent=2) + "\n")


def write_whole(path: Path, text: str) -> Path:
    """Write text to path through a temporary file beside it: the file is there whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


# ---- the command --------------------------------------------------------------------------------------------------


def serve_replay(model: str, sessions: list[Session], *, drafters: tuple[str, ...], serve_args: list[str],
                 max_tokens: int, max_turns: int | None, ready_timeout: float, request_timeout: float,
                 tools: list[dict] | None = None, on_config=print, log_dir: Path | None = None) -> ServeReplay:
    """Every configuration cold, one after the other. tools: the agent's (backend/prompts/agent_tools.json) unless
    given. log_dir: keep the servers' stderr there (serve-<drafter>.log; default a temporary folder, removed)."""
    tools = load_tools() if tools is None else tools
    result = ServeReplay({}, model, {})
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(str(log_dir)) if log_dir else tempfile.TemporaryDirectory(prefix="serve-replay-")
          ) as logs:
        for drafter in drafters:
            run, done = run_config(model, drafter, sessions, tools, serve_args=serve_args, max_tokens=max_tokens,
                                   max_turns=max_turns, log_dir=Path(logs), ready_timeout=ready_timeout,
                                   request_timeout=request_timeout)
            result.runs[drafter], result.model = asdict(run), run.served_model or model
            result.sessions[drafter] = done
            on_config(f"--drafter {drafter}: ready in {run.ready_s:.1f} s ({run.ready_line}); "
                      f"{sum(len(d.rows) for d in done)} turns in {sum(run.sessions_wall_s.values()):.1f} s")
    return result


def write_transcripts(path: Path, done: list[SessionRun], sessions: list[Session], tools: list[dict], *,
                      config: str, model: str, source: str) -> Path:
    """One JSON line per session: the whole conversation (system prompt, task, every reply and tool result as the
    server got them) with its tools, for `reviewer train --from-transcripts`. Written whole or not at all."""
    by_name = {s.name: s for s in sessions}
    lines = [json.dumps({"session": d.name, "persona": by_name[d.name].persona, "files": by_name[d.name].files,
                         "config": config, "model": model, "source": source, "stop_reason": d.stop_reason,
                         "tools": tools, "messages": d.messages}) for d in done]
    return write_whole(path, "\n".join(lines) + "\n")


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(prog="python -m backend.bench.replay", description=__doc__.split("\n\n")[0],
                                 epilog="Run it on a GPU: python -m backend.bench.replay --model embedded --device "
                                 "cuda --sessions 3 --out bench/results/")
    ap.add_argument("--interface", choices=["serve", "engine"], default="serve",
                    help="serve: `reviewer serve` subprocesses over HTTP (the product figure); engine: Engine.generate "
                    "in-process (GPU shapes with random weights, with --forced-tau)")
    ap.add_argument("--model", default="embedded", help="what `reviewer serve --model` takes (embedded, a HF folder, "
                    "a .gguf); with --interface engine also qwen3.6-35b-a3b-shape")
    ap.add_argument("--drafters", default=",".join(CONFIGS),
                    help="comma-separated --drafter values, one cold server each (default none,auto; none is the "
                    "reference for identical replies)")
    ap.add_argument("--device", default=None, help="passed to serve --device (auto, cpu, cuda)")
    ap.add_argument("--max-context", type=int, default=None, help="serve: passed to serve --max-context (default: "
                    "the model's window); engine: the window (default 32768)")
    ap.add_argument("--serve-args", default="", help="more `reviewer serve` options, one string (e.g. '--dtype "
                    "bfloat16')")
    ap.add_argument("--sessions", type=int, default=3, help="sessions (personas correctness, performance, docs in turn)")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every reply")
    ap.add_argument("--chunk-chars", type=int, default=None,
                    help="characters of file per tool result (default 400 serve, 3000 engine: ~20 turns or more to the window)")
    ap.add_argument("--max-turns", type=int, default=None, help="stop each session after this many turns")
    ap.add_argument("--repo", type=Path, default=None, help="take the tool results from this folder's files instead "
                    "of the interpreter's own test suite")
    ap.add_argument("--forced-tau", type=float, default=None, help="engine interface, GPU: forced acceptance at this "
                    "tau against the --drafter none run's replies (random weights accept nothing)")
    ap.add_argument("--routing-trace", type=int, default=0, metavar="HOT", help="engine interface, MoE shapes with "
                    "random weights: route by a synthetic trace among HOT experts (as `reviewer bench --routing-trace`)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="engine interface, a target without a tokenizer "
                    "(the random shapes): render the sessions with this tokenizer folder (default: the embedded "
                    "model's)")
    ap.add_argument("--same-process", action="store_true", help="engine interface: every configuration in this "
                    "process over one loaded target (faster; the later configurations find per-shape caches warm). "
                    "Default: a fresh process each, as cold servers")
    ap.add_argument("--ready-timeout", type=float, default=900, help="seconds to wait for a server's ready line")
    ap.add_argument("--request-timeout", type=float, default=600, help="seconds one HTTP request may take")
    ap.add_argument("--logs", type=Path, default=None, help="serve: keep each server's stderr in this folder "
                    "(default: a temporary folder, removed)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"), help="folder (or .json file) for the record")
    ap.add_argument("--transcripts", type=Path, default=None, metavar="FILE.jsonl",
                    help="serve: also write the first configuration's sessions, whole (every reply and tool result), "
                    "one JSON line each: training data for `reviewer train --from-transcripts` (replay sources other "
                    "than the held-out ones for that)")
    return ap.parse_args(argv)


def exit_on_sigterm(signum, frame):
    """SIGTERM (a timeout, a job scheduler) ends the bench like Ctrl-C: the servers it started are stopped first."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, exit_on_sigterm)
    command = "python -m backend.bench.replay " + shlex.join(argv if argv is not None else sys.argv[1:])
    drafters = tuple(d.strip() for d in a.drafters.split(",") if d.strip())
    try:
        if not drafters:
            raise ReplayError("--drafters is empty")
        if a.max_tokens < 1:
            raise ReplayError("--max-tokens must be at least 1")
        source = repo_files(a.repo) if a.repo else stdlib_tests()
        chunk_chars = a.chunk_chars or (400 if a.interface == "serve" else 3000)
        sessions = build_sessions(a.sessions, source, chunk_chars=chunk_chars)
        settings = {"max_tokens": a.max_tokens, "chunk_chars": chunk_chars, "max_turns": a.max_turns,
                    "drafters": list(drafters), "temperature": 0, "stream": True}
        if a.transcripts and a.interface != "serve":
            raise ReplayError("--transcripts needs --interface serve (the engine replays token ids, not messages)")
        if a.interface == "serve":
            if a.forced_tau is not None or a.routing_trace:
                raise ReplayError("--forced-tau and --routing-trace need --interface engine (the server has neither)")
            serve_args = shlex.split(a.serve_args)
            serve_args += ["--device", a.device] if a.device else []
            serve_args += ["--max-context", str(a.max_context)] if a.max_context else []
            settings["serve_args"] = serve_args
            tools = load_tools()
            done = serve_replay(a.model, sessions, drafters=drafters, serve_args=serve_args,
                                max_tokens=a.max_tokens, max_turns=a.max_turns, ready_timeout=a.ready_timeout,
                                request_timeout=a.request_timeout, tools=tools, log_dir=a.logs)
            runs, rows, name = done.runs, done.rows, done.model
            interface = "reviewer serve over HTTP (openai client, streamed)"
            if a.transcripts:
                wrote = write_transcripts(a.transcripts, done.sessions[drafters[0]], sessions, tools,
                                          config=drafters[0], model=name, source=source.held_out)
                print(f"wrote {len(sessions)} session transcript(s) to {wrote}")
        else:
            replay = engine_replay if a.same_process or len(drafters) == 1 else isolated_replay
            runs, rows, name, extra, *_ = replay(a.model, sessions, drafters=drafters, device=a.device or "cuda",
                                                 max_context=a.max_context or 32768, max_tokens=a.max_tokens,
                                                 max_turns=a.max_turns, forced_tau=a.forced_tau,
                                                 routing_trace=a.routing_trace, tokenizer_dir=a.tokenizer)
            extra.setdefault("processes", "one process: the configurations share the target and every per-shape "
                             "cache (the later ones find them warm)")
            settings.update(extra)
            interface = "engine in-process"
    except (ReplayError, SessionError) as exc:
        print(f"reviewer bench replay: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("reviewer bench replay: interrupted; the servers it started are stopped, no record written",
              file=sys.stderr)
        return 130
    record = build_record(runs, rows, sessions, model=name, command=command, held_out=source.held_out,
                          interface=interface, forced_tau=a.forced_tau, settings=settings)
    print(format_table(record))
    print(f"wrote {write_record(record, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
