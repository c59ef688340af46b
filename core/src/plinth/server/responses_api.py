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
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from plinth.server.errors import APIError
from plinth.server.generation import Done, Event, Failed, GenerationPipeline, GenerationSpec, Result, Started, Usage
from plinth.server.protocol import _Request, _Response
from plinth.server.serving import STREAM_RESPONSE, ServingContext, now_s, random_id, sse_event
from plinth.server.tools import ToolPlan, arguments_object, openai_tools, plan_tools


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    #: {"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}}
    text: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None


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


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError.bad_request(f"{where} must be a string or a list of text parts", param=where)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError.bad_request(f"content parts of type {kind!r} are not supported (text only)", param=f"{where}.{j}")
        parts.append(part["text"])
    return "\n".join(parts)


def input_messages(req: ResponsesRequest, *, native_tool_calls: bool) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        msgs.append({"role": "user", "content": req.input})
        return msgs
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError.bad_request(f"{where}.role must be user, assistant, system or developer", param=f"{where}.role")
            msgs.append({"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(args, str):
                raise APIError.bad_request(f"{where}: a function_call needs a name and arguments (a string)", param=where)
            call = {"id": item.get("call_id") or "", "type": "function", "function": {"name": name, "arguments": arguments_object(args)}}
            last = msgs[-1] if msgs else None
            if native_tool_calls:
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                msgs.append({"role": "assistant", "content": json.dumps({"name": name, "arguments": call["function"]["arguments"]})})
        elif kind == "function_call_output":
            out = item.get("output")
            text = out if isinstance(out, str) else _text_of(out, f"{where}.output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id") or "", "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise APIError.bad_request(f"input items of type {kind!r} are not supported", param=f"{where}.type")
    if not any(m["role"] != "system" for m in msgs):
        raise APIError.bad_request("input must hold at least one message", param="input")
    return msgs


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt:
        return None
    if not isinstance(fmt, dict):
        raise APIError.bad_request("text.format must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema")}}
    if fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise APIError.bad_request(f"text.format.type {fmt.get('type')!r} is not supported (text, json_object, json_schema)", param="text.format.type")


class ResponsesServing:
    def __init__(self, ctx: ServingContext, pipeline: GenerationPipeline) -> None:
        self.ctx = ctx
        self.pipeline = pipeline

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        if req.previous_response_id:
            raise APIError.bad_request("this server keeps no responses (stateless): send the whole conversation as input", param="previous_response_id")
        tools = openai_tools(req.tools, flat=True)
        tc = req.tool_choice
        mode, named = (tc, None) if not isinstance(tc, dict) else ("named", tc.get("name"))
        if mode == "named" and (tc.get("type") != "function" or not isinstance(named, str)):
            raise APIError.bad_request('tool_choice must be auto, none, required or {"type": "function", "name": ...}', param="tool_choice")
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
            tools=list(req.tools or []),
            tool_choice=req.tool_choice or ("auto" if plan.tools else "none"),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            text=req.text or {"format": {"type": "text"}},
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
