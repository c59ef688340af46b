"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from plinth.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from plinth.server.errors import APIError, engine_exception
from plinth.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    FunctionCall,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ToolCall,
    TopLogprob,
    Usage,
)
from plinth.server.serving import (
    STREAM_RESPONSE,
    ChoiceCursor,
    ClientDisconnected,
    Generation,
    ServingContext,
    SSEResponse,
    clamp_logprob,
    merged,
    now_s,
    random_id,
    sse,
    until_disconnect,
)
from plinth.server.tools import OutputParser, arguments_object, openai_tools, plan_tools, template_tools

MAX_TOP_LOGPROBS = 20


def chat_messages(messages: list[ChatMessage], param: str = "messages", *, native_tool_calls: bool = True) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template expects them (plain text content;
    ``developer`` is the newer name of ``system``; tool-call arguments as
    objects, as templates render them). A template that knows nothing of
    tool calls (``native_tool_calls`` False) gets them as JSON text, so the
    model still sees what it called."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            parts = []
            for j, part in enumerate(content):
                if part.type not in ("text", "input_text", "output_text") or part.text is None:
                    raise APIError.bad_request(
                        f"content parts of type {part.type!r} are not supported (text only)",
                        param=f"{param}.{i}.content.{j}.type",
                    )
                parts.append(part.text)
            text = "\n".join(parts)
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": text}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": arguments_object(c.function.arguments)}}
                for c in m.tool_calls
            ]
            if native_tool_calls:
                msg["tool_calls"] = calls
            else:
                shown = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}) for c in calls)
                msg["content"] = f"{text}\n{shown}" if text else shown
        out.append(msg)
    return out


def tool_choice_of(choice: Any) -> tuple[str | None, str | None]:
    """OpenAI's tool_choice as (mode, function name)."""
    if choice is None or isinstance(choice, str):
        return choice, None
    return "named", choice.function.name


def usage_of(prompt_tokens: int, completion_tokens: int, cached: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


class OpenAIServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    # ---- logprobs --------------------------------------------------------------------

    def chat_logprobs(self, lps: list[TokenLogprobs], k: int) -> ChatLogprobs:
        tok = self.ctx.token_str
        raw = self.ctx.token_bytes
        content = []
        for lp in lps:
            content.append(
                ChatLogprobToken(
                    token=tok(lp.token_id),
                    logprob=clamp_logprob(lp.logprob),
                    bytes=raw(lp.token_id),
                    top_logprobs=[
                        TopLogprob(token=tok(t.token_id), logprob=clamp_logprob(t.logprob), bytes=raw(t.token_id))
                        for t in lp.top[:k]
                    ],
                )
            )
        return ChatLogprobs(content=content)

    def completion_logprobs(
        self, token_ids: list[int], lps: list[TokenLogprobs | None], k: int, offset: int
    ) -> CompletionLogprobs:
        tok = self.ctx.token_str
        out = CompletionLogprobs()
        for tid, lp in zip(token_ids, lps, strict=False):
            s = tok(tid)
            out.tokens.append(s)
            out.text_offset.append(offset)
            offset += self.ctx.text_width(tid)
            if lp is None:  # the first prompt token: nothing precedes it
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(clamp_logprob(lp.logprob))
            top = {tok(t.token_id): clamp_logprob(t.logprob) for t in lp.top[:k]}
            top.setdefault(s, clamp_logprob(lp.logprob))
            out.top_logprobs.append(top)
        return out

    # ---- /v1/models -------------------------------------------------------------------

    def models(self) -> ModelList:
        root = None
        comps = getattr(self.ctx.engine.engine, "components", None) if hasattr(self.ctx.engine, "engine") else None
        if comps is not None:
            root = comps.source.path
        return ModelList(
            data=[ModelCard(id=name, root=root, max_model_len=self.ctx.engine.max_model_len) for name in self.ctx.settings.served_model_names]
        )

    # ---- /v1/completions ---------------------------------------------------------------

    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if isinstance(p, str):
            return [(p, self.ctx.encode(p))]
        if not p:
            raise APIError.bad_request("prompt must not be empty", param="prompt")
        if isinstance(p[0], str):
            return [(s, self.ctx.encode(s)) for s in p]
        if isinstance(p[0], int):
            return [(None, self.ctx.check_prompt_ids(p))]
        prompts = []
        for i, ids in enumerate(p):
            if not ids:
                raise APIError.bad_request(f"prompt {i} is empty", param="prompt")
            prompts.append((None, self.ctx.check_prompt_ids(ids)))
        return prompts

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise APIError.bad_request("best_of is not supported (it must equal n when given)", param="best_of")
        if req.suffix:
            raise APIError.bad_request("suffix is not supported", param="suffix")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError.bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}", param="logprobs")
        prompts = self._completion_prompts(req)
        for i, (text, ids) in enumerate(prompts):
            if text is not None and not ids:
                raise APIError.bad_request(f"prompt {i} is empty", param="prompt")
        grammar = await ctx.grammar(req.response_format, req.guided_json, req.guided_regex)
        stops = _stop_list(req.stop)
        max_tokens = req.max_tokens if req.max_tokens is not None else ctx.default_max_tokens(max(len(i) for _, i in prompts))
        base = dict(
            req.sampling_kwargs(stops),
            max_tokens=max_tokens,
            logprobs=req.logprobs,
            prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
            logit_bias=ctx.logit_bias(req.logit_bias),
        )
        rid = random_id("cmpl-")
        gens: list[Generation] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                params = ctx.sampling_params(**base)
                if grammar is not None:
                    params.grammar = grammar if i == 0 else grammar.fork()
                gens.append(await ctx.start(ids, params, f"{rid}-{i}", text))
        except BaseException:
            for g in gens:
                g.close_nowait()
            raise
        created = now_s()
        if req.stream:
            return SSEResponse(self._completion_stream(req, rid, created, model, prompts, gens, stops), generations=gens)
        try:
            finals = await until_disconnect(raw, self._collect(gens))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(self._completion_response(req, rid, created, model, prompts, finals).model_dump())

    async def _collect(self, gens: list[Generation]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(gens)
        async for i, out in merged(gens):
            finals[i] = out
        return [f for f in finals if f is not None]

    def _echo_prefix(self, req: CompletionRequest, prompt_text: str | None, ids: list[int]) -> str:
        return prompt_text if prompt_text is not None else self.ctx.tokenizer.decode(ids, skip_special_tokens=False)

    def _completion_response(
        self,
        req: CompletionRequest,
        rid: str,
        created: int,
        model: str,
        prompts: list[tuple[str | None, list[int]]],
        finals: list[RequestOutput],
    ) -> CompletionResponse:
        choices = []
        prompt_tokens = completion_tokens = cached = 0
        for p_idx, (out, (ptext, pids)) in enumerate(zip(finals, prompts, strict=False)):
            prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text = c.text
                logprobs = None
                if req.echo:
                    prefix = self._echo_prefix(req, ptext, pids)
                    text = prefix + text
                if req.logprobs is not None:
                    ids: list[int] = []
                    lps: list[TokenLogprobs | None] = []
                    if req.echo:
                        ids += list(out.prompt_token_ids)
                        plp = list(out.prompt_logprobs or [])
                        lps += plp + [None] * (len(ids) - len(plp))
                    ids += list(c.token_ids)
                    lps += list(c.logprobs or [])
                    logprobs = self.completion_logprobs(ids, lps, req.logprobs, 0)
                choices.append(
                    CompletionChoice(
                        index=p_idx * req.n + c.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=rid, created=created, model=model, choices=choices, usage=usage_of(prompt_tokens, completion_tokens, cached)
        )

    async def _completion_stream(
        self,
        req: CompletionRequest,
        rid: str,
        created: int,
        model: str,
        prompts: list[tuple[str | None, list[int]]],
        gens: list[Generation],
        stops: list[str],
    ) -> AsyncIterator[str]:
        n = req.n
        cursors: dict[int, ChoiceCursor] = {}
        offsets: dict[int, int] = {}
        prompt_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        cached: dict[int, int] = {}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        ctx_width = self.ctx.text_width

        def chunk(choices: list[CompletionChoice]) -> str:
            return sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=choices).model_dump_json())

        stream = merged(gens)
        try:
            async for p_idx, out in stream:
                prompt_tokens[p_idx] = len(out.prompt_token_ids)
                cached[p_idx] = out.num_cached_tokens
                for c in out.outputs:
                    index = p_idx * n + c.index
                    cur = cursors.get(index)
                    choices: list[CompletionChoice] = []
                    if cur is None:
                        cur = cursors[index] = ChoiceCursor()
                        offsets[index] = 0
                        if req.echo:
                            ptext, pids = prompts[p_idx]
                            prefix = self._echo_prefix(req, ptext, pids)
                            lp = None
                            if req.logprobs is not None:
                                plp = list(out.prompt_logprobs or [])
                                ids = list(out.prompt_token_ids)
                                lp = self.completion_logprobs(ids, plp + [None] * (len(ids) - len(plp)), req.logprobs, 0)
                            offsets[index] = len(prefix)
                            choices.append(CompletionChoice(index=index, text=prefix, logprobs=lp))
                    if cur.finished:
                        continue
                    completion_tokens[index] = len(c.token_ids)
                    delta, t0, t1 = cur.advance(c.text, len(c.token_ids), c.finished, stops)
                    lp = None
                    if req.logprobs is not None and t1 > t0:
                        lp = self.completion_logprobs(list(c.token_ids[t0:t1]), list((c.logprobs or [])[t0:t1]), req.logprobs, offsets[index])
                        offsets[index] += sum(ctx_width(t) for t in c.token_ids[t0:t1])
                    if c.finished:
                        cur.finished = True
                    if delta or lp is not None or c.finished:
                        choices.append(
                            CompletionChoice(
                                index=index,
                                text=delta,
                                logprobs=lp,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason if c.finished else None,
                            )
                        )
                    if choices:
                        yield chunk(choices)
            if include_usage:
                usage = usage_of(sum(prompt_tokens.values()), sum(completion_tokens.values()), sum(cached.values()))
                yield sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[], usage=usage).model_dump_json())
        except Exception as exc:
            err = engine_exception(exc)
            yield sse(json.dumps(err.openai_body()))
        finally:
            await stream.aclose()
        yield sse("[DONE]")

    # ---- /v1/chat/completions -------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise APIError.bad_request(
                    f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}", param="top_logprobs"
                )
            if not req.logprobs and req.top_logprobs > 0:
                raise APIError.bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
        tools = openai_tools([t.model_dump(exclude_none=True) for t in req.tools or []])
        mode, named = tool_choice_of(req.tool_choice)
        plan = plan_tools(tools, mode, named, req.parallel_tool_calls is not False)
        messages = chat_messages(req.messages, native_tool_calls=ctx.native_tool_calls)
        prompt_text, ids = ctx.chat_prompt(
            messages,
            add_generation_prompt=req.add_generation_prompt,
            template_kwargs=req.chat_template_kwargs,
            tools=template_tools(tools) or None,
        )
        if not ids:
            raise APIError.bad_request("the chat template made an empty prompt", param="messages")
        grammar = await ctx.grammar(req.response_format, req.guided_json, req.guided_regex, forced=plan.grammar)
        stops = _stop_list(req.stop)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = ctx.default_max_tokens(len(ids))
        kwargs = req.sampling_kwargs(stops)
        if ctx.needs_special_tokens(plan):
            kwargs["skip_special_tokens"] = False
        params = ctx.sampling_params(
            **kwargs,
            max_tokens=max_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            logit_bias=ctx.logit_bias(req.logit_bias),
        )
        params.grammar = grammar
        parsers = [ctx.output_parser(plan, prompt_text) for _ in range(req.n)]
        rid = random_id("chatcmpl-")
        gen = await ctx.start(ids, params, rid, prompt_text)
        created = now_s()
        if req.stream:
            return SSEResponse(self._chat_stream(req, rid, created, model, gen, stops, parsers), generations=[gen])
        try:
            (final,) = await until_disconnect(raw, self._collect([gen]))
        except ClientDisconnected:
            return Response(status_code=499)
        k = req.top_logprobs or 0
        choices = []
        for c in final.outputs:
            message, finish = self._chat_message(c, parsers[c.index])
            choices.append(
                ChatCompletionChoice(
                    index=c.index,
                    message=message,
                    logprobs=self.chat_logprobs(c.logprobs or [], k) if req.logprobs else None,
                    finish_reason=finish,
                    stop_reason=c.stop_reason,
                )
            )
        resp = ChatCompletionResponse(
            id=rid,
            created=created,
            model=model,
            choices=choices,
            usage=usage_of(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs), final.num_cached_tokens),
        )
        return JSONResponse(resp.model_dump())

    @staticmethod
    def _chat_message(c: CompletionOutput, op: OutputParser) -> tuple[ChatResponseMessage, str | None]:
        if not op.active:
            return ChatResponseMessage(content=c.text), c.finish_reason
        parsed = op.parse(c.text, final=True)
        ids = op.call_ids(parsed.calls)
        calls = [ToolCall(id=i, function=FunctionCall(name=t.name, arguments=t.arguments)) for i, t in zip(ids, parsed.calls, strict=True)]
        message = ChatResponseMessage(
            content=parsed.content if parsed.content or not calls else None,
            reasoning_content=parsed.reasoning or None,
            tool_calls=calls,
        )
        return message, finish_reason(c.finish_reason, bool(calls))

    async def _chat_stream(
        self,
        req: ChatCompletionRequest,
        rid: str,
        created: int,
        model: str,
        gen: Generation,
        stops: list[str],
        parsers: list[OutputParser],
    ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        k = req.top_logprobs or 0

        def chunk(choices: list[ChatCompletionStreamChoice], usage: Usage | None = None) -> str:
            return sse(
                ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=choices, usage=usage).model_dump_json()
            )

        cursors = [ChoiceCursor() for _ in range(req.n)]
        final: RequestOutput | None = None
        stream = gen.outputs()
        try:
            # the role first, for every choice, as OpenAI does
            yield chunk(
                [ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(req.n)]
            )
            async for out in stream:
                final = out
                for c in out.outputs:
                    cur = cursors[c.index]
                    if cur.finished:
                        continue
                    piece = self._chat_delta(req, c, cur, stops, k, parsers[c.index])
                    if piece is not None:
                        yield chunk([piece])
            if include_usage and final is not None:
                usage = usage_of(
                    len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs), final.num_cached_tokens
                )
                yield chunk([], usage)
        except Exception as exc:
            err = engine_exception(exc)
            yield sse(json.dumps(err.openai_body()))
        finally:
            await stream.aclose()
        yield sse("[DONE]")

    def _chat_delta(
        self, req: ChatCompletionRequest, c: CompletionOutput, cur: ChoiceCursor, stops: list[str], k: int, op: OutputParser
    ) -> ChatCompletionStreamChoice | None:
        delta, t0, t1 = cur.advance(c.text, len(c.token_ids), c.finished, stops)
        logprobs = None
        if req.logprobs and t1 > t0:
            logprobs = self.chat_logprobs(list((c.logprobs or [])[t0:t1]), k)
        if c.finished:
            cur.finished = True
        finish = c.finish_reason
        if op.active:
            # the parsers read everything shown so far (held-back stop-string text is not shown)
            d = op.delta(c.text[: cur.text_len], final=c.finished)
            msg = DeltaMessage(
                content=d.content or None,
                reasoning_content=d.reasoning or None,
                tool_calls=[_call_delta(x) for x in d.calls] or None,
            )
            if c.finished:
                finish = finish_reason(c.finish_reason, op.num_calls > 0)
            if not d and logprobs is None and not c.finished:
                return None
        else:
            if not delta and logprobs is None and not c.finished:
                return None
            msg = DeltaMessage(content=delta) if delta or not c.finished else DeltaMessage()
        return ChatCompletionStreamChoice(
            index=c.index,
            delta=msg,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=c.stop_reason if c.finished else None,
        )


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that ended by itself after calling tools ended for them."""
    return "tool_calls" if called and reason == "stop" else reason


def _call_delta(d: Any) -> dict[str, Any]:
    fn: dict[str, Any] = {"arguments": d.arguments}
    out: dict[str, Any] = {"index": d.index}
    if d.name is not None:
        out.update(id=d.id, type="function")
        fn = {"name": d.name, "arguments": d.arguments}
    out["function"] = fn
    return out


def router(serving: OpenAIServing) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return serving.models()

    @r.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def get_model(model_id: str) -> ModelCard:
        serving.ctx.check_model(model_id)
        return next(m for m in serving.models().data if m.id == model_id)

    @r.post("/v1/completions", response_model=CompletionResponse, responses=STREAM_RESPONSE)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(req, raw)

    @r.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAM_RESPONSE)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(req, raw)

    return r
