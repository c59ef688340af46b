"""Pydantic models of every request and response the server speaks.

OpenAI's names and shapes (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``), Anthropic's (``/v1/messages``), and vLLM's for the extras
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``/tokenize``).
Unknown request fields are ignored, as OpenAI's and vLLM's servers do, so
newer clients keep working; a known field of the wrong type is a 400.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_serializer

MAX_N = 128
MAX_LOGPROBS = 20
#: the sampler computes in float32: larger numbers would become inf there
FLOAT32_MAX = 3.0e38
#: seeds seed torch generators (64 bits); n > 1 seeds sample i with seed + i
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - MAX_N


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class _Response(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


# --------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class SamplingFields(_Request):
    """Sampling options shared by completions and chat (vLLM's extras included)."""

    # the bounds are the sampler's (SamplingParams.validate), stated here so the API document has them
    temperature: float | None = Field(None, ge=0, le=FLOAT32_MAX)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, json_schema_extra={"not": {"const": 0}}, description="-1 (off) or >= 1")
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=FLOAT32_MAX)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    #: vLLM's guided decoding extras
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    response_format: dict[str, Any] | None = None

    def sampling_kwargs(self, stop: list[str]) -> dict[str, Any]:
        """The SamplingParams fields both APIs take as they are."""
        return dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
            n=self.n,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


# --------------------------------------------------------------------------
# /v1/models
# --------------------------------------------------------------------------


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "plinth"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --------------------------------------------------------------------------
# /v1/completions
# --------------------------------------------------------------------------


_TOKEN_ID = {"type": "integer", "minimum": 0}


def _nonempty(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1}


#: OpenAI's logit_bias: {"token id": bias}
LogitBias = dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100)]]


class CompletionRequest(SamplingFields):
    model: str | None = None
    #: the route checks emptiness and the vocabulary, with messages that say which prompt; the document states it
    prompt: Annotated[
        str | list[str] | list[int] | list[list[int]],
        WithJsonSchema({"anyOf": [{"type": "string"}, _nonempty({"type": "string"}), _nonempty(_TOKEN_ID), _nonempty(_nonempty(_TOKEN_ID))]}),
    ]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    #: accepted only equal to n, and suffix only empty (the route says why): documented as absent
    best_of: Annotated[int | None, WithJsonSchema({"type": "null"})] = None
    suffix: Annotated[str | None, WithJsonSchema({"type": "null"})] = None
    logit_bias: LogitBias | None = None


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionStreamResponse(CompletionResponse):
    """One SSE chunk of a streamed completion (OpenAI uses the same object name)."""


# --------------------------------------------------------------------------
# /v1/chat/completions
# --------------------------------------------------------------------------


class ContentPart(_Request):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "input_text", "output_text"]  # text only
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str = "{}"


class ToolCall(_Request):
    """A tool call, in a response or in an assistant message sent back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    #: an assistant's earlier calls, and a tool message's answer to one of them
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logit_bias: LogitBias | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    #: vLLM's chat-template extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    #: the reasoning, split from the answer by the reasoning parser (vLLM's name)
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionChoice]
    usage: Usage


class DeltaMessage(_Response):
    """A chunk's delta: fields left unset are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    #: pieces of tool calls: {"index", "id", "type", "function": {"name", "arguments"}},
    #: id, type and name on a call's first piece only
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionStreamChoice]
    usage: Usage | None = None


# --------------------------------------------------------------------------
# /v1/messages (Anthropic)
# --------------------------------------------------------------------------


class AnthropicContentBlock(_Request):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    content: str | list[dict[str, Any]] | None = None  # tool_result


def _block(kind: str, required: list[str], **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": ["type", *required], "properties": {"type": {"const": kind}, **props}}


_STR = {"type": "string"}
#: the blocks the route reads (anthropic_api.anthropic_messages checks them, naming the block at fault)
ANTHROPIC_BLOCKS = {
    "oneOf": [
        _block("text", ["text"], text=_STR),
        _block("tool_use", ["id", "name", "input"], id=_STR, name={"type": "string", "minLength": 1}, input={"type": "object"}),
        _block(
            "tool_result",
            ["tool_use_id"],
            tool_use_id=_STR,
            content={"anyOf": [_STR, {"type": "array", "items": _block("text", ["text"], text=_STR)}]},
            is_error={"type": "boolean"},
        ),
        _block("thinking", ["thinking"], thinking=_STR, signature=_STR),
        _block("redacted_thinking", ["data"], data=_STR),
    ]
}


#: Anthropic's structured-output format (the only one the route takes)
_JSON_SCHEMA_FORMAT = _block("json_schema", ["schema"], schema={"type": "object"})


class AnthropicMessage(_Request):
    role: Literal["user", "assistant", "system"]
    content: Annotated[
        str | list[AnthropicContentBlock],
        WithJsonSchema({"anyOf": [_STR, {"type": "array", "items": ANTHROPIC_BLOCKS}]}),
    ]


class AnthropicTextBlock(_Request):
    type: Literal["text"] = "text"
    text: str


class AnthropicThinkingBlock(_Response):
    type: Literal["thinking"] = "thinking"
    thinking: str
    #: Anthropic signs its thinking; a local model's is unsigned
    signature: str = ""


class AnthropicToolUseBlock(_Response):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


AnthropicOutputBlock = AnthropicTextBlock | AnthropicThinkingBlock | AnthropicToolUseBlock


class AnthropicTool(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: Literal["custom"] | None = None


class AnthropicToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Request):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[AnthropicTextBlock] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=FLOAT32_MAX)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, json_schema_extra={"not": {"const": 0}}, description="-1 (off) or >= 1")
    metadata: dict[str, Any] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    #: {"type": "enabled", "budget_tokens": N} | {"type": "disabled"}: with "disabled"
    #: reasoning is left in the text (the template decides whether the model thinks)
    thinking: dict[str, Any] | None = None
    #: structured outputs: {"format": {"type": "json_schema", "schema": {...}}}
    output_config: Annotated[dict[str, Any] | None, WithJsonSchema({"anyOf": [{"type": "object", "properties": {"format": _JSON_SCHEMA_FORMAT}}, {"type": "null"}]})] = None
    output_format: Annotated[dict[str, Any] | None, WithJsonSchema({"anyOf": [_JSON_SCHEMA_FORMAT, {"type": "null"}]})] = None


class CountTokensRequest(_Request):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicTextBlock] | None = None
    tools: list[AnthropicTool] | None = None


class CountTokensResponse(_Response):
    input_tokens: int


class AnthropicUsage(_Response):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int | None = 0
    cache_read_input_tokens: int | None = 0


class MessagesResponse(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[AnthropicOutputBlock]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class MessageStartEvent(_Response):
    type: Literal["message_start"] = "message_start"
    message: MessagesResponse


class ContentBlockStartEvent(_Response):
    type: Literal["content_block_start"] = "content_block_start"
    index: int = 0
    content_block: AnthropicOutputBlock


class PingEvent(_Response):
    type: Literal["ping"] = "ping"


class TextDelta(_Response):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(_Response):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(_Response):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str = ""


class InputJSONDelta(_Response):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(_Response):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int = 0
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJSONDelta


class ContentBlockStopEvent(_Response):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int = 0


class MessageDelta(_Response):
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None


class MessageDeltaUsage(_Response):
    output_tokens: int


class MessageDeltaEvent(_Response):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(_Response):
    type: Literal["message_stop"] = "message_stop"


# --------------------------------------------------------------------------
# /tokenize, /detokenize, /version, /health
# --------------------------------------------------------------------------


class TokenizeRequest(_Request):
    """Either ``prompt`` (a string) or ``messages`` (through the chat template)."""

    model_config = ConfigDict(
        extra="ignore",
        protected_namespaces=(),
        json_schema_extra={
            "anyOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array", "minItems": 1}}},
            ]
        },
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str
    plugin_api: str | None = None
    models: list[str]
    engine: dict[str, Any] = Field(default_factory=dict)


class HealthResponse(_Response):
    status: str
