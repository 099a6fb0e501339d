"""The `reviewer` command line: parse options, load settings, hand over to the module that does the work.

Nothing here imports torch or the backend at import time: the worker box installs `reviewer` without them, and the
backend commands (`serve`, `bench`, `train`) import it only when called. Each command imports its own module (run,
loop, report, doctor, personas) inside its function for the same reason at a smaller scale: `reviewer --help` and a
bad option answer at once, without loading the SDKs, SQLAlchemy and rich's live view that the work needs. These
imports hide no circle (tests/import_graph.py counts them).
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from reviewer.config import ConfigError, Settings, load_settings

app = typer.Typer(
    name="reviewer",
    help="Review software repositories with simulated users (persona agents) that think through a local LLM backend.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

def fail(message: str, code: int = 2) -> typer.Exit:
    err_console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def settings_or_exit(**overrides) -> Settings:
    try:
        return load_settings(**overrides)
    except ConfigError as e:
        raise fail(str(e)) from None


DbOption = Annotated[Optional[str], typer.Option("--db", help="Database path or URL (default: reviews.db, or config).")]
LlmOption = Annotated[
    Optional[list[str]],
    typer.Option(
        "--llm",
        help="LLM backend: embedded (start a local `reviewer serve`), openai, anthropic, an OpenAI-compatible base URL "
        "(http://host:port/v1) or unix:///path.sock. Repeat for a failover list. Default: embedded, or config.",
    ),
]
ModelOption = Annotated[Optional[str], typer.Option("--model", help="Model name to ask the LLM for.")]
ContextWindowOption = Annotated[
    Optional[int],
    typer.Option("--context-window", help="The model's context window in tokens, for a server that does not say it "
                 "(llama-cpp-python's server; docs/backends.md); at least 512. Default: what the server reports in "
                 "/v1/models, /props or /slots, else 8192 with a warning (config key: context_window)."),
]
PersonaOption = Annotated[
    Optional[list[str]],
    typer.Option("--persona", "-p", help="Persona to run (repeatable). Default: smoke, performance, correctness, docs; "
                 "with the embedded model only smoke (the others need a capable --llm)."),
]
PersonasDirOption = Annotated[
    Optional[list[Path]], typer.Option("--personas-dir", help="Extra folder of persona .md files (repeatable).")
]


class ReportFormat(str, Enum):
    table = "table"
    markdown = "markdown"
    json = "json"
    html = "html"


@app.command()
def run(
    target: Annotated[str, typer.Argument(help="Git URL (https, ssh, file://) or local path of a git repository.")],
    persona: PersonaOption = None,
    ref: Annotated[Optional[str], typer.Option(help="Branch, tag or commit to review (default: the default branch).")] = None,
    llm: LlmOption = None,
    model: ModelOption = None,
    context_window: ContextWindowOption = None,
    db: DbOption = None,
    max_steps: Annotated[Optional[int], typer.Option(help="Step budget per persona (overrides the persona's own).")] = None,
    timeout: Annotated[Optional[float], typer.Option(help="Wall-clock limit per persona, seconds; it cuts an LLM call or a command under way.")] = None,
    personas_dir: PersonasDirOption = None,
    isolation: Annotated[Optional[str], typer.Option(help="Sandbox: auto, bwrap or none (none is loudly reported).")] = None,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="Fail at once if another review holds this machine.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the finished run as JSON instead of tables.")] = False,
    no_probes: Annotated[bool, typer.Option("--no-probes", help="Skip the smoke persona's deterministic probes "
                                            "(docs examples, timing claims, scaling, edge inputs).")] = False,
) -> None:
    """Review one repository now: each persona installs it from scratch, tests it, tries to break it, and records
    findings and measurements in the database. Reviews on one machine run one at a time; before it starts, a review
    marks runs whose process is gone interrupted and removes the workspaces and sandbox folders they left. After its
    install and tests, the smoke persona runs the probes of docs/probes.md: the docs' examples, commands and shell
    sessions, import and CLI start-up time, scaling and edge inputs of the functions the tests call, collection
    classes against the built-in type as their model, each finding with a repro command."""
    settings = settings_or_exit(
        llm=llm, model=model, context_window=context_window, db=db, personas=persona, max_steps=max_steps, timeout=timeout,
        personas_dir=personas_dir, isolation=isolation, probes=False if no_probes else None,
    )
    from reviewer.run.inputs import UserError, check_inputs  # light: bad input answers before the SDKs load

    try:
        checked = check_inputs(target, settings, ref)
    except UserError as e:
        raise fail(str(e)) from None
    from reviewer.run.review import run_command

    raise typer.Exit(run_command(target, settings, ref=ref, no_wait=no_wait, json_output=json_output, console=console,
                                 checked=checked))


@app.command()
def loop(
    repo: Annotated[Optional[list[str]], typer.Option("--repo", help="Repository to watch (repeatable).")] = None,
    repos_file: Annotated[Optional[Path], typer.Option(help="File with one repository URL per line.")] = None,
    interval: Annotated[float, typer.Option(help="Seconds between polls for new commits.")] = 300.0,
    once: Annotated[bool, typer.Option("--once", help="One pass over the repositories, then exit.")] = False,
    max_reviews: Annotated[Optional[int], typer.Option(help="Stop after this many reviews.")] = None,
    persona: PersonaOption = None,
    llm: LlmOption = None,
    model: ModelOption = None,
    context_window: ContextWindowOption = None,
    db: DbOption = None,
    personas_dir: PersonasDirOption = None,
    worker: Annotated[Optional[str], typer.Option(help="This worker's name in a shared queue (default: host name).")] = None,
    lease: Annotated[
        Optional[float], typer.Option(help="Seconds a claimed review stays claimed without a heartbeat (default: 300).")
    ] = None,
) -> None:
    """Review continuously: watch repositories for new commits and review each new commit once, one at a time.
    Several loops (on one or many machines) can share one database queue: `--db postgresql://...`."""
    settings = settings_or_exit(llm=llm, model=model, context_window=context_window, db=db, personas=persona,
                                personas_dir=personas_dir, worker=worker, lease_seconds=lease)
    from reviewer.run.loop import LoopError, loop_command

    try:
        code = loop_command(settings, repos=repo or [], repos_file=repos_file, interval=interval, once=once,
                            max_reviews=max_reviews, console=console)
    except LoopError as e:
        raise fail(str(e)) from None
    raise typer.Exit(code)


@app.command()
def report(
    db: DbOption = None,
    repo: Annotated[Optional[str], typer.Option(help="Only this repository URL.")] = None,
    run_id: Annotated[Optional[int], typer.Option("--run", help="Only this run id.")] = None,
    persona: Annotated[Optional[str], typer.Option(help="Only this persona.")] = None,
    severity: Annotated[Optional[str], typer.Option(help="This severity and worse: critical, high, medium, low, info.")] = None,
    state: Annotated[Optional[str], typer.Option(help="Only findings in this state: new, persisting, fixed, regressed.")] = None,
    since: Annotated[Optional[str], typer.Option(help="Only runs started on or after this ISO date.")] = None,
    verified_only: Annotated[bool, typer.Option("--verified-only", help="Hide findings that were not verified.")] = False,
    format: Annotated[ReportFormat, typer.Option("--format", "-f", help="Output format.")] = ReportFormat.table,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write to this file instead of stdout.")] = None,
) -> None:
    """Show stored reviews: findings by severity, their state and verification, and measurements. Runs of this
    machine whose process is gone (killed) are marked interrupted first, so none shows as running, and what they
    left (workspaces, their mounted disk images) is removed."""
    from reviewer.report.report import ReportError, ReportFilter, report_command

    settings = settings_or_exit(db=db)
    flt = ReportFilter(repo=repo, run_id=run_id, persona=persona, severity=severity, state=state, since=since,
                       verified_only=verified_only)
    try:
        report_command(settings.db, flt, format.value, output, console, workdir=settings.workdir)
    except ReportError as e:
        raise fail(str(e)) from None


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="Local HF model folder, a .gguf file, or 'embedded' (SmolLM2-135M-Instruct).")] = "embedded",
    drafter: Annotated[str, typer.Option(help="DFlash drafter folder, 'auto' (the one shipped for the model) or 'none'.")] = "auto",
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free one, printed in the listening line).")] = 8000,
    uds: Annotated[Optional[str], typer.Option(help="Serve on this unix socket path instead of TCP.")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, bfloat16 or float32.")] = "auto",
    max_context: Annotated[Optional[int], typer.Option(help="Context window in tokens (default: the model's).")] = None,
    api_key: Annotated[
        Optional[str], typer.Option(envvar="REVIEWER_SERVE_API_KEY", help="Require this key on every route but /health.")
    ] = None,
    api_key_file: Annotated[Optional[Path], typer.Option(help="Read the API key from this file.")] = None,
    allow_remote_without_key: Annotated[
        bool, typer.Option("--allow-remote-without-key", help="Bind a non-loopback address without an API key anyway.")
    ] = False,
    max_body_mb: Annotated[
        Optional[float], typer.Option(help="Largest request body accepted, MiB; a larger one is refused with 413 before "
                                           "it is read. Default: 64 bytes per token of the context window, at least 1.")
    ] = None,
    body_timeout: Annotated[
        float, typer.Option(help="Seconds a request body may take to arrive in full (408 after that).")
    ] = 60.0,
    max_connections: Annotated[
        Optional[int], typer.Option(help="Client connections served at once; beyond them a few more are answered on "
                                         "/health and /metrics only, the rest get 503 with Retry-After and are closed. "
                                         "Default: 1024, lowered to fit the file-descriptor limit.")
    ] = None,
    max_queue: Annotated[
        int, typer.Option(help="Requests that may wait for the engine; one more gets 503 with Retry-After.")
    ] = 64,
    header_timeout: Annotated[
        float, typer.Option(help="Seconds a request line and its headers may take to arrive (408 and closed after "
                                 "that: a connection that sends nothing, or a byte at a time, is not held).")
    ] = 10.0,
    keepalive_timeout: Annotated[
        float, typer.Option(help="Seconds an idle keep-alive connection is kept between requests (then closed).")
    ] = 5.0,
    cpu_engine: Annotated[
        str, typer.Option(help="On the CPU: 'llama.cpp' (llama.cpp's runtime from the xllamacpp wheel, reading a GGUF's "
                               "own quantized weights), 'torch' (our engine, fp32 or bf16, with the DFlash drafter), or "
                               "'auto': llama.cpp for a GGUF model (embedded too) when installed and no drafter folder "
                               "is named (docs/backends.md).")
    ] = "auto",
    threads: Annotated[
        Optional[int], typer.Option(help="llama.cpp engine threads (default: one per usable CPU, fewer when the "
                                         "machine is already busy; always a passive wait). Printed in the ready line.")
    ] = None,
) -> None:
    """Serve a local model over an OpenAI- and Anthropic-compatible HTTP API (batch 1, speculative decoding).
    SIGTERM or Ctrl-C ends streams with a final error event and exits within a few seconds."""
    if device not in ("auto", "cpu", "cuda"):
        raise fail(f"--device must be auto, cpu or cuda, got '{device}'")
    if dtype not in ("auto", "bfloat16", "float32"):
        raise fail(f"--dtype must be auto, bfloat16 or float32, got '{dtype}'")
    if api_key_file:
        try:
            api_key = api_key_file.read_text().strip()
        except OSError as e:
            raise fail(f"cannot read --api-key-file: {e}") from None
        if not api_key:
            raise fail(f"--api-key-file {api_key_file} is empty")
    try:
        from backend.server import serve as serve_backend
    except ImportError as e:
        raise fail(f"the backend is not installed ({e}); install it with: pip install 'reviewer[backend]'") from None
    if max_body_mb is not None and not max_body_mb > 0:
        raise fail(f"--max-body-mb must be positive, got {max_body_mb:g}")
    serve_backend(model=model, drafter=drafter, host=host, port=port, uds=uds, device=device, dtype=dtype,
                  max_context=max_context, api_key=api_key, allow_remote_without_key=allow_remote_without_key,
                  max_body_bytes=None if max_body_mb is None else int(max_body_mb * 2**20), body_timeout=body_timeout,
                  max_connections=max_connections, max_queue=max_queue, header_timeout=header_timeout,
                  keepalive_timeout=keepalive_timeout, cpu_engine=cpu_engine, threads=threads)


@app.command()
def bench(
    model: Annotated[str, typer.Option(help="Target model: a folder, a .gguf, 'embedded', 'tiny-moe' (random hybrid MoE), or 'qwen3.6-35b-a3b-shape' (random weights at the 35B-A3B shape; GPU).")] = "embedded",
    drafter: Annotated[str, typer.Option(help="Drafter folder, 'auto', 'random', 'released-shape' (random, the released Qwen3.6 drafter's shape) or 'none'.")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    prompts: Annotated[int, typer.Option(help="Number of benchmark prompts.")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt.")] = 128,
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="Also write the results as JSON here.")] = None,
    adaptive: Annotated[str, typer.Option(help="Adaptive verify length: off, on or both.")] = "both",
    forced_tau: Annotated[str, typer.Option(help="GPU only: also time the cycle under forced acceptance at these tau (comma-separated, e.g. 4.9,6.4,8.1): drafts replaced by plain decoding's own tokens; for random weights, labelled forced in the record.")] = "",
    routing_trace: Annotated[int, typer.Option(metavar="HOT", help="MoE targets with random weights (which route uniformly): route by a synthetic trace instead, each layer's top-k among HOT experts per position (50 gives ~47 distinct experts per 16 positions, a real router's locality); labelled in the record; transformers' generate is skipped.")] = 0,
    replay: Annotated[bool, typer.Option("--replay", help="The product figure instead: agent sessions replayed through a cold `reviewer serve` over HTTP, --drafter none and the drafter side by side, greedy (a GPU shape with --forced-tau: through the engine in-process). Record in bench/results/ (or --json-out). Every option: python -m backend.bench.replay --help.")] = False,
    sessions: Annotated[int, typer.Option(help="--replay: agent sessions per configuration.")] = 3,
) -> None:
    """Measure decoding speed: plain vs speculative side by side (tau, acceptance per position, T_d, T_t, host time
    per cycle, L_target, eta predicted and measured, identical-output count). --replay: the product figure, agent
    sessions through `reviewer serve` cold."""
    if replay:
        raise typer.Exit(bench_replay(model=model, drafter=drafter, device=device, sessions=sessions,
                                      max_tokens=max_tokens, json_out=json_out, forced_tau=forced_tau,
                                      routing_trace=routing_trace))
    try:
        from backend.bench import main as bench_main
    except ImportError as e:
        raise fail(f"the backend is not installed or incomplete ({e}); install it with: pip install 'reviewer[backend]'") from None
    raise typer.Exit(bench_main(model=model, drafter=drafter, device=device, prompts=prompts, max_tokens=max_tokens,
                                json_out=json_out, adaptive=adaptive, forced_tau=forced_tau,
                                routing_trace=routing_trace, compare_hf=not routing_trace) or 0)


def bench_replay(*, model: str, drafter: str, device: str, sessions: int, max_tokens: int, json_out: Optional[Path],
                 forced_tau: str, routing_trace: int = 0) -> int:
    """`reviewer bench --replay`: backend/bench/replay.py with the options `bench` shares with it."""
    try:
        from backend.bench.replay import main as replay_main
    except ImportError as e:
        raise fail(f"the backend is not installed or incomplete ({e}); install it with: pip install 'reviewer[backend]'") from None
    args = ["--model", model, "--sessions", str(sessions), "--max-tokens", str(max_tokens),
            "--drafters", "none" if drafter == "none" else f"none,{drafter}"]
    args += ["--device", device] if device != "auto" else []
    args += ["--out", str(json_out)] if json_out else []
    if forced_tau:
        if "," in forced_tau:
            raise fail("--replay takes one --forced-tau value")
        args += ["--interface", "engine", "--forced-tau", forced_tau]
    if routing_trace:
        args += (["--interface", "engine"] if not forced_tau else []) + ["--routing-trace", str(routing_trace)]
    return replay_main(args)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def train(ctx: typer.Context) -> None:
    """Train a DFlash drafter for a target model on the target's own outputs (loss, block attention, corruption,
    block size, layers, draft vocabulary, seed; `--from-db` learns the review loop's own transcripts, `--from-transcripts`
    agent sessions replayed through `reviewer serve`).
    `reviewer train --help` lists every option."""
    try:
        from backend.train import cli as train_cli
    except ImportError as e:
        raise fail(f"the backend is not installed ({e}); install it with: pip install 'reviewer[backend]'") from None
    raise typer.Exit(train_cli(ctx.args, prog="reviewer train"))


@app.command()
def personas(
    personas_dir: PersonasDirOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """List the personas available to `reviewer run`: built in, and from --personas-dir or config."""
    from rich.table import Table

    from reviewer.persona.files import PersonaError, load_personas

    settings = settings_or_exit(personas_dir=personas_dir)
    try:
        found = load_personas(settings.personas_dir)
    except PersonaError as e:
        raise fail(str(e)) from None
    if json_output:
        print(json.dumps([p.summary() for p in found.values()], indent=2))
        return
    table = Table(title="Personas")
    for col in ("name", "description", "needs LLM", "steps", "source"):
        table.add_column(col)
    for p in found.values():
        table.add_row(p.name, p.description, "no" if p.deterministic else "yes", str(p.max_steps), str(p.source))
    console.print(table)


@app.command()
def doctor(db: DbOption = None) -> None:
    """Report what isolation this machine offers the sandbox (bubblewrap, namespaces, cgroups, the egress proxy) and
    why not; exit 0 when full isolation is available."""
    from reviewer.sandbox.doctor import doctor_command

    raise typer.Exit(doctor_command(settings_or_exit(db=db), console))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
