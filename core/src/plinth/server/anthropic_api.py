"""Anthropic-compatible routes: /v1/messages and /v1/messages/count_tokens.

Only Anthropic's protocol is here: reading a request into a
``GenerationSpec`` and rendering the one generation path's events and
results (plinth.server.generation) as Anthropic's events and bodies.

System prompts are taken both from the top-level ``system`` field and from
``role: "system"`` messages inline in ``messages`` (which the anthropic
client passes through and some agents send); all of them are joined, in
order, into one leading system message, which every chat template accepts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Literal, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import Response

from plinth.server.generation import (
    ChoiceDelta,
    Done,
    Event,
    Failed,
    GenerationPipeline,
    GenerationSpec,
    Result,
    Started,
)
from plinth.server.protocol import (
    AnthropicMessage,
    AnthropicOutputBlock,
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
    JSONObject,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessagesRequest,
    MessagesResponse,
    MessageStartEvent,
    MessageStopEvent,
    PingEvent,
    SignatureDelta,
    TextBlock,
    TextDelta,
    ThinkingDelta,
    ThinkingDisabled,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from plinth.server.serving import (
    STREAM_RESPONSE,
    ServingContext,
    TemplateMessage,
    TemplateToolCall,
    random_id,
    sse_event,
    with_calls,
)
from plinth.server.tools import ToolPlan, arguments_object, call_id, make_tools, plan_tools


def anthropic_messages(
    system: str | list[TextBlock] | None, messages: list[AnthropicMessage], *, native_tool_calls: bool = True
) -> list[TemplateMessage]:
    """Anthropic messages as the chat template expects them: ``tool_use``
    blocks become the assistant's tool_calls (JSON text for a template that
    has none), each ``tool_result`` a ``tool`` message, thinking is dropped.
    System text (the field, and system messages inline) leads, joined."""
    systems: list[str] = []
    if isinstance(system, str):
        if system:
            systems.append(system)
    elif system:
        systems.append("\n".join(b.text for b in system))
    convo: list[TemplateMessage] = []
    for m in messages:
        if isinstance(m.content, str):
            if m.role == "system":
                systems.append(m.content)
            else:
                convo.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[TemplateToolCall] = []
        for b in m.content:
            if isinstance(b, TextBlock):
                texts.append(b.text)
            elif isinstance(b, ToolUseBlock):
                calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
            elif isinstance(b, ToolResultBlock):
                if texts:  # keep the order of what the user said and the results
                    convo.append({"role": m.role, "content": "\n".join(texts)})
                    texts = []
                convo.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
            # thinking blocks are not shown to the model again
        text = "\n".join(texts)
        if m.role == "system":
            systems.append(text)
        elif calls:
            convo.append(with_calls({"role": m.role, "content": text}, calls, native_tool_calls))
        elif texts or not any(isinstance(b, ToolResultBlock) for b in m.content):
            convo.append({"role": m.role, "content": text})
    if systems:
        convo.insert(0, {"role": "system", "content": "\n\n".join(systems)})
    return convo


def tool_plan(req: MessagesRequest) -> ToolPlan:
    tools = make_tools(((t.name, t.description, t.input_schema) for t in req.tools or []), schema_field="input_schema")
    tc = req.tool_choice
    if tc is None:
        return plan_tools(tools, None, None, True)
    parallel = isinstance(tc, ToolChoiceNone) or not tc.disable_parallel_tool_use
    mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[tc.type]
    return plan_tools(tools, mode, tc.name if isinstance(tc, ToolChoiceTool) else None, parallel)


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def stop_reason(finish: str | None, reason: int | str | None, stop_sequences: list[str]) -> tuple[StopReason | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished choice."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(reason, str) and reason in stop_sequences:
        return "stop_sequence", reason
    if finish is None:
        return None, None
    return "end_turn", None


class AnthropicServing:
    def __init__(self, ctx: ServingContext, pipeline: GenerationPipeline) -> None:
        self.ctx = ctx
        self.pipeline = pipeline

    @staticmethod
    def _response_format(req: MessagesRequest) -> JSONObject | None:
        """Anthropic's structured outputs (``output_config.format``) as an OpenAI response_format."""
        fmt = (req.output_config.format if req.output_config else None) or req.output_format
        if fmt is None:
            return None
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}

    async def count_tokens(self, req: CountTokensRequest) -> CountTokensResponse:
        self.ctx.check_model(req.model)
        convo = anthropic_messages(req.system, req.messages, native_tool_calls=self.ctx.native_tool_calls)
        return CountTokensResponse(input_tokens=len(self.pipeline.chat_prompt(convo, ToolPlan(tools=make_tools(((t.name, t.description, t.input_schema) for t in req.tools or []), schema_field="input_schema"))).ids))

    async def messages(self, req: MessagesRequest, raw: Request) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        params = req.sampling_params()
        stops = list(params.stop or [])
        spec = GenerationSpec(
            request_id=random_id("msg_"),
            params=params,
            messages=anthropic_messages(req.system, req.messages, native_tool_calls=ctx.native_tool_calls),
            response_format=self._response_format(req),
            plan=tool_plan(req),
            # thinking disabled: reasoning stays in the text (the template decides whether the model thinks)
            reasoning=not isinstance(req.thinking, ThinkingDisabled),
            call_id_prefix="toolu_",
        )
        run = await self.pipeline.start(spec)
        mid = spec.request_id
        return await self.pipeline.respond(
            raw,
            run,
            stream=req.stream,
            renderer=lambda: _MessageStream(mid, model, stops, run.parsing),
            body=lambda result: self._message(mid, model, stops, result),
        )

    @staticmethod
    def _message(mid: str, model: str, stops: list[str], result: Result) -> MessagesResponse:
        c = result.choices[0]
        blocks: list[AnthropicOutputBlock] = []
        if c.reasoning:
            blocks.append(AnthropicThinkingBlock(thinking=c.reasoning))
        if c.content or not c.calls:
            blocks.append(AnthropicTextBlock(text=c.content))
        for call in c.calls:
            blocks.append(AnthropicToolUseBlock(id=call.id, name=call.name, input=arguments_object(call.arguments)))
        reason, seq = stop_reason(c.finish_reason, c.stop_reason, stops)
        return MessagesResponse(
            id=mid,
            content=blocks,
            model=model,
            stop_reason=reason,
            stop_sequence=seq,
            usage=AnthropicUsage(
                input_tokens=result.usage.prompt_tokens,
                output_tokens=result.usage.completion_tokens,
                cache_read_input_tokens=result.usage.cached_tokens,
            ),
        )


class _MessageStream:
    """/v1/messages events: message_start when the prompt is in, then one
    content block at a time (thinking, text, tool_use), message_delta with
    the stop reason, message_stop."""

    def __init__(self, mid: str, model: str, stops: list[str], parsing: bool) -> None:
        self.mid, self.model, self.stops, self.parsing = mid, model, stops, parsing
        self.blocks = _BlockWriter(_event)
        self.started = False
        self.finished = False
        self.output_tokens = 0

    def start(self) -> Iterable[str]:
        return ()

    def event(self, ev: Event) -> Iterable[str]:
        if isinstance(ev, Failed):
            return [sse_event("error", json.dumps(ev.error.anthropic_body()))]
        if isinstance(ev, Done):
            return ()
        out: list[str] = []
        if isinstance(ev, Started):
            self.started = True
            usage = AnthropicUsage(input_tokens=ev.prompt_tokens, output_tokens=0, cache_read_input_tokens=ev.cached_tokens)
            out.append(_event(MessageStartEvent(message=MessagesResponse(id=self.mid, content=[], model=self.model, usage=usage))))
            if not self.parsing:  # plain text: its block opens at once
                out.append(self.blocks.open("text"))
            out.append(_event(PingEvent()))
            return out
        if self.finished or ev.index != 0:
            return ()
        self.output_tokens = ev.num_tokens
        out += self.blocks.write(ev)
        if ev.finish_reason:
            self.finished = True
            reason, seq = stop_reason(ev.finish_reason, ev.stop_reason, self.stops)
            out += self._close(reason, seq)
        return out

    def _close(self, reason: StopReason | None, seq: str | None) -> list[str]:
        out = []
        if self.blocks.kind is None and self.blocks.index < 0:
            out.append(self.blocks.open("text"))  # an empty answer still has its text block
        out += self.blocks.close()
        out.append(
            _event(MessageDeltaEvent(delta=MessageDelta(stop_reason=reason, stop_sequence=seq), usage=MessageDeltaUsage(output_tokens=self.output_tokens)))
        )
        out.append(_event(MessageStopEvent()))
        return out

    def end(self) -> Iterable[str]:
        if self.started and not self.finished:  # ended without a finish (the engine stopped): close the message anyway
            self.finished = True
            return self._close("end_turn", None)
        return ()


class _Event(Protocol):
    """One of Anthropic's stream events: it names itself."""

    @property
    def type(self) -> str: ...

    def model_dump_json(self) -> str: ...


def _event(obj: _Event) -> str:
    return sse_event(obj.type, obj.model_dump_json())


class _BlockWriter:
    """Content blocks of a streamed message, one open at a time: thinking,
    then text, then one tool_use block per call (a new kind closes the open
    block and starts the next index)."""

    def __init__(self, event: Callable[[_Event], str]) -> None:
        self.event = event
        self.index = -1
        self.kind: str | None = None
        self.call = -1

    def open(self, kind: str, block: AnthropicOutputBlock | None = None) -> str:
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

    def write(self, d: ChoiceDelta) -> list[str]:
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
