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
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from plinth.engine.outputs import CompletionOutput, RequestOutput
from plinth.server.errors import APIError, engine_exception
from plinth.server.protocol import _Request, _Response
from plinth.server.serving import (
    STREAM_RESPONSE,
    ChoiceCursor,
    ClientDisconnected,
    Generation,
    ServingContext,
    SSEResponse,
    now_s,
    random_id,
    sse_event,
    until_disconnect,
)
from plinth.server.tools import OutputParser, ToolPlan, arguments_object, openai_tools, plan_tools, template_tools


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
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

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
        prompt, ids = ctx.chat_prompt(input_messages(req, native_tool_calls=ctx.native_tool_calls), tools=template_tools(tools) or None)
        if not ids:
            raise APIError.bad_request("the chat template made an empty prompt", param="input")
        grammar = await ctx.grammar(response_format(req.text), forced=plan.grammar)
        params = ctx.sampling_params(
            max_tokens=req.max_output_tokens or ctx.default_max_tokens(len(ids)),
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            skip_special_tokens=not ctx.needs_special_tokens(plan),
        )
        params.grammar = grammar
        op = ctx.output_parser(plan, prompt)
        rid = random_id("resp_")
        gen = await ctx.start(ids, params, rid, prompt)
        shell = self._shell(req, rid, model, plan)
        if req.stream:
            return SSEResponse(self._stream(shell, gen, op), generations=[gen])
        try:
            final = await until_disconnect(raw, self._collect(gen))
        except ClientDisconnected:
            return Response(status_code=499)
        c = final.outputs[0]
        return JSONResponse(self._finish(shell, final, c, self._items(c.text, op)).model_dump())

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

    async def _collect(self, gen: Generation) -> RequestOutput:
        final = None
        async for out in gen.outputs():
            final = out
        if final is None:
            raise APIError(503, "the engine stopped before answering", code="overloaded")
        return final

    @staticmethod
    def _items(text: str, op: OutputParser) -> list[dict[str, Any]]:
        parsed = op.parse(text, final=True) if op.active else None
        items: list[dict[str, Any]] = []
        if parsed is None:
            return [_message(text)]
        if parsed.reasoning:
            items.append(_reasoning(parsed.reasoning))
        if parsed.content or not parsed.calls:
            items.append(_message(parsed.content))
        for cid, call in zip(op.call_ids(parsed.calls), parsed.calls, strict=True):
            items.append(_function_call(cid, call.name, call.arguments))
        return items

    @staticmethod
    def _finish(shell: ResponseObject, final: RequestOutput, c: CompletionOutput, items: list[dict[str, Any]]) -> ResponseObject:
        out = shell.model_copy(deep=True)
        out.output = items
        out.status = "incomplete" if c.finish_reason == "length" else "completed"
        if c.finish_reason == "length":
            out.incomplete_details = {"reason": "max_output_tokens"}
            for item in items:
                item["status"] = "incomplete"
        n_in, n_out = len(final.prompt_token_ids), len(c.token_ids)
        out.usage = {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_in + n_out,
        }
        return out

    async def _stream(self, shell: ResponseObject, gen: Generation, op: OutputParser) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **data: Any) -> str:
            nonlocal seq
            seq += 1
            return sse_event(kind, json.dumps({"type": kind, "sequence_number": seq - 1, **data}))

        yield event("response.created", response=shell.model_dump())
        yield event("response.in_progress", response=shell.model_dump())
        items: list[dict[str, Any]] = []  # finished items, in order
        cur: dict[str, Any] | None = None  # the open item

        def close() -> list[str]:
            nonlocal cur
            if cur is None:
                return []
            idx = len(items)
            ev = []
            if cur["type"] == "message":
                part = cur["content"][0]
                ev.append(event("response.output_text.done", item_id=cur["id"], output_index=idx, content_index=0, text=part["text"], logprobs=[]))
                ev.append(event("response.content_part.done", item_id=cur["id"], output_index=idx, content_index=0, part=part))
            elif cur["type"] == "reasoning":
                text = cur["content"][0]["text"]
                ev.append(event("response.reasoning_text.done", item_id=cur["id"], output_index=idx, content_index=0, text=text))
            else:
                ev.append(event("response.function_call_arguments.done", item_id=cur["id"], output_index=idx, name=cur["name"], arguments=cur["arguments"]))
            cur["status"] = "completed"
            ev.append(event("response.output_item.done", output_index=idx, item=cur))
            items.append(cur)
            cur = None
            return ev

        def open_(item: dict[str, Any]) -> list[str]:
            nonlocal cur
            ev = close()
            cur = item
            idx = len(items)
            added = dict(item, status="in_progress")
            if item["type"] == "message":
                added["content"] = []
            ev.append(event("response.output_item.added", output_index=idx, item=added))
            if item["type"] == "message":
                ev.append(event("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
            return ev

        cursor = ChoiceCursor()
        stream = gen.outputs()
        last: RequestOutput | None = None
        try:
            async for out in stream:
                last = out
                if not out.outputs:
                    continue
                c = out.outputs[0]
                delta, _, _ = cursor.advance(c.text, len(c.token_ids), c.finished, [])
                d = op.delta(c.text[: cursor.text_len], final=c.finished) if op.active else None
                reasoning, content, calls = (d.reasoning, d.content, d.calls) if d is not None else ("", delta, [])
                evs: list[str] = []
                if reasoning:
                    if cur is None or cur["type"] != "reasoning":
                        evs += open_(_reasoning(""))
                    cur["content"][0]["text"] += reasoning
                    evs.append(event("response.reasoning_text.delta", item_id=cur["id"], output_index=len(items), content_index=0, delta=reasoning))
                if content:
                    if cur is None or cur["type"] != "message":
                        evs += open_(_message(""))
                    cur["content"][0]["text"] += content
                    evs.append(event("response.output_text.delta", item_id=cur["id"], output_index=len(items), content_index=0, delta=content, logprobs=[]))
                for cd in calls:
                    if cd.name is not None:
                        evs += open_(_function_call(cd.id or "", cd.name, ""))
                    if cd.arguments and cur is not None and cur["type"] == "function_call":
                        cur["arguments"] += cd.arguments
                        evs.append(event("response.function_call_arguments.delta", item_id=cur["id"], output_index=len(items), delta=cd.arguments))
                for e in evs:
                    yield e
                if c.finished:
                    break
            if cur is None and not items:
                for e in open_(_message("")):
                    yield e
            for e in close():
                yield e
            if last is not None and last.outputs:
                c = last.outputs[0]
                done = self._finish(shell, last, c, items)
                yield event("response.completed" if done.status == "completed" else "response.incomplete", response=done.model_dump())
        except Exception as exc:
            err = engine_exception(exc)
            yield event("error", code=err.code or err.type, message=err.message, param=err.param)
        finally:
            await stream.aclose()


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
