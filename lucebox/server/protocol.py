"""Request models of the four APIs (pydantic). Unknown fields are accepted and ignored, as clients
send many (user, metadata, store, cache_control...); known fields are type-checked, so a wrong type
is a 400 naming the field rather than a failure deep inside generation."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------- OpenAI Chat Completions
class FunctionDef(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Lenient):
    type: str = "function"
    function: FunctionDef


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class StreamOptions(Lenient):
    include_usage: bool = False


class SamplingFields(Lenient):
    """Sampling knobs shared by the OpenAI endpoints (vLLM's extras included)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    n: int = 1


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---------------------------------------------------------------- OpenAI Completions (legacy)
class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: Union[str, list[str], list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


# ---------------------------------------------------------------- OpenAI Responses
class ResponsesRequest(Lenient):
    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None


# ---------------------------------------------------------------- Anthropic Messages
class AnthropicTool(Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class AnthropicMessage(Lenient):
    # "system" inside messages: Claude Code's mid-conversation system turns (beta header
    # mid-conversation-system-2026-04-07)
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[dict[str, Any]]]


class MessagesRequest(Lenient):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int
    system: Union[str, list[dict[str, Any]], None] = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class CountTokensRequest(Lenient):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[AnthropicTool] | None = None
    thinking: dict[str, Any] | None = None
