"""The persona agent loop: messages -> LLM -> tool calls -> results fed back -> ... until `finish` or a budget ends it.

One step is one LLM reply and the tool calls in it. The transcript is saved after every step, so a crash loses at most
the step in flight. What is sent to the model is a window over the full conversation that fits its context: old tool
outputs are elided first, then whole old steps; the system prompt, the task and the latest steps are always kept.
Models without native tool calling may write a <tool_call> JSON block (or a ```bash block) in their reply instead.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from reviewer.llm.client import CHARS_PER_TOKEN, ChatResponse, LLMClient, ToolCall
from reviewer.llm.errors import ContextOverflow, LLMError, ToolsUnsupported
from reviewer.persona.tools import TOOLS, Toolbox, ToolOutcome, cut_middle, describe_tools_as_text
from reviewer.text import squeeze

ELIDED = "[output elided to fit the context]"
TEXT_RESULT_PREFIX = "Result of "  # text-mode tool results go back as user messages starting with this
KEEP_STEPS = 2  # the latest steps are never elided
SAFETY = 0.9  # token estimates are rough (tokenizers differ): aim a little below the window
REPEAT_NUDGE_AT = 3  # the same call this many times in a row earns a nudge


class Recorder(Protocol):
    def record_finding(self, *, title, severity, category, details, evidence=None, repro_command=None, file=None,
                       line=None) -> int: ...

    def record_measurement(self, *, name, value: float, unit, command=None, repeats=None) -> int: ...

    def save_transcript(self, messages: list[dict], *, steps: int, prompt_tokens: int, completion_tokens: int,
                        llm_seconds: float, tokens_estimated: bool = False) -> None: ...


@dataclass
class StepEvent:
    """Sent after every step; tokens and LLM seconds are the persona's totals so far (completion_tokens /
    llm_seconds is its decoding speed)."""
    persona: str
    step: int
    tool: str | None  # the first tool called, None for a reply without a usable call
    prompt_tokens: int
    completion_tokens: int
    llm_seconds: float
    tokens_estimated: bool = False  # some counts are estimates: the server reported no usage


@dataclass
class AgentResult:
    status: str  # "completed" | "step_budget" | "token_budget" | "timeout" | "failed" | "interrupted"
    steps: int
    prompt_tokens: int
    completion_tokens: int
    llm_seconds: float
    summary: str | None
    error: str | None
    format_errors: int = 0  # replies without a usable tool call
    tokens_estimated: bool = False  # some of the token counts are estimates (the server reported no usage)


# --- text-mode tool calls -------------------------------------------------------------------------------------------

THINKING = re.compile(r"<think>.*?(</think>|$)", re.S)
TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
FUNCTION_XML = re.compile(r"<function=([\w.-]+)>(.*?)</function>", re.S)  # Qwen3.5-style calls
PARAMETER_XML = re.compile(r"<parameter=([\w.-]+)>\n?(.*?)\n?</parameter>", re.S)
BASH_FENCE = re.compile(r"```(?:bash|sh|shell|console)[ \t]*\n(.*?)```", re.S)


def parse_text_calls(content: str) -> list[ToolCall]:
    """Tool calls written in a reply's text: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks,
    Qwen's <function=NAME><parameter=ARG>value</parameter></function>, or else the first ```bash block."""
    content = THINKING.sub("", content or "")
    calls = []
    for n, match in enumerate(TOOL_CALL_BLOCK.finditer(content)):
        inner = match.group(1).strip()
        xml = FUNCTION_XML.search(inner)
        if xml:
            args = {k: v for k, v in PARAMETER_XML.findall(xml.group(2))}
            calls.append(ToolCall(f"text_{n}", xml.group(1), args, json.dumps(args)))
            continue
        try:
            obj = json.loads(inner)
        except json.JSONDecodeError:
            calls.append(ToolCall(f"text_{n}", "", None, inner))
            continue
        if not isinstance(obj, dict):
            calls.append(ToolCall(f"text_{n}", "", None, inner))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models double-encode
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        calls.append(ToolCall(f"text_{n}", str(obj.get("name", "")), args if isinstance(args, dict) else None,
                              inner))
    if calls:
        return calls
    fence = BASH_FENCE.search(content)
    if fence and fence.group(1).strip():
        command = fence.group(1).strip()
        return [ToolCall("text_0", "bash", {"command": command}, json.dumps({"command": command}))]
    return []


# --- context window -------------------------------------------------------------------------------------------------

def is_tool_output(message: dict) -> bool:
    return message["role"] == "tool" or (
        message["role"] == "user" and (message.get("content") or "").startswith(TEXT_RESULT_PREFIX))


def message_chars(message: dict) -> int:
    chars = len(message.get("content") or "")
    if message.get("tool_calls"):
        chars += len(json.dumps(message["tool_calls"]))
    return chars


def latest_steps_start(messages: list[dict], keep_steps: int) -> int:
    """Index where the latest `keep_steps` steps begin (each step starts with an assistant message)."""
    starts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return starts[-keep_steps] if len(starts) >= keep_steps else 2


def fit_context(messages: list[dict], budget: int, count: Callable[[dict], int],
                keep_steps: int = KEEP_STEPS) -> list[dict]:
    """A copy of `messages` whose estimated size fits `budget` tokens. Order of sacrifice: old tool outputs, then
    whole old steps (replaced by one note), then - only if the latest steps alone are too big - the middle of the
    longest messages. messages[0] (system) and messages[1] (task) are always there."""
    window = [dict(m) for m in messages]
    sizes = [count(m) for m in window]
    if sum(sizes) <= budget:
        return window
    keep_from = latest_steps_start(window, keep_steps)
    for i in range(2, keep_from):
        if sum(sizes) <= budget:
            break
        if is_tool_output(window[i]) and window[i]["content"] != ELIDED:
            window[i]["content"] = ELIDED
            sizes[i] = count(window[i])
    dropped = 0
    while sum(sizes) > budget and keep_from > 2:
        end = 3  # one step: the message at 2 and everything up to the next assistant message
        while end < keep_from and window[end]["role"] != "assistant":
            end += 1
        del window[2:end], sizes[2:end]
        keep_from -= end - 2
        dropped += 1
    if dropped:
        note = {"role": "user", "content": f"[{dropped} earlier steps elided to fit the context]"}
        window.insert(2, note)
        sizes.insert(2, count(note))
    while sum(sizes) > budget:  # the latest steps alone are too big: cut the longest message (never the system)
        i = max(range(1, len(window)), key=sizes.__getitem__)
        content = window[i].get("content") or ""
        if len(content) < 400:
            break  # nothing left worth cutting; let the server decide
        window[i]["content"] = cut_middle(content, len(content) // 2)
        sizes[i] = count(window[i])
    return window


def for_server(window: list[dict]) -> list[dict]:
    """Unparsable tool-call arguments are kept verbatim in the transcript, but servers that re-parse the history
    through a chat template reject them, so the copy we send carries `{}` instead (the tool result explains)."""
    out = []
    for m in window:
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                try:
                    json.loads(tc["function"]["arguments"] or "{}")
                    calls.append(tc)
                except json.JSONDecodeError:
                    calls.append({**tc, "function": {**tc["function"], "arguments": "{}"}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


# --- the loop -------------------------------------------------------------------------------------------------------

class Agent:
    def __init__(self, persona, workspace, llm: LLMClient, recorder: Recorder, *, max_steps: int, timeout: float,
                 task: str, on_step: Callable[[StepEvent], None], max_total_tokens: int | None,
                 command_timeout: int, on_delta: Callable[[str], None] | None,
                 on_note: Callable[[str], None] | None = None):
        self.persona, self.llm, self.recorder = persona, llm, recorder
        self.on_note = on_note or (lambda message: None)
        self.max_steps, self.max_total_tokens, self.on_step, self.on_delta = max_steps, max_total_tokens, on_step, on_delta
        params = dict(persona.model_settings or {})
        self.text_mode = params.pop("tool_format", "native") == "text"
        window = llm.context_window
        self.asked_max_tokens = params.get("max_tokens")
        self.params = params
        self.fit_reply(window)
        self.deadline = time.monotonic() + timeout
        max_output = min(12_000, max(2_000, int(window * CHARS_PER_TOKEN / 8)))
        self.toolbox = Toolbox(workspace, recorder, max_output=max_output, max_command_timeout=command_timeout,
                               deadline=self.deadline)
        system = persona.system_prompt + (describe_tools_as_text() if self.text_mode else "")
        self.messages: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        self.steps = self.prompt_tokens = self.completion_tokens = self.format_errors = 0
        self.llm_seconds = 0.0
        self.scale = 1.0  # real tokens per estimated token, learned from the server's usage reports
        self.shrink = 1.0  # lowered when the server says a prompt did not fit
        self.last_call, self.repeats = "", 0
        self.tokens_estimated = False

    def fit_reply(self, window: int) -> None:
        """Room for the reply: it scales with the window, so a small local model (8k) keeps most of its context for
        the conversation and a large one is not starved."""
        self.window = window
        self.reply_tokens = min(int(self.asked_max_tokens or min(4096, window // 6)), window // 2)
        self.params["max_tokens"] = self.reply_tokens

    # --- bookkeeping ---

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def count(self, message: dict) -> int:
        return int(message_chars(message) / CHARS_PER_TOKEN * self.scale) + 4

    def save(self) -> None:
        self.recorder.save_transcript(self.messages, steps=self.steps, prompt_tokens=self.prompt_tokens,
                                      completion_tokens=self.completion_tokens, llm_seconds=self.llm_seconds,
                                      tokens_estimated=self.tokens_estimated)

    # --- one LLM call ---

    def query(self) -> ChatResponse:
        tools = None if self.text_mode else TOOLS
        tools_tokens = int(len(json.dumps(tools)) / CHARS_PER_TOKEN * self.scale) if tools else 0
        budget = int((self.window - self.reply_tokens - tools_tokens) * SAFETY * self.shrink)
        window = for_server(fit_context(self.messages, budget, self.count))
        try:
            response = self.llm.chat(window, tools, on_delta=self.on_delta, request_timeout=self.time_left(),
                                     **self.params)
        except ToolsUnsupported as e:
            self.text_mode = True  # this server takes no `tools`: describe them in the system prompt instead
            self.messages[0]["content"] += describe_tools_as_text()
            self.on_note(str(e))
            return self.query()
        except ContextOverflow:
            if self.llm.context_window < self.window:  # the server named its real window: fit that first
                self.fit_reply(self.llm.context_window)
            elif self.shrink < 0.3:
                raise
            else:
                self.shrink *= 0.7
            return self.query()
        if not response.usage_estimated and response.prompt_tokens > 0:
            estimated = sum(message_chars(m) for m in window) / CHARS_PER_TOKEN + 4 * len(window)
            if tools:
                estimated += len(json.dumps(tools)) / CHARS_PER_TOKEN
            self.scale = min(4.0, max(0.5, response.prompt_tokens / max(estimated, 1)))
        return response

    # --- one step ---

    def step(self) -> ToolOutcome | None:
        """One LLM reply and its tool calls; returns the finish outcome when the model called finish."""
        self.steps += 1
        response = self.query()
        self.prompt_tokens += response.prompt_tokens
        self.completion_tokens += response.completion_tokens
        self.llm_seconds += response.seconds
        self.tokens_estimated |= response.usage_estimated
        calls, native = response.tool_calls, bool(response.tool_calls)
        if not native:
            calls = parse_text_calls(response.content)
        assistant: dict = {"role": "assistant", "content": response.content}
        if native:
            assistant["tool_calls"] = [{"id": c.id, "type": "function",
                                        "function": {"name": c.name, "arguments": c.raw_arguments}} for c in calls]
        self.messages.append(assistant)
        if not calls:
            self.format_errors += 1
            self.messages.append({"role": "user", "content": self.correction(response)})
        finished = None
        for call in calls:
            if finished is not None:
                output = "skipped: finish was already called"
            else:
                if not native and not call.name:
                    self.format_errors += 1
                outcome = self.toolbox.execute(call.name, call.arguments, call.raw_arguments)
                output = outcome.output + self.repeat_nudge(call)
                finished = outcome if outcome.finished else None
            if native:
                self.messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
            else:
                self.messages.append({"role": "user", "content": f"{TEXT_RESULT_PREFIX}{call.name or 'tool call'}:\n"
                                                                 f"{output}"})
        remaining = self.max_steps - self.steps
        if finished is None and remaining in (1, 3) and self.messages[-1]["role"] != "assistant":
            self.messages[-1]["content"] += (f"\n\n[{remaining} step{'s' if remaining > 1 else ''} left: record what you "
                                             "have confirmed, then call finish]")
        self.save()
        self.on_step(StepEvent(self.persona.name, self.steps, calls[0].name if calls else None,
                               self.prompt_tokens, self.completion_tokens, self.llm_seconds, self.tokens_estimated))
        return finished

    def correction(self, response: ChatResponse) -> str:
        if response.finish_reason == "length":
            first = "Your reply was cut off at the length limit before any tool call. Keep replies short."
        else:
            first = "Your reply contained no tool call."
        return (f"{first} Reply with exactly one tool call (bash, read_file, write_file, record_finding, "
                "record_measurement or finish); call finish(summary=...) when you are done. If you cannot call tools "
                'directly, end your reply with <tool_call>{"name": "bash", "arguments": {"command": "ls"}}'
                "</tool_call>.")

    def repeat_nudge(self, call: ToolCall) -> str:
        signature = call.name + json.dumps(call.arguments, sort_keys=True)
        self.repeats = self.repeats + 1 if signature == self.last_call else 1
        self.last_call = signature
        if self.repeats < REPEAT_NUDGE_AT or call.name == "finish":
            return ""
        return (f"\n\n[note: you have made exactly this call {self.repeats} times in a row; its result will not "
                "change. Try something different, or call finish if you are done.]")

    # --- the whole run ---

    def run(self) -> AgentResult:
        status, summary, error = "step_budget", None, None
        try:
            while True:
                if self.steps >= self.max_steps:
                    break
                if self.time_left() <= 0:
                    status = "timeout"
                    break
                if self.max_total_tokens and self.prompt_tokens + self.completion_tokens >= self.max_total_tokens:
                    status = "token_budget"
                    break
                finished = self.step()
                if finished is not None:
                    status, summary = "completed", finished.summary
                    break
        except LLMError as e:
            status, error = ("timeout", None) if self.time_left() <= 0 else ("failed", str(e))
        except KeyboardInterrupt:
            status, error = "interrupted", "interrupted by the user"
        except Exception as e:  # noqa: BLE001 - whatever breaks, the transcript is saved and the status says so
            status, error = "failed", squeeze(f"{type(e).__name__}: {e}")
        if status == "step_budget" and self.format_errors:
            error = f"{self.format_errors} of {self.steps} replies had no usable tool call"
        if status == "timeout":
            error = error or f"the wall-clock limit ran out after {self.steps} steps"
        try:
            self.save()
        except Exception as e:  # noqa: BLE001
            if status != "failed":
                status, error = "failed", squeeze(f"could not save the transcript: {type(e).__name__}: {e}")
        return AgentResult(status, self.steps, self.prompt_tokens, self.completion_tokens, self.llm_seconds, summary,
                           error, self.format_errors, self.tokens_estimated)


def run_agent(persona, workspace, llm: LLMClient, recorder: Recorder, *, max_steps: int, timeout: float, task: str,
              on_step: Callable[[StepEvent], None] = lambda e: None, max_total_tokens: int | None = None,
              command_timeout: int = 600, on_delta: Callable[[str], None] | None = None,
              on_note: Callable[[str], None] | None = None) -> AgentResult:
    """Run one LLM persona in its workspace until it calls finish or a budget ends it; never raises for LLM or tool
    failures (the status and error say what happened). `on_delta` sees generated text as it streams (live tokens/s);
    `on_note` gets what the run's log must say (e.g. that this endpoint drops `tools` and calls are now text).
    With several endpoints the whole run goes to one healthy endpoint (llm.route(); failover moves it on)."""
    route = getattr(llm, "route", None)
    llm = route() if route else llm
    return Agent(persona, workspace, llm, recorder, max_steps=max_steps, timeout=timeout, task=task, on_step=on_step,
                 max_total_tokens=max_total_tokens, command_timeout=command_timeout, on_delta=on_delta,
                 on_note=on_note).run()
