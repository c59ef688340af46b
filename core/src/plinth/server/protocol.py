"""Pydantic models of every request and response the server speaks.

OpenAI's names and shapes (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``), Anthropic's (``/v1/messages``), and vLLM's for the extras
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``/tokenize``).
Unknown request fields are ignored, as OpenAI's and vLLM's servers do, so
newer clients keep working; a known field of the wrong type is a 400.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    JsonValue,
    PlainValidator,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

from plinth.engine.sampling_params import BOUNDS, SamplingParams, check_option
from plinth.errors import RequestError

#: a JSON object as the client sent it (a schema, tool arguments, metadata)
JSONObject = dict[str, JsonValue]


def _whole(value: object) -> object:
    """5.0 as 5: JSON Schema's integers include whole floats (strict mode would refuse them)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: an integer as JSON Schema has it: 5 or 5.0, never "5", true or 5.5
Int = Annotated[int, BeforeValidator(_whole)]
#: a token id (the document bounds it by the vocabulary, server/openapi.py)
TokenId = Annotated[int, Field(ge=0), BeforeValidator(_whole)]


class Bounded:
    """A field's bound, as ``SamplingParams`` states and checks it
    (``BOUNDS[name]``), written into the field's JSON Schema: the document
    says exactly what ``SamplingParams`` refuses. ``Annotated[int, Bounded("n")]``."""

    def __init__(self, name: str) -> None:
        self.bound = BOUNDS[name]

    def __get_pydantic_json_schema__(self, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        schema = handler(core_schema)
        # of ``T | None``, the branch that is a number
        target = next((b for b in schema.get("anyOf", []) if b.get("type") in ("integer", "number")), schema)
        target.update(self.bound.json_schema())
        return schema


class _Request(BaseModel):
    """A request body. Strict: a field takes only its JSON type (no "5" for 5,
    no false for 0), so what validates is what the document describes.
    Unknown fields are ignored, as OpenAI's and vLLM's servers do."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


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


#: OpenAI's logit_bias: {"token id": bias}; the document's key pattern is narrowed to the vocabulary (server/openapi.py)
TOKEN_ID_KEY = r"^(0|[1-9][0-9]{0,8})$"
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=TOKEN_ID_KEY)], float],
    WithJsonSchema(
        {
            "type": "object",
            "propertyNames": {"pattern": TOKEN_ID_KEY},
            "additionalProperties": {"type": "number", **BOUNDS["logit_bias"].json_schema()},
        }
    ),
]


@contextlib.contextmanager
def named_as(aliases: dict[str, str]) -> Iterator[None]:
    """``SamplingParams``' errors under the request's own field names
    (``max_completion_tokens`` for max_tokens, ``top_logprobs`` for logprobs)."""
    try:
        yield
    except RequestError as exc:
        param = exc.param or ""
        if param not in aliases:
            raise
        message = str(exc)
        raise RequestError(aliases[param] + message[len(param) :] if message.startswith(param) else message, param=aliases[param], code=exc.code) from None


_NULL: JsonSchemaValue = {"type": "null"}
#: a format field that asks for free text (null, or a format of type "text")
FREE_TEXT: JsonSchemaValue = {"anyOf": [_NULL, {"type": "object", "properties": {"type": {"enum": [None, "text"]}}}]}


def forced_call_rules(forcing: JsonSchemaValue, free_text: dict[str, JsonSchemaValue]) -> JsonSchemaValue:
    """The document's rules for a tool_choice matching ``forcing`` (one that
    forces a call), which ``tools.plan_tools`` and ``ServingContext.grammar``
    enforce: it comes with tools, and with no structured output (the call's
    grammar is the output's): each field of ``free_text`` as given there."""
    return {
        "if": {"required": ["tool_choice"], "properties": {"tool_choice": forcing}},
        "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}, **free_text}},
    }


#: OpenAI's tool_choice values that force a call: "required", or a named function
OPENAI_FORCING: JsonSchemaValue = {"anyOf": [{"const": "required"}, {"type": "object"}]}


def token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """logit_bias with its keys as token ids (the pattern made them digits)."""
    return {int(k): v for k, v in bias.items()} if bias else None


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


class SamplingFields(_Request):
    """Sampling options shared by completions and chat (vLLM's extras included).
    The bounds are ``SamplingParams``' (``Bounded``): it checks them when a
    request makes its ``SamplingParams``; here they are only published."""

    temperature: Annotated[float | None, Bounded("temperature")] = None
    top_p: Annotated[float | None, Bounded("top_p")] = None
    top_k: Annotated[Int | None, Bounded("top_k")] = Field(None, description="-1 (off) or >= 1")
    min_p: Annotated[float | None, Bounded("min_p")] = None
    n: Annotated[Int, Bounded("n")] = 1
    seed: Annotated[Int | None, Bounded("seed")] = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[Int, Bounded("stop_token_ids")]] | None = None
    presence_penalty: Annotated[float | None, Bounded("presence_penalty")] = None
    frequency_penalty: Annotated[float | None, Bounded("frequency_penalty")] = None
    repetition_penalty: Annotated[float | None, Bounded("repetition_penalty")] = None
    ignore_eos: bool = False
    min_tokens: Annotated[Int, Bounded("min_tokens")] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    #: vLLM's guided decoding extras
    guided_json: JSONObject | None = None
    guided_regex: Annotated[str, Field(min_length=1)] | None = None
    response_format: JSONObject | None = None
    logit_bias: LogitBias | None = None

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None, *, aliases: dict[str, str] | None = None
    ) -> SamplingParams:
        """The request's ``SamplingParams`` (which checks every bound, errors
        under the request's names: ``aliases``); options left out keep the
        sampler's defaults."""
        with named_as(aliases or {}):
            return self._make(max_tokens, logprobs, prompt_logprobs)

    def _make(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            n=self.n,
            seed=self.seed,
            stop=stop_list(self.stop),
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=token_bias(self.logit_bias),
            **SamplingParams.given(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
            ),
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


def _nonempty(items: JsonSchemaValue) -> JsonSchemaValue:
    return {"type": "array", "items": items, "minItems": 1}


def _token_ids(value: object, where: str) -> list[int]:
    if not isinstance(value, list) or not value:
        template = "{where} is empty" if value == [] else "{where} must be token ids"
        raise PydanticCustomError("invalid_value", template, {"where": where})
    ids = [_whole(t) for t in value]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise PydanticCustomError("invalid_type", "{where}: token ids are integers, got {t}", {"where": where, "t": repr(t)})
        if t < 0:
            raise PydanticCustomError("invalid_value", "{where}: token id {t} is negative", {"where": where, "t": t})
    return ids  # type: ignore[return-value]


def check_prompt(value: object) -> str | list[str] | list[int] | list[list[int]]:
    """A completion's prompt: text, a batch of texts, token ids, or a batch of
    those; never empty (the document states the same, ``PROMPT_SCHEMA``)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("invalid_type", "prompt must be a string, a list of strings, or token ids (or a list of those)")
    if not value:
        raise PydanticCustomError("invalid_value", "prompt must not be empty")
    if all(isinstance(p, str) for p in value):
        return value
    if isinstance(value[0], list):
        return [_token_ids(p, f"prompt {i}") for i, p in enumerate(value)]
    return _token_ids(value, "prompt")


PROMPT_SCHEMA = {"anyOf": [{"type": "string"}, _nonempty({"type": "string"}), _nonempty(_TOKEN_ID), _nonempty(_nonempty(_TOKEN_ID))]}


class CompletionRequest(SamplingFields):
    model: str | None = None
    #: a prompt (text or token ids), or a batch of them; the engine checks the ids against the vocabulary
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], PlainValidator(check_prompt), WithJsonSchema(PROMPT_SCHEMA)]
    max_tokens: Annotated[Int | None, Bounded("max_tokens")] = 16
    logprobs: Annotated[Int | None, Bounded("logprobs")] = None
    echo: bool = False
    #: plinth returns every sample, it picks no best: best_of is 1 or absent
    best_of: Literal[1] | None = None
    #: no insertion after the prompt: suffix is empty or absent
    suffix: Literal[""] | None = None

    def sampling_params(self) -> SamplingParams:
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(self.max_tokens, self.logprobs, echoed)

    def prompts(self) -> list[str | list[int]]:
        """One engine request per prompt: a string, or token ids."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


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
    parameters: JSONObject | None = None
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
    model_config = ConfigDict(
        json_schema_extra={
            # the two rules the validator below checks
            "allOf": [
                {
                    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
                    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
                },
                {
                    "if": {"required": ["continue_final_message"], "properties": {"continue_final_message": {"const": True}}},
                    "then": {"required": ["add_generation_prompt"], "properties": {"add_generation_prompt": {"const": False}}},
                },
                forced_call_rules(OPENAI_FORCING, {"response_format": FREE_TEXT, "guided_json": _NULL, "guided_regex": _NULL}),
            ]
        }
    )

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[Int | None, Bounded("max_tokens")] = None
    max_completion_tokens: Annotated[Int | None, Bounded("max_tokens")] = None
    logprobs: bool = False
    top_logprobs: Annotated[Int | None, Bounded("logprobs")] = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    #: vLLM's chat-template extras: continue_final_message renders the last
    #: message open (the model continues it, as transformers' option does)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: JSONObject | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "top_logprobs needs logprobs to be true")
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _continue_without_generation_prompt(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt", True):
            raise PydanticCustomError(
                "invalid_value", "continue_final_message needs add_generation_prompt to be false (the answer continues the last message)"
            )
        return v

    def sampling_params(self) -> SamplingParams:
        """max_completion_tokens (OpenAI's newer name) wins over max_tokens; both are checked."""
        aliases = {"logprobs": "top_logprobs"}
        max_tokens = self.max_tokens
        if self.max_completion_tokens is not None:
            check_option("max_tokens", self.max_tokens)
            max_tokens, aliases["max_tokens"] = self.max_completion_tokens, "max_completion_tokens"
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, aliases=aliases)


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
    tool_calls: list[JSONObject] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
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


class TextBlock(_Request):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Request):
    """A call the assistant made (sent back in the conversation)."""

    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: JSONObject


class ToolResultBlock(_Request):
    """What a call returned."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content or [])
        return f"error: {body}" if self.is_error else body


class ThinkingBlock(_Request):
    """Earlier thinking: accepted and left out of the prompt."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: str


#: the content blocks the server reads (text only: no images or documents)
ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


class AnthropicMessage(_Request):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class AnthropicTextBlock(_Response):
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
    input: JSONObject = Field(default_factory=dict)


AnthropicOutputBlock = AnthropicTextBlock | AnthropicThinkingBlock | AnthropicToolUseBlock


class AnthropicTool(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: JSONObject | None = None
    type: Literal["custom"] | None = None


class _ToolChoice(_Request):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAuto(_ToolChoice):
    type: Literal["auto"]


class ToolChoiceAny(_ToolChoice):
    """At least one call, of any tool."""

    type: Literal["any"]


class ToolChoiceTool(_ToolChoice):
    """A call of the tool named."""

    type: Literal["tool"]
    name: str


class ToolChoiceNone(_Request):
    type: Literal["none"]


AnthropicToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(_Request):
    type: Literal["enabled"]
    budget_tokens: Int | None = None


class ThinkingDisabled(_Request):
    """Reasoning is left in the text (the chat template decides whether the model thinks)."""

    type: Literal["disabled"]


class JSONSchemaOutput(_Request):
    """Anthropic's structured output: the answer is JSON that ``schema`` accepts."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True, populate_by_name=True)
    type: Literal["json_schema"]
    schema_: JSONObject = Field(alias="schema")


class OutputConfig(_Request):
    format: JSONSchemaOutput | None = None


class MessagesRequest(_Request):
    model_config = ConfigDict(
        extra="ignore",
        protected_namespaces=(),
        strict=True,
        json_schema_extra=forced_call_rules(
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["any", "tool"]}}},
            {"output_format": _NULL, "output_config": {"anyOf": [_NULL, {"type": "object", "properties": {"format": _NULL}}]}},
        ),
    )

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: Annotated[Int, Bounded("max_tokens")]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    temperature: Annotated[float | None, Bounded("temperature")] = None
    top_p: Annotated[float | None, Bounded("top_p")] = None
    top_k: Annotated[Int | None, Bounded("top_k")] = Field(None, description="-1 (off) or >= 1")
    metadata: JSONObject | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Annotated[ThinkingEnabled | ThinkingDisabled, Field(discriminator="type")] | None = None
    #: structured outputs (output_format: the beta's name of output_config.format)
    output_config: OutputConfig | None = None
    output_format: JSONSchemaOutput | None = None

    def sampling_params(self) -> SamplingParams:
        given = SamplingParams.given(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        return SamplingParams(max_tokens=self.max_tokens, stop=list(self.stop_sequences or []), **given)


class CountTokensRequest(_Request):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
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
    """Either ``messages`` (through the chat template) or ``prompt`` (a string)."""

    model_config = ConfigDict(
        extra="ignore",
        protected_namespaces=(),
        strict=True,
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

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if not self.messages and self.prompt is None:
            raise ValueError("give either prompt or messages (a non-empty list)")
        return self


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str
    plugin_api: str | None = None
    models: list[str]
    engine: JSONObject = Field(default_factory=dict)


class HealthResponse(_Response):
    status: str
