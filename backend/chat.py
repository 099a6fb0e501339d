"""Chat prompts in, structured answers out.

Prompt side: render messages (and tool schemas) with the model's own chat template. Three tool styles:
- "xml":      Qwen3.5/3.6 templates, which write `<tool_call><function=NAME><parameter=ARG>VALUE</parameter>...`.
- "hermes":   templates with native tool support in Hermes JSON form (`<tool_call>{"name", "arguments"}</tool_call>`),
              e.g. Qwen2.5/Qwen3.
- "injected": templates without tool support (SmolLM2's): we put the tool schemas into the system prompt in Hermes
              form ourselves and turn tool calls / tool results into plain text turns.

Output side, all incremental so that streaming and non-streaming share one code path (greedy streamed == greedy
non-streamed by construction):
token ids -> IncrementalDetokenizer -> StopStrings -> OutputParser -> events ("reasoning" | "content" | "tool_call").
Every stage holds back text that might still turn into something else (a split UTF-8 character, the start of a stop
string, the start of a `<think>` or `<tool_call>` tag).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (a user mistake: reported as a 400)."""


# ----------------------------------------------------------------------------------------------------------------------
# Prompt rendering
# ----------------------------------------------------------------------------------------------------------------------

def tool_style(tokenizer) -> str:
    """Which tool-call dialect the model speaks, judged from its chat template text."""
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):  # some tokenizers carry several named templates
        template = template.get("tool_use") or template.get("default") or ""
    if "<function=" in template:
        return "xml"
    if "tools" in template:
        return "hermes"
    return "injected"


def hermes_tools_system_prompt(tools: list[dict]) -> str:
    """Tool instructions in the Hermes/Qwen form, for templates that cannot render tools themselves."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _arguments_as_dict(arguments) -> dict | str:
    # Templates iterate over (or tojson) the arguments, so hand them a dict whenever the client sent a JSON string.
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments if arguments is not None else {}


def _native_messages(messages: list[dict]) -> list[dict]:
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": _arguments_as_dict(call["function"].get("arguments"))}}
                for call in message["tool_calls"]
            ]
        if message.get("content") is None:
            message["content"] = ""
        out.append(message)
    return out


def _injected_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Rewrite tool turns as plain system/user/assistant text for a template that knows nothing about tools."""
    out: list[dict] = []
    system_parts = []
    rest = messages
    if messages and messages[0]["role"] == "system":
        system_parts.append(messages[0].get("content") or "")
        rest = messages[1:]
    if tools:
        system_parts.append(hermes_tools_system_prompt(tools))
    if system_parts:
        out.append({"role": "system", "content": "\n\n".join(p for p in system_parts if p)})
    for message in rest:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results share one user turn, as Qwen does
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                body = {"name": call["function"]["name"], "arguments": _arguments_as_dict(call["function"].get("arguments"))}
                calls.append(f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>")
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": role, "content": content})
    for message in out:
        message.pop("_tool_results", None)
    return out


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None, style: str | None = None,
                template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    """Render a conversation into (prompt text, prompt token ids) ready for generation.

    `messages` use OpenAI's shape with string content: role, content, tool_calls, tool_call_id, name,
    reasoning_content. `tools` are OpenAI tool objects ({"type": "function", "function": {...}}). `template_kwargs`
    are extra variables for the template, e.g. {"enable_thinking": False} for Qwen3/3.5.
    Control tokens inside message text (say `<|im_end|>` in a file a tool read) are encoded as ordinary text, so
    content cannot end a turn early.
    """
    import jinja2

    style = style or tool_style(tokenizer)
    if not tokenizer.chat_template:
        raise ChatTemplateError("this model's tokenizer has no chat template; use /v1/completions instead")
    if style == "injected":
        conversation, template_tools = _injected_messages(messages, tools), None
    else:
        conversation, template_tools = _native_messages(messages), tools or None
    common = dict(tools=template_tools, add_generation_prompt=True, **(template_kwargs or {}))
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, **common)
        encoded = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                                sanitize_control_tokens=True, **common)
    except (jinja2.TemplateError, TypeError, KeyError, ValueError) as exc:
        raise ChatTemplateError(f"the model's chat template rejected this conversation: {exc}") from exc
    ids = encoded["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return text, list(ids)


def starts_in_reasoning(prompt_text: str) -> bool:
    """True when the template already opened a `<think>` block for the answer (Qwen3.5 thinking mode)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


def stop_token_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """End-of-turn ids: the generation config's eos ids, the tokenizer's eos, and ChatML's <|im_end|> where the
    vocabulary has it (a chat template may end its turns with it while eos names another token). The one list the
    server, `reviewer bench` and training stop at, so a benchmark or a training sample ends where a served reply
    would. None without a tokenizer (the random targets of tests and benchmarks)."""
    if tokenizer is None:
        return ()
    ids: list[int] = []
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id,
                   tokenizer.get_vocab().get("<|im_end|>")):
        if source is None:
            continue
        ids.extend(source if isinstance(source, (list, tuple)) else [source])
    return tuple(dict.fromkeys(int(i) for i in ids))


# ----------------------------------------------------------------------------------------------------------------------
# Streaming output
# ----------------------------------------------------------------------------------------------------------------------

class IncrementalDetokenizer:
    """Token ids in, text deltas out, never emitting half a UTF-8 character.

    Decodes a short window of recent tokens (so tokenizers that drop a leading space when decoding from a word start
    still get spaces right) and holds text back while it ends in U+FFFD, i.e. while a multi-byte character is split
    across tokens.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(int(i) for i in new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (a truly invalid byte sequence comes out as U+FFFD here)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text):]


def _partial_suffix(text: str, needles) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `needles`."""
    best = 0
    for needle in needles:
        for size in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:size]):
                best = size
                break
    return best


class StopStrings:
    """Cuts output at the earliest stop string; the stop text itself is never emitted."""

    def __init__(self, stops: list[str] | None):
        self.stops = [s for s in (stops or []) if s]
        self.pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            index, stop = min(hits)
            self.matched = stop
            out, self.pending = self.pending[:index], ""
            return out
        keep = _partial_suffix(self.pending, self.stops)
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        return out


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI's API carries it


@dataclass
class Event:
    kind: str  # "reasoning" | "content" | "tool_call"
    text: str = ""
    tool_call: ToolCall | None = None


def _schema_types(tools: list[dict] | None) -> dict[str, dict[str, str]]:
    """{function name: {parameter: JSON-schema type}} so XML parameter values can be typed."""
    out = {}
    for tool in tools or []:
        function = tool.get("function", tool)
        properties = ((function.get("parameters") or {}).get("properties") or {})
        out[function.get("name", "")] = {
            name: (spec.get("type") if isinstance(spec, dict) else None) for name, spec in properties.items()
        }
    return out


def _xml_value(raw: str, kind) -> object:
    # Qwen writes each value on its own line(s): drop exactly the newline that follows/precedes the tags.
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def parse_tool_block(body: str, tools: list[dict] | None = None) -> list[ToolCall] | None:
    """Parse what sat between `<tool_call>` and `</tool_call>`: XML (Qwen3.5) or JSON (Hermes; SmolLM2 writes a
    JSON list). None when it is neither, so the caller can keep the raw text instead of losing it."""
    body = body.strip()
    if body.startswith("<function="):
        types = _schema_types(tools)
        calls = []
        for name, inner in _FUNCTION_RE.findall(body):
            name = name.strip()
            kinds = types.get(name, {})
            args = {p.strip(): _xml_value(v, kinds.get(p.strip())) for p, v in _PARAMETER_RE.findall(inner)}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls or None
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = data if isinstance(data, list) else [data]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


class OutputParser:
    """Splits generated text into reasoning, content and tool calls, incrementally.

    Whitespace is held until something follows it: whitespace at the start of a part, or followed by a tool call,
    a think tag or the end, is dropped, so answers carry no stray newlines around tool calls and reasoning.
    """

    def __init__(self, tools: list[dict] | None = None, in_reasoning: bool = False, parse_tools: bool = True):
        self.tools = tools
        self.parse_tools = parse_tools and bool(tools)
        self.mode = "reasoning" if in_reasoning else "content"
        self.buffer = ""
        self.held_space = ""
        self.started: set[str] = set()
        self.tool_calls: list[ToolCall] = []

    def _emit(self, kind: str, text: str) -> list[Event]:
        if not text:
            return []
        text = self.held_space + text
        stripped = text.rstrip()
        self.held_space = text[len(stripped):]
        if kind not in self.started:
            stripped = stripped.lstrip()
        if not stripped:
            return []
        self.started.add(kind)
        return [Event(kind, stripped)]

    def _content(self, text: str) -> list[Event]:
        return self._emit("content", text)

    def push(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while True:
            if self.mode == "reasoning":
                index = self.buffer.find(THINK_CLOSE)
                if index < 0:
                    keep = _partial_suffix(self.buffer, [THINK_CLOSE])
                    chunk, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    return events + self._emit("reasoning", chunk)
                events += self._emit("reasoning", self.buffer[:index])
                self.buffer = self.buffer[index + len(THINK_CLOSE):]
                self.mode, self.held_space = "content", ""
            elif self.mode == "tool":
                index = self.buffer.find(TOOL_CLOSE)
                if index < 0:
                    return events
                events += self._tool_block(self.buffer[:index], closed=True)
                self.buffer = self.buffer[index + len(TOOL_CLOSE):]
                self.mode = "content"
            else:
                tags = [THINK_OPEN] + ([TOOL_OPEN] if self.parse_tools else [])
                found = [(self.buffer.find(tag), tag) for tag in tags if tag in self.buffer]
                if not found:
                    keep = _partial_suffix(self.buffer, tags)
                    chunk, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    return events + self._content(chunk)
                index, tag = min(found)
                events += self._content(self.buffer[:index])
                self.buffer = self.buffer[index + len(tag):]
                self.held_space = ""
                self.mode = "reasoning" if tag == THINK_OPEN else "tool"

    def _tool_block(self, body: str, closed: bool) -> list[Event]:
        calls = parse_tool_block(body, self.tools)
        if calls is None:  # not a tool call after all: keep the model's text rather than drop it
            raw = TOOL_OPEN + body + (TOOL_CLOSE if closed else "")
            return self._content(raw)
        self.tool_calls += calls
        return [Event("tool_call", tool_call=call) for call in calls]

    def finish(self) -> list[Event]:
        """End of generation: whatever is buffered comes out (an unclosed tool call is still parsed)."""
        rest, self.buffer = self.buffer, ""
        if self.mode == "reasoning":
            return self._emit("reasoning", rest)
        if self.mode == "tool":
            return self._tool_block(rest, closed=False)
        return self._content(rest)


def merge_events(events: list[Event]) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, tool calls) for a non-streamed answer."""
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    return reasoning, content, [e.tool_call for e in events if e.kind == "tool_call"]
