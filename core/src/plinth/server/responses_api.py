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
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ConfigDict, Discriminator, Field, Tag, WithJsonSchema

from plinth.server.errors import APIError
from plinth.server.generation import Done, Event, Failed, GenerationPipeline, GenerationSpec, Result, Started, Usage
from plinth.server.protocol import FLOAT32_MAX, SEED_MAX, SEED_MIN, _Request, _Response
from plinth.server.serving import STREAM_RESPONSE, ServingContext, now_s, random_id, sse_event
from plinth.server.tools import ToolPlan, arguments_object, openai_tools, plan_tools


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
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


def _item_kind(v: Any) -> str | None:
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
    parameters: dict[str, Any] | None = None
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
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: PlainFormat | JSONSchemaFormat | None = Field(None, discriminator="type")


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=FLOAT32_MAX)
    top_p: float | None = Field(None, gt=0, le=1)
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
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = False
    previous_response_id: str | None = None
    truncation: str = "disabled"


def _text_of(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def input_messages(req: ResponsesRequest, *, native_tool_calls: bool) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        msgs.append({"role": "user", "content": req.input})
        return msgs
    for item in req.input:
        if isinstance(item, MessageItem):
            msgs.append({"role": "system" if item.role == "developer" else item.role, "content": _text_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            args = arguments_object(item.arguments)
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": args}}
            last = msgs[-1] if msgs else None
            if native_tool_calls:
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                msgs.append({"role": "assistant", "content": json.dumps({"name": item.name, "arguments": args})})
        elif isinstance(item, FunctionCallOutputItem):
            msgs.append({"role": "tool", "tool_call_id": item.call_id, "content": _text_of(item.output)})
        # reasoning items are not shown to the model again
    if not any(m["role"] != "system" for m in msgs):
        raise APIError.bad_request("input must hold at least one message", param="input")
    return msgs


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
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
        if req.previous_response_id:
            raise APIError.bad_request("this server keeps no responses (stateless): send the whole conversation as input", param="previous_response_id")
        tools = openai_tools([t.model_dump(exclude_none=True) for t in req.tools or []], flat=True)
        tc = req.tool_choice
        mode, named = (tc, None) if not isinstance(tc, NamedFunctionChoice) else ("named", tc.name)
        plan = plan_tools(tools, mode, named, req.parallel_tool_calls is not False)
        spec = GenerationSpec(
            request_id=random_id("resp_"),
            messages=input_messages(req, native_tool_calls=ctx.native_tool_calls),
            prompt_param="input",
            sampling=dict(temperature=req.temperature, top_p=req.top_p, seed=req.seed),
            max_tokens=req.max_output_tokens,
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
            tool_choice=_dump(req.tool_choice) or ("auto" if plan.tools else "none"),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            text=req.text.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"format": {"type": "text"}},
            metadata=req.metadata or {},
        )

    @staticmethod
    def _body(shell: ResponseObject, result: Result) -> ResponseObject:
        c = result.choices[0]
        items: list[dict[str, Any]] = []
        if c.reasoning:
            items.append(_reasoning(c.reasoning))
        if c.content or not c.calls:
            items.append(_message(c.content))
        for call in c.calls:
            items.append(_function_call(call.id, call.name, call.arguments))
        return _finish(shell, result.usage, c.finish_reason, items)


def _finish(shell: ResponseObject, usage: Usage, finish: str | None, items: list[dict[str, Any]]) -> ResponseObject:
    out = shell.model_copy(deep=True)
    out.output = items
    out.status = "incomplete" if finish == "length" else "completed"
    if finish == "length":
        out.incomplete_details = {"reason": "max_output_tokens"}
        for item in items:
            item["status"] = "incomplete"
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
        self.items: list[dict[str, Any]] = []  # finished items, in order
        self.cur: dict[str, Any] | None = None  # the open item
        self.finish: str | None = None

    def _ev(self, kind: str, **data: Any) -> str:
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
        if cur["type"] == "message":
            part = cur["content"][0]
            ev.append(self._ev("response.output_text.done", item_id=cur["id"], output_index=idx, content_index=0, text=part["text"], logprobs=[]))
            ev.append(self._ev("response.content_part.done", item_id=cur["id"], output_index=idx, content_index=0, part=part))
        elif cur["type"] == "reasoning":
            text = cur["content"][0]["text"]
            ev.append(self._ev("response.reasoning_text.done", item_id=cur["id"], output_index=idx, content_index=0, text=text))
        else:
            ev.append(self._ev("response.function_call_arguments.done", item_id=cur["id"], output_index=idx, name=cur["name"], arguments=cur["arguments"]))
        cur["status"] = "completed"
        ev.append(self._ev("response.output_item.done", output_index=idx, item=cur))
        self.items.append(cur)
        self.cur = None
        return ev

    def _open(self, item: dict[str, Any]) -> list[str]:
        ev = self._close()
        self.cur = item
        idx = len(self.items)
        added = dict(item, status="in_progress")
        if item["type"] == "message":
            added["content"] = []
        ev.append(self._ev("response.output_item.added", output_index=idx, item=added))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            ev.append(self._ev("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0, part=part))
        return ev

    def event(self, ev: Event) -> Iterable[str]:
        if isinstance(ev, Started):
            return ()
        if isinstance(ev, Failed):
            err = ev.error
            return [self._ev("error", code=err.code or err.type, message=err.message, param=err.param)]
        if isinstance(ev, Done):
            out = []
            if self.cur is None and not self.items:
                out += self._open(_message(""))
            out += self._close()
            done = _finish(self.shell, ev.usage, self.finish, self.items)
            out.append(self._ev("response.completed" if done.status == "completed" else "response.incomplete", response=done.model_dump()))
            return out
        out = []
        idx = len(self.items)
        if ev.reasoning:
            if self.cur is None or self.cur["type"] != "reasoning":
                out += self._open(_reasoning(""))
                idx = len(self.items)
            self.cur["content"][0]["text"] += ev.reasoning
            out.append(self._ev("response.reasoning_text.delta", item_id=self.cur["id"], output_index=idx, content_index=0, delta=ev.reasoning))
        if ev.content:
            if self.cur is None or self.cur["type"] != "message":
                out += self._open(_message(""))
                idx = len(self.items)
            self.cur["content"][0]["text"] += ev.content
            out.append(self._ev("response.output_text.delta", item_id=self.cur["id"], output_index=idx, content_index=0, delta=ev.content, logprobs=[]))
        for cd in ev.calls:
            if cd.name is not None:
                out += self._open(_function_call(cd.id or "", cd.name, ""))
                idx = len(self.items)
            if cd.arguments and self.cur is not None and self.cur["type"] == "function_call":
                self.cur["arguments"] += cd.arguments
                out.append(self._ev("response.function_call_arguments.delta", item_id=self.cur["id"], output_index=idx, delta=cd.arguments))
        if ev.finish_reason:
            self.finish = ev.finish_reason
        return out

    def end(self) -> Iterable[str]:
        return ()


def _dump(v: Any) -> Any:
    return v.model_dump() if hasattr(v, "model_dump") else v


def _message(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": random_id("msg_"),
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _reasoning(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": random_id("rs_"), "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _function_call(cid: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": random_id("fc_"), "call_id": cid, "name": name, "arguments": arguments, "status": "completed"}


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
