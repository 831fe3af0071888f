"""Request models of the four APIs (pydantic): what /openapi.json publishes and what every body is
validated against before any work. Unknown fields are accepted and ignored, as clients send many
(user, metadata, store, cache_control...); every known field is checked by type and range, down to
content parts and tool schemas, so a wrong value is a 400 naming the field, never a failure deep
inside generation. Token ids are checked against the model's vocabulary, passed as the validation
context {"vocab_size": V} (body.validate).

Nested shapes that the routes read as plain dicts are validated by a model, then handed on as the
dict the client sent (`AsDict`). max_tokens beyond what the context leaves is refused with OpenAI's
context_length_exceeded (as OpenAI and vLLM do), not clamped; no max_tokens means "what is left"
(or --default-max-tokens)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, ValidationInfo

# Reserved by the server's own chat-template call: a client's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt")  # chat_template: its own check
INT64 = 2**63 - 1


class Lenient(BaseModel):
    # strict: "5" is no integer and true no number (as OpenAI answers them), whatever Python would coerce
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


def _dump(value: BaseModel) -> dict:
    return value.model_dump(exclude_unset=True, by_alias=True)


class _AsDict:
    """AsDict[Model]: validated as Model (and published as its schema), passed on as a dict."""

    def __class_getitem__(cls, model):
        return Annotated[model, AfterValidator(_dump), PlainSerializer(lambda d: d)]


AsDict = _AsDict


def _in_vocab(ids: list[int], info: ValidationInfo) -> list[int]:
    vocab = (info.context or {}).get("vocab_size")
    if vocab is not None:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary (0..{vocab - 1})")
    return ids


def _bias_in_vocab(bias: dict[str, float], info: ValidationInfo) -> dict[str, float]:
    for key in bias:
        if not key.isdigit():  # isdigit: no sign, no spaces (int() would take " 5" and "-1")
            raise ValueError(f"logit_bias keys are token ids (digits), not {key!r}")
        _in_vocab([int(key)], info)
    return bias


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT64)]], AfterValidator(_in_vocab)]
Bias = Annotated[float, Field(ge=-100, le=100)]
StopString = Annotated[str, Field(min_length=1)]


# ---------------------------------------------------------------- tools (shared shapes)
def _schema_shape(schema: dict) -> dict:
    """A tool's parameters: a JSON schema object whose properties / required have their JSON-schema types."""
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise ValueError("properties must be an object mapping parameter names to schemas")
        for name, sub in props.items():
            if not isinstance(sub, (dict, bool)):
                raise ValueError(f"properties.{name} must be a JSON schema (an object)")
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise ValueError("required must be a list of parameter names")
    kind = schema.get("type")
    if kind is not None and not isinstance(kind, (str, list)):
        raise ValueError("type must be a string or a list of strings")
    return schema


ToolParameters = Annotated[dict[str, Any], AfterValidator(_schema_shape)]


# ---------------------------------------------------------------- OpenAI Chat Completions
class FunctionDef(Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: ToolParameters | None = None
    strict: bool | None = None


class ChatTool(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class ContentPart(Lenient):
    """One part of a message's content; the route accepts text kinds and names any other it refuses."""
    type: str
    text: str | None = None
    refusal: str | None = None


class FunctionCall(Lenient):
    name: str
    arguments: Union[str, dict[str, Any], None] = None


class ToolCall(Lenient):
    id: str | None = None
    type: str = "function"
    function: AsDict[FunctionCall]


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[AsDict[ContentPart]], None] = None
    name: str | None = None
    tool_calls: list[AsDict[ToolCall]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class StreamOptions(Lenient):
    include_usage: bool = False


class NamedFunction(Lenient):
    name: str


class ChatToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: AsDict[NamedFunction]


class JSONSchemaSpec(Lenient):
    name: str | None = None
    schema_: Union[dict[str, Any], bool, None] = Field(None, alias="schema")
    strict: bool | None = None
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True, populate_by_name=True)


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: AsDict[JSONSchemaSpec] | None = None


class SamplingFields(Lenient):
    """Sampling knobs shared by the OpenAI endpoints (vLLM's extras included), in SamplingParams' ranges."""
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT64)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Union[StopString, list[StopString], None] = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64)
    logit_bias: Annotated[dict[str, Bias], AfterValidator(_bias_in_vocab)] | None = None
    n: int = Field(1, ge=1, le=INT64)
    prefill_keep_ratio: float | None = Field(None, gt=0, le=1)  # PFlash speculative prefill (lossy)
    kv_pool: bool | None = None  # KVFlash: pool this request's KV (lossy); None: the server's --kv-pool-target


def _template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    clash = [k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS]
    if clash:
        raise ValueError(f"{clash[0]!r} is set by the server and cannot be passed to the chat template")
    return kwargs


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT64)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=INT64)
    tools: list[ChatTool] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], AsDict[ChatToolChoice], None] = None
    parallel_tool_calls: bool = True
    response_format: AsDict[ResponseFormat] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: Annotated[dict[str, Any], AfterValidator(_template_kwargs)] | None = None


# ---------------------------------------------------------------- OpenAI Completions (legacy)
class CompletionRequest(SamplingFields):
    model: str | None = None
    # A string, token ids, or a list holding one string (batches are refused by the route, naming why).
    prompt: Union[str, TokenIds, list[str]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(16, ge=1, le=INT64)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=INT64)
    suffix: str | None = None


# ---------------------------------------------------------------- OpenAI Responses
class ResponsesPart(Lenient):
    type: str | None = None
    text: str | None = None
    refusal: str | None = None


ResponsesContent = Union[str, list[AsDict[ResponsesPart]], None]


class ResponsesItem(Lenient):
    """One input item: a message, a (custom) tool call or its output, or reasoning; other kinds pass."""
    type: str | None = None
    role: str | None = None
    content: ResponsesContent = None
    name: str | None = None
    arguments: Union[str, dict[str, Any], None] = None
    call_id: str | None = None
    input: str | None = None
    output: ResponsesContent = None
    summary: list[AsDict[ResponsesPart]] | None = None


class ResponsesTool(Lenient):
    """function and custom tools are offered to the model; hosted kinds (web_search...) are not."""
    type: str
    name: str | None = Field(None, min_length=1)
    description: str | None = None
    parameters: ToolParameters | None = None


class ResponsesToolChoice(Lenient):
    type: str | None = None
    name: str | None = None


class ReasoningConfig(Lenient):
    effort: str | None = None
    summary: str | None = None


class ResponsesFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: Union[dict[str, Any], bool, None] = Field(None, alias="schema")
    strict: bool | None = None
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True, populate_by_name=True)


class TextConfig(Lenient):
    format: AsDict[ResponsesFormat] | None = None


class ResponsesRequest(Lenient):
    model: str | None = None
    input: Union[str, list[AsDict[ResponsesItem]]]
    instructions: str | None = None
    tools: list[AsDict[ResponsesTool]] | None = None
    tool_choice: Union[str, AsDict[ResponsesToolChoice], None] = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    reasoning: AsDict[ReasoningConfig] | None = None
    text: AsDict[TextConfig] | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None
    prefill_keep_ratio: float | None = Field(None, gt=0, le=1)
    kv_pool: bool | None = None


# ---------------------------------------------------------------- Anthropic Messages
class AnthropicTool(Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: ToolParameters | None = None
    type: str | None = None


class AnthropicBlock(Lenient):
    """One content block; which kinds a role may send is the route's business (it names the block)."""
    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: Union[str, list[AsDict[AnthropicBlock]], None] = None
    is_error: bool | None = None


class AnthropicMessage(Lenient):
    # "system" inside messages: Claude Code's mid-conversation system turns (beta header
    # mid-conversation-system-2026-04-07)
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[AsDict[AnthropicBlock]]]


class AnthropicToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Lenient):
    type: str
    budget_tokens: int | None = Field(None, ge=0, le=INT64)


class CountTokensRequest(Lenient):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[AsDict[AnthropicBlock]], None] = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AsDict[AnthropicToolChoice] | None = None
    thinking: AsDict[ThinkingConfig] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT64)
    stop_sequences: list[StopString] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT64)
    prefill_keep_ratio: float | None = Field(None, gt=0, le=1)
    kv_pool: bool | None = None


REQUEST_MODELS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                  "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest,
                  "/v1/messages/count_tokens": CountTokensRequest}
