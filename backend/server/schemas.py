"""Request bodies of the HTTP API as pydantic models, so validation is declarative and /openapi.json is real.

Unknown fields are ignored (SDKs send many we do not use: frequency_penalty, metadata, cache_control, ...); known
fields are checked for type and range. What depends on the loaded model (context length, model id) is checked in
app.py.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

TOOL_NAME = r"^[A-Za-z0-9_.:\-]{1,128}$"
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
StopList = Annotated[list[str], Field(max_length=16)]


class Lenient(BaseModel):
    # Python's json module reads NaN and Infinity (JSON has neither); a NaN temperature then failed "<= 2" and was
    # refused as too large. Refused here as what it is.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def check_parameters_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tool's parameters must be a JSON-schema object description: the templates and parsers rely on it."""
    if schema is None:
        return None
    if schema.get("type", "object") != "object":
        raise ValueError("a tool's parameters must be a JSON schema with \"type\": \"object\"")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(v, dict) for v in properties.values()):
        raise ValueError("a tool schema's \"properties\" must map each parameter name to a schema object")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError("a tool schema's \"required\" must be a list of parameter names")
    return schema


# ---- OpenAI ----------------------------------------------------------------------------------------------------------

class TextPart(Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(Lenient):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value):
        return check_parameters_schema(value)


class ToolDef(Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Lenient):
    include_usage: bool = False


class SamplingFields(Lenient):
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: Seed | None = None
    stop: str | StopList | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1, description="only 1 is supported (batch 1 by design)")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra chat-template variables (vLLM's name), e.g. {\"enable_thinking\": false}")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] = Field(description="a string, a list of one string, or token ids")
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False


# ---- Anthropic -------------------------------------------------------------------------------------------------------

class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False


class ThinkingBlock(Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock], Field(discriminator="type")]


class AnthropicMessage(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(Lenient):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value):
        return check_parameters_schema(value)


class AnthropicToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class ThinkingConfig(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]


class MessagesRequest(Lenient):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="accepted and ignored")
    stop_sequences: StopList | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = Field(None, description="type \"disabled\" turns the template's thinking off")


class CountTokensRequest(Lenient):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
