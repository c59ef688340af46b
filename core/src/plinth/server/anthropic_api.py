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
    AnthropicUsage,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    CountTokensResponse,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessagesRequest,
    MessagesResponse,
    MessageStartEvent,
    MessageStopEvent,
    PingEvent,
    TextDelta,
)
from plinth.server.serving import (
    ChoiceCursor,
    ClientDisconnected,
    Generation,
    ServingContext,
    SSEResponse,
    random_id,
    sse_event,
    until_disconnect,
)


def _block_text(block: Any, where: str) -> str | None:
    """The text of one content block (None: a block that adds nothing)."""
    kind = block.type
    if kind == "text":
        return block.text or ""
    if kind == "tool_result":
        content = block.content
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        return "\n".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
    if kind == "tool_use":
        extra = block.model_extra or {}
        return json.dumps({"name": extra.get("name"), "input": extra.get("input")})
    if kind in ("thinking", "redacted_thinking"):
        return None
    raise APIError.bad_request(f"content blocks of type {kind!r} are not supported (text only)", param=where)


def anthropic_messages(system: Any, messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    systems: list[str] = []
    if isinstance(system, str):
        if system:
            systems.append(system)
    elif system:
        systems.append("\n".join(b.text for b in system))
    convo: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            text = m.content
        else:
            parts = [_block_text(b, f"messages.{i}.content.{j}.type") for j, b in enumerate(m.content)]
            text = "\n".join(p for p in parts if p is not None)
        if m.role == "system":
            systems.append(text)
        else:
            convo.append({"role": m.role, "content": text})
    if not convo:
        raise APIError.bad_request("messages must hold at least one user or assistant message", param="messages")
    if systems:
        convo.insert(0, {"role": "system", "content": "\n\n".join(systems)})
    return convo


def stop_reason(c: CompletionOutput, stop_sequences: list[str]) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished choice."""
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

    def _prompt(self, system: Any, messages: list[AnthropicMessage]) -> tuple[str, list[int]]:
        text, ids = self.ctx.chat_prompt(anthropic_messages(system, messages))
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
        _, ids = self._prompt(req.system, req.messages)
        return CountTokensResponse(input_tokens=len(ids))

    async def messages(self, req: MessagesRequest, raw: Request) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        stops = list(req.stop_sequences or [])
        if any(not s for s in stops):
            raise APIError.bad_request("stop_sequences must not hold empty strings", param="stop_sequences")
        text, ids = self._prompt(req.system, req.messages)
        grammar = await ctx.grammar(self._response_format(req))
        params = ctx.sampling_params(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=stops,
        )
        params.grammar = grammar
        mid = random_id("msg_")
        gen = await ctx.start(ids, params, mid, text)
        if req.stream:
            return SSEResponse(self._stream(req, mid, model, gen, stops), generations=[gen])
        try:
            (final,) = await until_disconnect(raw, self._collect(gen))
        except ClientDisconnected:
            return Response(status_code=499)
        c = final.outputs[0]
        reason, seq = stop_reason(c, stops)
        resp = MessagesResponse(
            id=mid,
            content=[AnthropicTextBlock(text=c.text)],
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

    async def _collect(self, gen: Generation) -> list[RequestOutput]:
        final = None
        async for out in gen.outputs():
            final = out
        return [final]

    async def _stream(self, req: MessagesRequest, mid: str, model: str, gen: Generation, stops: list[str]) -> AsyncIterator[str]:
        def event(obj: Any) -> str:
            return sse_event(obj.type, obj.model_dump_json())

        cursor = ChoiceCursor()
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
                    yield event(ContentBlockStartEvent(index=0, content_block=AnthropicTextBlock(text="")))
                    yield event(PingEvent())
                if not out.outputs:
                    continue
                c = out.outputs[0]
                delta, _, _ = cursor.advance(c.text, len(c.token_ids), c.finished, stops)
                if delta:
                    yield event(ContentBlockDeltaEvent(index=0, delta=TextDelta(text=delta)))
                if c.finished:
                    reason, seq = stop_reason(c, stops)
                    yield event(ContentBlockStopEvent(index=0))
                    yield event(
                        MessageDeltaEvent(
                            delta=MessageDelta(stop_reason=reason, stop_sequence=seq),
                            usage=MessageDeltaUsage(output_tokens=len(c.token_ids)),
                        )
                    )
                    yield event(MessageStopEvent())
                    return
            if started:  # ended without a finish (the engine shut down): close the message anyway
                yield event(ContentBlockStopEvent(index=0))
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


def router(serving: AnthropicServing) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/messages", response_model=MessagesResponse)
    async def messages(req: MessagesRequest, raw: Request) -> Response:
        return await serving.messages(req, raw)

    @r.post("/v1/messages/count_tokens", response_model=CountTokensResponse)
    async def count_tokens(req: CountTokensRequest) -> CountTokensResponse:
        return await serving.count_tokens(req)

    return r
