"""Anthropic-compatible routes: /v1/messages and /v1/messages/count_tokens.

System prompts are taken both from the top-level ``system`` field and from
``role: "system"`` messages inline in ``messages`` (which the anthropic
client passes through and some agents send); all of them are joined, in
order, into one leading system message, which every chat template accepts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from plinth.engine.outputs import CompletionOutput, RequestOutput
from plinth.server.errors import APIError, engine_exception
from plinth.server.protocol import (
    AnthropicMessage,
    AnthropicTextBlock,
    AnthropicThinkingBlock,
    AnthropicToolUseBlock,
    AnthropicUsage,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    CountTokensResponse,
    InputJSONDelta,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessagesRequest,
    MessagesResponse,
    MessageStartEvent,
    MessageStopEvent,
    PingEvent,
    SignatureDelta,
    TextDelta,
    ThinkingDelta,
)
from plinth.server.serving import (
    STREAM_RESPONSE,
    ChoiceCursor,
    ClientDisconnected,
    Generation,
    ServingContext,
    SSEResponse,
    random_id,
    sse_event,
    until_disconnect,
)
from plinth.server.tools import (
    OutputParser,
    ToolPlan,
    anthropic_tools,
    arguments_object,
    call_id,
    plan_tools,
    template_tools,
)


def _result_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(str(part.get("text", "")) for part in content if part.get("type") == "text")


def anthropic_messages(system: Any, messages: list[AnthropicMessage], *, native_tool_calls: bool = True) -> list[dict[str, Any]]:
    """Anthropic messages as the chat template expects them: ``tool_use``
    blocks become the assistant's tool_calls (JSON text for a template that
    has none), each ``tool_result`` a ``tool`` message, thinking is dropped."""
    systems: list[str] = []
    if isinstance(system, str):
        if system:
            systems.append(system)
    elif system:
        systems.append("\n".join(b.text for b in system))
    convo: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            if m.role == "system":
                systems.append(m.content)
            else:
                convo.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(m.content):
            extra = b.model_extra or {}
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use":
                if not isinstance(extra.get("name"), str) or not isinstance(extra.get("input", {}), dict):
                    raise APIError.bad_request("a tool_use block needs a name and an input object", param=f"messages.{i}.content.{j}")
                calls.append(
                    {"id": extra.get("id") or "", "type": "function", "function": {"name": extra["name"], "arguments": extra.get("input") or {}}}
                )
            elif b.type == "tool_result":
                if texts:  # keep the order of what the user said and the results
                    convo.append({"role": m.role, "content": "\n".join(texts)})
                    texts = []
                text = _result_text(b.content)
                if extra.get("is_error"):
                    text = f"error: {text}"
                convo.append({"role": "tool", "tool_call_id": extra.get("tool_use_id") or "", "content": text})
            elif b.type in ("thinking", "redacted_thinking"):
                continue
            else:
                raise APIError.bad_request(
                    f"content blocks of type {b.type!r} are not supported (text, tool_use, tool_result, thinking)",
                    param=f"messages.{i}.content.{j}.type",
                )
        text = "\n".join(texts)
        if m.role == "system":
            systems.append(text)
            continue
        if calls:
            msg: dict[str, Any] = {"role": m.role, "content": text}
            if native_tool_calls:
                msg["tool_calls"] = calls
            else:
                shown = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}) for c in calls)
                msg["content"] = f"{text}\n{shown}" if text else shown
            convo.append(msg)
        elif texts or not any(b.type == "tool_result" for b in m.content):
            convo.append({"role": m.role, "content": text})
    if not convo:
        raise APIError.bad_request("messages must hold at least one user or assistant message", param="messages")
    if systems:
        convo.insert(0, {"role": "system", "content": "\n\n".join(systems)})
    return convo


def tool_plan(req: MessagesRequest) -> ToolPlan:
    tools = anthropic_tools([t.model_dump(exclude_none=True) for t in req.tools or []])
    tc = req.tool_choice
    mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[tc.type] if tc else None
    if mode == "named" and not tc.name:
        raise APIError.bad_request('tool_choice {"type": "tool"} needs a name', param="tool_choice.name")
    parallel = not (tc and tc.disable_parallel_tool_use)
    return plan_tools(tools, mode, tc.name if tc else None, parallel)


def stop_reason(c: CompletionOutput, stop_sequences: list[str], called: bool = False) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished choice."""
    if called and c.finish_reason == "stop":
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str) and c.stop_reason in stop_sequences:
        return "stop_sequence", c.stop_reason
    if c.finish_reason is None:
        return None, None
    return "end_turn", None


class AnthropicServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _prompt(self, system: Any, messages: list[AnthropicMessage], plan: ToolPlan | None = None) -> tuple[str, list[int]]:
        convo = anthropic_messages(system, messages, native_tool_calls=self.ctx.native_tool_calls)
        text, ids = self.ctx.chat_prompt(convo, tools=template_tools(plan.tools) if plan and plan.tools else None)
        if not ids:
            raise APIError.bad_request("the chat template made an empty prompt", param="messages")
        return text, ids

    @staticmethod
    def _response_format(req: MessagesRequest) -> dict[str, Any] | None:
        """Anthropic's structured outputs (``output_config.format``) as an OpenAI response_format."""
        fmt = (req.output_config or {}).get("format") or req.output_format
        if not fmt:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
            raise APIError.bad_request(
                'output_config.format must be {"type": "json_schema", "schema": {...}}', param="output_config.format"
            )
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}

    async def count_tokens(self, req: CountTokensRequest) -> CountTokensResponse:
        self.ctx.check_model(req.model)
        tools = anthropic_tools([t.model_dump(exclude_none=True) for t in req.tools or []])
        _, ids = self._prompt(req.system, req.messages, ToolPlan(tools=tools))
        return CountTokensResponse(input_tokens=len(ids))

    async def messages(self, req: MessagesRequest, raw: Request) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        stops = list(req.stop_sequences or [])
        if any(not s for s in stops):
            raise APIError.bad_request("stop_sequences must not hold empty strings", param="stop_sequences")
        plan = tool_plan(req)
        text, ids = self._prompt(req.system, req.messages, plan)
        grammar = await ctx.grammar(self._response_format(req), forced=plan.grammar)
        params = ctx.sampling_params(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=stops,
            skip_special_tokens=not ctx.needs_special_tokens(plan),
        )
        params.grammar = grammar
        thinking = not (req.thinking and req.thinking.get("type") == "disabled")
        op = ctx.output_parser(plan, text, reasoning=thinking, id_prefix="toolu_")
        mid = random_id("msg_")
        gen = await ctx.start(ids, params, mid, text)
        if req.stream:
            return SSEResponse(self._stream(req, mid, model, gen, stops, op), generations=[gen])
        try:
            (final,) = await until_disconnect(raw, self._collect(gen))
        except ClientDisconnected:
            return Response(status_code=499)
        c = final.outputs[0]
        blocks, called = self._blocks(c.text, op)
        reason, seq = stop_reason(c, stops, called)
        resp = MessagesResponse(
            id=mid,
            content=blocks,
            model=model,
            stop_reason=reason,
            stop_sequence=seq,
            usage=AnthropicUsage(
                input_tokens=len(final.prompt_token_ids),
                output_tokens=len(c.token_ids),
                cache_read_input_tokens=final.num_cached_tokens,
            ),
        )
        return JSONResponse(resp.model_dump())

    @staticmethod
    def _blocks(text: str, op: OutputParser) -> tuple[list[Any], bool]:
        if not op.active:
            return [AnthropicTextBlock(text=text)], False
        parsed = op.parse(text, final=True)
        blocks: list[Any] = []
        if parsed.reasoning:
            blocks.append(AnthropicThinkingBlock(thinking=parsed.reasoning))
        if parsed.content or not parsed.calls:
            blocks.append(AnthropicTextBlock(text=parsed.content))
        for cid, call in zip(op.call_ids(parsed.calls), parsed.calls, strict=True):
            blocks.append(AnthropicToolUseBlock(id=cid, name=call.name, input=arguments_object(call.arguments)))
        return blocks, bool(parsed.calls)

    async def _collect(self, gen: Generation) -> list[RequestOutput]:
        final = None
        async for out in gen.outputs():
            final = out
        return [final]

    async def _stream(
        self, req: MessagesRequest, mid: str, model: str, gen: Generation, stops: list[str], op: OutputParser
    ) -> AsyncIterator[str]:
        def event(obj: Any) -> str:
            return sse_event(obj.type, obj.model_dump_json())

        cursor = ChoiceCursor()
        blocks = _BlockWriter(event)
        stream = gen.outputs()
        started = False
        try:
            async for out in stream:
                if not started:
                    started = True
                    yield event(
                        MessageStartEvent(
                            message=MessagesResponse(
                                id=mid,
                                content=[],
                                model=model,
                                usage=AnthropicUsage(
                                    input_tokens=len(out.prompt_token_ids),
                                    output_tokens=0,
                                    cache_read_input_tokens=out.num_cached_tokens,
                                ),
                            )
                        )
                    )
                    if not op.active:  # plain text: the block opens at once, as before
                        yield blocks.open("text")
                    yield event(PingEvent())
                if not out.outputs:
                    continue
                c = out.outputs[0]
                delta, _, _ = cursor.advance(c.text, len(c.token_ids), c.finished, stops)
                if op.active:
                    for e in blocks.write(op.delta(c.text[: cursor.text_len], final=c.finished)):
                        yield e
                elif delta:
                    yield event(ContentBlockDeltaEvent(index=blocks.index, delta=TextDelta(text=delta)))
                if c.finished:
                    reason, seq = stop_reason(c, stops, op.num_calls > 0)
                    if blocks.kind is None and blocks.index < 0:
                        yield blocks.open("text")  # an empty answer still has its text block
                    yield from_list(blocks.close())
                    yield event(
                        MessageDeltaEvent(
                            delta=MessageDelta(stop_reason=reason, stop_sequence=seq),
                            usage=MessageDeltaUsage(output_tokens=len(c.token_ids)),
                        )
                    )
                    yield event(MessageStopEvent())
                    return
            if started:  # ended without a finish (the engine shut down): close the message anyway
                yield from_list(blocks.close())
                yield event(
                    MessageDeltaEvent(
                        delta=MessageDelta(stop_reason="end_turn"), usage=MessageDeltaUsage(output_tokens=cursor.tokens)
                    )
                )
                yield event(MessageStopEvent())
        except Exception as exc:
            err = engine_exception(exc)
            yield sse_event("error", json.dumps(err.anthropic_body()))
        finally:
            await stream.aclose()


def from_list(events: list[str]) -> str:
    return "".join(events)


class _BlockWriter:
    """Content blocks of a streamed message, one open at a time: thinking,
    then text, then one tool_use block per call (a new kind closes the open
    block and starts the next index)."""

    def __init__(self, event: Any) -> None:
        self.event = event
        self.index = -1
        self.kind: str | None = None
        self.call = -1

    def open(self, kind: str, block: Any = None) -> str:
        out = self.close_one()
        self.index += 1
        self.kind = kind
        if block is None:
            block = AnthropicThinkingBlock(thinking="") if kind == "thinking" else AnthropicTextBlock(text="")
        return out + self.event(ContentBlockStartEvent(index=self.index, content_block=block))

    def close_one(self) -> str:
        if self.kind is None:
            return ""
        out = ""
        if self.kind == "thinking":
            out += self.event(ContentBlockDeltaEvent(index=self.index, delta=SignatureDelta()))
        self.kind = None
        return out + self.event(ContentBlockStopEvent(index=self.index))

    def close(self) -> list[str]:
        return [self.close_one()]

    def write(self, d: Any) -> list[str]:
        out: list[str] = []
        if d.reasoning:
            if self.kind != "thinking":
                out.append(self.open("thinking"))
            out.append(self.event(ContentBlockDeltaEvent(index=self.index, delta=ThinkingDelta(thinking=d.reasoning))))
        if d.content:
            if self.kind != "text":
                out.append(self.open("text"))
            out.append(self.event(ContentBlockDeltaEvent(index=self.index, delta=TextDelta(text=d.content))))
        for cd in d.calls:
            if cd.name is not None:
                self.call = cd.index
                out.append(self.open("tool_use", AnthropicToolUseBlock(id=cd.id or call_id("toolu_"), name=cd.name, input={})))
            if cd.arguments and self.kind == "tool_use" and cd.index == self.call:
                out.append(self.event(ContentBlockDeltaEvent(index=self.index, delta=InputJSONDelta(partial_json=cd.arguments))))
        return out


def router(serving: AnthropicServing) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/messages", response_model=MessagesResponse, responses=STREAM_RESPONSE)
    async def messages(req: MessagesRequest, raw: Request) -> Response:
        return await serving.messages(req, raw)

    @r.post("/v1/messages/count_tokens", response_model=CountTokensResponse)
    async def count_tokens(req: CountTokensRequest) -> CountTokensResponse:
        return await serving.count_tokens(req)

    return r
