"""The tools a persona agent can call: their JSON schemas (OpenAI function format) and their implementations.

Names and arguments are a public contract (other programs parse transcripts): bash(command, timeout=120),
read_file(path, offset=0, limit=400), write_file(path, content), record_finding(title, severity, category, details,
evidence=None, repro_command=None, file=None, line=None), record_measurement(name, value, unit, command=None,
repeats=None), finish(summary), and the deterministic probes (reviewer/persona/probes): probe_docs(), probe_timing(),
probe_scaling(function=None), probe_edges(function=None). Bad arguments never raise out of here: they come back as an
error text the model can read and correct.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from reviewer.persona.probes.suite import run_tool
from reviewer.store.db import SEVERITIES

TOOL_NAMES = ("bash", "read_file", "write_file", "record_finding", "record_measurement", "finish", "probe_docs",
              "probe_timing", "probe_scaling", "probe_edges")


def function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


def string(description: str) -> dict:
    return {"type": "string", "description": description}


TOOLS: list[dict] = [
    function("bash", "Run a shell command with bash in the repository root, inside the sandbox, with the workspace's "
             "virtual environment first on PATH. Each call starts fresh: `cd` and exported variables do not carry "
             "over, so chain with &&. Returns the exit code and the output (stdout and stderr merged; long output is "
             "cut in the middle).",
             {"command": string("the command line"),
              "timeout": {"type": "integer", "description": "seconds before the command is killed (default 120)"}},
             ["command"]),
    function("read_file", "Read a text file of the workspace, with line numbers.",
             {"path": string("path relative to the repository root (or absolute, inside it)"),
              "offset": {"type": "integer", "description": "first line to show, counting from 0 (default 0)"},
              "limit": {"type": "integer", "description": "how many lines to show (default 400)"}},
             ["path"]),
    function("write_file", "Create or overwrite a file in the workspace (e.g. a benchmark or a repro script).",
             {"path": string("path relative to the repository root"), "content": string("the whole file content")},
             ["path", "content"]),
    function("record_finding", "Record one problem you observed yourself, with evidence.",
             {"title": string("one line: what is wrong"),
              "severity": {"type": "string", "enum": list(SEVERITIES),
                           "description": "critical, high, medium, low or info"},
              "category": string("e.g. install, correctness, performance, docs, crash, usability"),
              "details": string("what you did, what you expected, what happened"),
              "evidence": string("the command you ran and the relevant part of its output"),
              "repro_command": string("a shell command, run from the repository root, that exits non-zero while "
                                      "the problem is present and zero once it is fixed"),
              "file": string("source file where the problem is, relative to the repository root"),
              "line": {"type": "integer", "description": "line number in that file"}},
             ["title", "severity", "category", "details"]),
    function("record_measurement", "Record one number you measured yourself (a time, a rate, a size).",
             {"name": string("what was measured, e.g. 'moving_average n=1e6 window=10'"),
              "value": {"type": "number", "description": "the measured value (e.g. the median of the repeats)"},
              "unit": string("e.g. s, ms, MB, items/s"),
              "command": string("the command that produced it"),
              "repeats": {"type": "integer", "description": "how many runs the value summarizes"}},
             ["name", "value", "unit"]),
    function("finish", "End the review with a short summary of what you checked and found.",
             {"summary": string("a few sentences: what works, what does not, what you could not check")},
             ["summary"]),
    # The probes (reviewer/persona/probes) record their own findings, with repro commands; install the project first.
    function("probe_docs", "Run every README/docs example and documented command; record each that fails or gives "
             "another result than the docs show.", {}, []),
    function("probe_timing", "Time `import` of the package and each console script's --help; record what is slow.",
             {}, []),
    function("probe_scaling", "Time the functions the tests and docs call at growing input sizes; record super-linear "
             "growth.", {"function": string("only this function (default: all)")}, []),
    function("probe_edges", "Call the functions and CLIs with empty, zero, negative, non-ASCII and malformed-file "
             "inputs; record crashes.", {"function": string("only this function (default: all)")}, []),
]


# --- argument validation --------------------------------------------------------------------------------------------

class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BashArgs(Args):
    command: str = Field(min_length=1)
    timeout: int = Field(120, ge=1)


class ReadFileArgs(Args):
    path: str = Field(min_length=1)
    offset: int = Field(0, ge=0)
    limit: int = Field(400, ge=1)


class WriteFileArgs(Args):
    path: str = Field(min_length=1)
    content: str


class RecordFindingArgs(Args):
    title: str = Field(min_length=1)
    severity: Literal["critical", "high", "medium", "low", "info"]
    category: str = Field(min_length=1)
    details: str
    evidence: str | None = None
    repro_command: str | None = None
    file: str | None = None
    line: int | None = Field(None, ge=0)

    @field_validator("severity", "category", mode="before")
    @classmethod
    def _lower(cls, v):  # "High" from a model means high
        return v.strip().lower() if isinstance(v, str) else v


class RecordMeasurementArgs(Args):
    name: str = Field(min_length=1)
    value: float
    unit: str
    command: str | None = None
    repeats: int | None = Field(None, ge=1)

    @field_validator("value")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("value must be a finite number")
        return v


class FinishArgs(Args):
    summary: str = Field(min_length=1)


class ProbeArgs(Args):
    pass


class ProbeFunctionArgs(Args):
    function: str | None = None


ARG_MODELS: dict[str, type[Args]] = {
    "bash": BashArgs, "read_file": ReadFileArgs, "write_file": WriteFileArgs, "record_finding": RecordFindingArgs,
    "record_measurement": RecordMeasurementArgs, "finish": FinishArgs, "probe_docs": ProbeArgs,
    "probe_timing": ProbeArgs, "probe_scaling": ProbeFunctionArgs, "probe_edges": ProbeFunctionArgs,
}


def validation_message(name: str, error: ValidationError) -> str:
    problems = []
    for err in error.errors():
        where = ".".join(str(p) for p in err["loc"]) or "arguments"
        problems.append(f"{where}: {err['msg']}")
    params = TOOLS[TOOL_NAMES.index(name)]["function"]["parameters"]
    signature = ", ".join(k if k in params["required"] else f"{k}=..." for k in params["properties"])
    return f"error: bad arguments for {name}: {'; '.join(problems)}. Call it as {name}({signature})."


# --- output shaping -------------------------------------------------------------------------------------------------

def cut_middle(text: str, limit: int) -> str:
    """Keep the head and the tail: errors tend to be at the end, context at the start."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    left_out = len(text) - head - tail
    return f"{text[:head]}\n[... {left_out} characters left out ...]\n{text[-tail:]}"


@dataclass
class ToolOutcome:
    output: str  # what the model reads back
    ok: bool = True
    finished: bool = False
    summary: str | None = None


class Toolbox:
    """Runs tool calls against one workspace and one recorder.

    `max_output` bounds what one tool result may add to the conversation (characters); `max_command_timeout` bounds
    a bash call's own timeout; `deadline` (time.monotonic) cuts a command short when the persona's time runs out.
    """

    def __init__(self, workspace, recorder, *, max_output: int = 10_000, max_command_timeout: int = 600,
                 deadline: float | None = None):
        self.workspace, self.recorder = workspace, recorder
        self.max_output, self.max_command_timeout, self.deadline = max_output, max_command_timeout, deadline

    def execute(self, name: str, arguments: dict | None, raw_arguments: str = "") -> ToolOutcome:
        if not name:
            return ToolOutcome('error: could not read that tool call; write it as <tool_call>{"name": "bash", '
                               f'"arguments": {{"command": "ls"}}}}</tool_call> (got {raw_arguments[:200]!r})', ok=False)
        if name not in ARG_MODELS:
            return ToolOutcome(f"error: unknown tool '{name}'. The tools are: {', '.join(TOOL_NAMES)}.", ok=False)
        if arguments is None:
            return ToolOutcome(f"error: the arguments for {name} are not a JSON object: {raw_arguments[:200]!r}",
                               ok=False)
        try:
            args = ARG_MODELS[name].model_validate(arguments)
        except ValidationError as e:
            return ToolOutcome(validation_message(name, e), ok=False)
        try:
            return getattr(self, name)(args)
        except Exception as e:  # noqa: BLE001 - a failing tool is reported to the model, never raised out of the loop
            return ToolOutcome(f"error: {name} failed: {type(e).__name__}: {e}", ok=False)

    def bash(self, args: BashArgs) -> ToolOutcome:
        timeout = min(args.timeout, self.max_command_timeout, int(getattr(self.workspace, "command_timeout", 10**9)))
        if self.deadline is not None:
            timeout = min(timeout, max(1, int(self.deadline - time.monotonic())))
        result = self.workspace.run(args.command, timeout=timeout)
        if result.timed_out:
            status = f"timed out after {timeout} s; the command was killed"
        else:
            status = f"exit code: {result.exit_code}"
        output = result.output if result.output.strip() else "(no output)"
        return ToolOutcome(f"{status} ({result.seconds:.1f} s)\n{cut_middle(output, self.max_output)}")

    def read_file(self, args: ReadFileArgs) -> ToolOutcome:
        path = self.workspace.resolve(args.path)
        if path.is_dir():
            entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
            return ToolOutcome(f"{args.path} is a directory:\n" + cut_middle("\n".join(entries), self.max_output))
        if not path.is_file():
            return ToolOutcome(f"error: no such file: {args.path}", ok=False)
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            return ToolOutcome(f"error: {args.path} is a binary file ({len(data)} bytes)", ok=False)
        lines = data.decode("utf-8", errors="replace").splitlines()
        shown = lines[args.offset : args.offset + args.limit]
        body, used = [], 0
        for number, line in enumerate(shown, start=args.offset + 1):
            row = f"{number:6}\t{line[:1000]}"
            if used + len(row) > self.max_output:
                break
            body.append(row)
            used += len(row) + 1
        last = args.offset + len(body)
        if not lines:
            header = f"{args.path}: empty file"
        elif not body:
            header = f"{args.path} has {len(lines)} lines; offset {args.offset} is past the end"
        else:
            header = f"{args.path} lines {args.offset + 1}-{last} of {len(lines)}:"
        footer = f"\n[... {len(lines) - last} more lines: read_file(path, offset={last}) ...]" if last < len(lines) \
            and body else ""
        return ToolOutcome("\n".join([header, *body]) + footer)

    def write_file(self, args: WriteFileArgs) -> ToolOutcome:
        path = self.workspace.resolve(args.path)
        if path.is_dir():
            return ToolOutcome(f"error: {args.path} is a directory", ok=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(args.content, encoding="utf-8")
        return ToolOutcome(f"wrote {len(args.content)} characters to {args.path}")

    def record_finding(self, args: RecordFindingArgs) -> ToolOutcome:
        finding_id = self.recorder.record_finding(**args.model_dump())
        note = "" if args.repro_command else " (no repro_command: it cannot be verified; add one if you can)"
        return ToolOutcome(f"finding #{finding_id} recorded: [{args.severity}] {args.title}{note}")

    def record_measurement(self, args: RecordMeasurementArgs) -> ToolOutcome:
        measurement_id = self.recorder.record_measurement(**args.model_dump())
        return ToolOutcome(f"measurement #{measurement_id} recorded: {args.name} = {args.value:g} {args.unit}")

    def finish(self, args: FinishArgs) -> ToolOutcome:
        return ToolOutcome("finished", finished=True, summary=args.summary)

    def probe(self, kind: str, function: str | None = None) -> ToolOutcome:
        text = run_tool(kind, self.workspace, self.recorder, deadline=self.deadline, function=function)
        return ToolOutcome(cut_middle(text, self.max_output), ok=not text.startswith("error:"))

    def probe_docs(self, args: ProbeArgs) -> ToolOutcome:
        return self.probe("docs")

    def probe_timing(self, args: ProbeArgs) -> ToolOutcome:
        return self.probe("timing")

    def probe_scaling(self, args: ProbeFunctionArgs) -> ToolOutcome:
        return self.probe("scaling", args.function)

    def probe_edges(self, args: ProbeFunctionArgs) -> ToolOutcome:
        return self.probe("edges", args.function)


def describe_tools_as_text() -> str:
    """The tools written out for models without native tool calling (appended to the system prompt)."""
    lines = []
    for tool in TOOLS:
        fn = tool["function"]
        params = fn["parameters"]
        args = ", ".join(k if k in params["required"] else f"{k}=..." for k in params["properties"])
        lines.append(f"- {fn['name']}({args}): {fn['description']}")
    example = json.dumps({"name": "bash", "arguments": {"command": "ls -la"}})
    return ("\n\n## How to call a tool\nCall exactly one tool per reply by ending your reply with a block like this "
            f"(JSON inside):\n<tool_call>{example}</tool_call>\nA ```bash fenced block also runs as a bash command. "
            "The result comes back in the next message. The tools:\n" + "\n".join(lines))

