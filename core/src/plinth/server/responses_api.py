"""The OpenAI Responses API: POST /v1/responses, stateless.

Input is a string or a list of items (messages, ``function_call`` and
``function_call_output`` items, reasoning items, which are dropped);
``instructions`` become the leading system message. Nothing is stored:
``previous_response_id`` is a 400 and ``store`` is answered as false.
Tools are function tools; ``text.format`` is structured output. The
answer's output items are reasoning, a message with ``output_text``, and
``function_call`` items, in that order; streamed, as the Responses events.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ConfigDict, Discriminator, Field, JsonValue, Tag, WithJsonSchema

from plinth.engine.sampling_params import SamplingParams
from plinth.server.errors import APIError
from plinth.server.generation import Done, Event, Failed, GenerationPipeline, GenerationSpec, Result, Started, Usage
from plinth.server.protocol import (
    FREE_TEXT,
    OPENAI_FORCING,
    Bounded,
    Int,
    JSONObject,
    _Request,
    _Response,
    forced_call_rules,
)
from plinth.server.serving import (
    STREAM_RESPONSE,
    ServingContext,
    TemplateMessage,
    TemplateToolCall,
    now_s,
    random_id,
    sse_event,
    with_calls,
)
from plinth.server.tools import ToolPlan, arguments_object, make_tools, plan_tools


class TextPart(_Request):
    """A text content part (``input_text`` in, ``output_text`` of an earlier answer sent back)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Request):
    """A call the model made earlier (as the answer gave it)."""

    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    """What a call returned."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Request):
    """Earlier reasoning: accepted and left out of the prompt."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[JSONObject] = Field(default_factory=list)
    content: list[JSONObject] | None = None
    encrypted_content: str | None = None


def _item_kind(v: object) -> str | None:
    # a message may leave out its type (OpenAI's "easy input message")
    if isinstance(v, dict):
        return v.get("type", "message")
    return getattr(v, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Request):
    type: Literal["function"]
    name: str


class PlainFormat(_Request):
    type: Literal["text", "json_object"]


class JSONSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["json_schema"]
    name: str = "output"
    schema_: JSONObject = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: PlainFormat | JSONSchemaFormat | None = Field(None, discriminator="type")


class ResponsesRequest(_Request):
    model_config = ConfigDict(
        extra="ignore",
        protected_namespaces=(),
        strict=True,
        json_schema_extra=forced_call_rules(OPENAI_FORCING, {"text": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"format": FREE_TEXT}}]}}),
    )

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Annotated[Int | None, Bounded("max_tokens")] = None
    temperature: Annotated[float | None, Bounded("temperature")] = None
    top_p: Annotated[float | None, Bounded("top_p")] = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None
    #: nothing is stored: a previous_response_id is refused (in the route, to say why)
    previous_response_id: Annotated[str | None, WithJsonSchema({"type": "null"})] = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: Annotated[Int | None, Bounded("seed")] = None

    def sampling_params(self) -> SamplingParams:
        given = SamplingParams.given(temperature=self.temperature, top_p=self.top_p)
        return SamplingParams(max_tokens=self.max_output_tokens, seed=self.seed, **given)


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[JSONObject]
    usage: JSONObject | None = None
    incomplete_details: dict[str, str] | None = None
    error: JSONObject | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[JSONObject] = Field(default_factory=list)
    tool_choice: str | JSONObject = "auto"
    parallel_tool_calls: bool = True
    text: JSONObject = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = False
    previous_response_id: str | None = None
    truncation: str = "disabled"


def _text_of(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def input_messages(req: ResponsesRequest, *, native_tool_calls: bool) -> list[TemplateMessage]:
    """The input items as the chat template expects them; consecutive
    function calls join one assistant message (``with_calls``)."""
    msgs: list[TemplateMessage] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        msgs.append({"role": "user", "content": req.input})
        return msgs
    calls: list[TemplateToolCall] = []  # the calls of the assistant turn being read
    for item in req.input:
        if isinstance(item, FunctionCallItem):
            args = arguments_object(item.arguments)
            calls.append({"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": args}})
            continue
        if calls:
            msgs.append(with_calls({"role": "assistant", "content": ""}, calls, native_tool_calls))
            calls = []
        if isinstance(item, MessageItem):
            msgs.append({"role": "system" if item.role == "developer" else item.role, "content": _text_of(item.content)})
        elif isinstance(item, FunctionCallOutputItem):
            msgs.append({"role": "tool", "tool_call_id": item.call_id, "content": _text_of(item.output)})
        # reasoning items are not shown to the model again
    if calls:
        msgs.append(with_calls({"role": "assistant", "content": ""}, calls, native_tool_calls))
    return msgs


def response_format(text: TextConfig | None) -> JSONObject | None:
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    if isinstance(fmt, JSONSchemaFormat):
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
    return {"type": fmt.type}


class ResponsesServing:
    def __init__(self, ctx: ServingContext, pipeline: GenerationPipeline) -> None:
        self.ctx = ctx
        self.pipeline = pipeline

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        if req.previous_response_id is not None:
            raise APIError.bad_request("this server keeps no responses (stateless): send the whole conversation as input", param="previous_response_id")
        tools = make_tools((t.name, t.description, t.parameters) for t in req.tools or [])
        tc = req.tool_choice
        mode, named = (tc, None) if not isinstance(tc, NamedFunctionChoice) else ("named", tc.name)
        plan = plan_tools(tools, mode, named, req.parallel_tool_calls is not False)
        spec = GenerationSpec(
            request_id=random_id("resp_"),
            messages=input_messages(req, native_tool_calls=ctx.native_tool_calls),
            prompt_param="input",
            params=req.sampling_params(),
            response_format=response_format(req.text),
            plan=plan,
        )
        run = await self.pipeline.start(spec)
        shell = self._shell(req, spec.request_id, model, plan)
        return await self.pipeline.respond(
            raw,
            run,
            stream=req.stream,
            renderer=lambda: _ResponseStream(shell),
            body=lambda result: self._body(shell, result),
        )

    @staticmethod
    def _shell(req: ResponsesRequest, rid: str, model: str, plan: ToolPlan) -> ResponseObject:
        return ResponseObject(
            id=rid,
            created_at=now_s(),
            status="in_progress",
            model=model,
            output=[],
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            tool_choice=_tool_choice(req.tool_choice, plan),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            text=req.text.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"format": {"type": "text"}},
            metadata=req.metadata or {},
        )

    @staticmethod
    def _body(shell: ResponseObject, result: Result) -> ResponseObject:
        c = result.choices[0]
        items: list[OutputItem] = []
        if c.reasoning:
            items.append(OutputItem("reasoning", c.reasoning))
        if c.content or not c.calls:
            items.append(OutputItem("message", c.content))
        for call in c.calls:
            items.append(OutputItem("function_call", call.arguments, name=call.name, call_id=call.id))
        return _finish(shell, result.usage, c.finish_reason, items)


_ID_PREFIX = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_"}


@dataclass
class OutputItem:
    """One item of the answer while it is written: a message, reasoning, or a function call."""

    kind: Literal["message", "reasoning", "function_call"]
    #: the message's or the reasoning's text, or the call's arguments (JSON text)
    text: str = ""
    name: str = ""
    call_id: str = ""
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or random_id(_ID_PREFIX[self.kind])

    def part(self) -> JSONObject:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def as_json(self, status: str = "completed", *, parts: bool = True) -> JSONObject:
        if self.kind == "message":
            return {"type": "message", "id": self.id, "status": status, "role": "assistant", "content": [self.part()] if parts else []}
        if self.kind == "reasoning":
            content: JsonValue = [{"type": "reasoning_text", "text": self.text}]
            return {"type": "reasoning", "id": self.id, "summary": [], "content": content, "status": status}
        return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name, "arguments": self.text, "status": status}


def _finish(shell: ResponseObject, usage: Usage, finish: str | None, items: list[OutputItem]) -> ResponseObject:
    out = shell.model_copy(deep=True)
    length = finish == "length"
    out.output = [item.as_json("incomplete" if length else "completed") for item in items]
    out.status = "incomplete" if length else "completed"
    if length:
        out.incomplete_details = {"reason": "max_output_tokens"}
    out.usage = {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }
    return out


class _ResponseStream:
    """The Responses events: created, in_progress, then per output item
    (reasoning, message, function_call) added / deltas / done, then completed
    or incomplete with the whole response."""

    def __init__(self, shell: ResponseObject) -> None:
        self.shell = shell
        self.seq = 0
        self.items: list[OutputItem] = []  # finished items, in order
        self.cur: OutputItem | None = None  # the open item
        self.finish: str | None = None

    def _ev(self, kind: str, **data: JsonValue) -> str:
        self.seq += 1
        return sse_event(kind, json.dumps({"type": kind, "sequence_number": self.seq - 1, **data}))

    def start(self) -> Iterable[str]:
        return [self._ev("response.created", response=self.shell.model_dump()), self._ev("response.in_progress", response=self.shell.model_dump())]

    def _close(self) -> list[str]:
        cur = self.cur
        if cur is None:
            return []
        idx = len(self.items)
        ev = []
        if cur.kind == "message":
            ev.append(self._ev("response.output_text.done", item_id=cur.id, output_index=idx, content_index=0, text=cur.text, logprobs=[]))
            ev.append(self._ev("response.content_part.done", item_id=cur.id, output_index=idx, content_index=0, part=cur.part()))
        elif cur.kind == "reasoning":
            ev.append(self._ev("response.reasoning_text.done", item_id=cur.id, output_index=idx, content_index=0, text=cur.text))
        else:
            ev.append(self._ev("response.function_call_arguments.done", item_id=cur.id, output_index=idx, name=cur.name, arguments=cur.text))
        ev.append(self._ev("response.output_item.done", output_index=idx, item=cur.as_json()))
        self.items.append(cur)
        self.cur = None
        return ev

    def _open(self, item: OutputItem) -> list[str]:
        ev = self._close()
        self.cur = item
        idx = len(self.items)
        ev.append(self._ev("response.output_item.added", output_index=idx, item=item.as_json("in_progress", parts=False)))
        if item.kind == "message":
            ev.append(self._ev("response.content_part.added", item_id=item.id, output_index=idx, content_index=0, part=item.part()))
        return ev

    def _write(self, kind: Literal["message", "reasoning"], text: str) -> list[str]:
        """Text added to the open message or reasoning (opened when another kind is open)."""
        out = [] if self.cur is not None and self.cur.kind == kind else self._open(OutputItem(kind))
        assert self.cur is not None
        self.cur.text += text
        idx = len(self.items)
        if kind == "reasoning":
            out.append(self._ev("response.reasoning_text.delta", item_id=self.cur.id, output_index=idx, content_index=0, delta=text))
        else:
            out.append(self._ev("response.output_text.delta", item_id=self.cur.id, output_index=idx, content_index=0, delta=text, logprobs=[]))
        return out

    def event(self, ev: Event) -> Iterable[str]:
        if isinstance(ev, Started):
            return ()
        if isinstance(ev, Failed):
            err = ev.error
            return [self._ev("error", code=err.code or err.type, message=err.message, param=err.param)]
        if isinstance(ev, Done):
            out = []
            if self.cur is None and not self.items:
                out += self._open(OutputItem("message"))
            out += self._close()
            done = _finish(self.shell, ev.usage, self.finish, self.items)
            out.append(self._ev("response.completed" if done.status == "completed" else "response.incomplete", response=done.model_dump()))
            return out
        out = self._write("reasoning", ev.reasoning) if ev.reasoning else []
        if ev.content:
            out += self._write("message", ev.content)
        for cd in ev.calls:
            if cd.name is not None:
                out += self._open(OutputItem("function_call", name=cd.name, call_id=cd.id or ""))
            if cd.arguments and self.cur is not None and self.cur.kind == "function_call":
                self.cur.text += cd.arguments
                out.append(self._ev("response.function_call_arguments.delta", item_id=self.cur.id, output_index=len(self.items), delta=cd.arguments))
        if ev.finish_reason:
            self.finish = ev.finish_reason
        return out

    def end(self) -> Iterable[str]:
        return ()


def _tool_choice(choice: str | NamedFunctionChoice | None, plan: ToolPlan) -> str | JSONObject:
    if choice is None:
        return "auto" if plan.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def router(serving: ResponsesServing) -> APIRouter:
    r = APIRouter()

    @r.post(
        "/v1/responses",
        response_model=ResponseObject,
        responses=STREAM_RESPONSE,
    )
    async def create_response(req: ResponsesRequest, raw: Request) -> Response:
        return await serving.create(req, raw)

    return r
