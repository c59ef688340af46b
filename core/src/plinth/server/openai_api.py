"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Only OpenAI's protocol is here: reading a request into a ``GenerationSpec``
and rendering the one generation path's events and results
(plinth.server.generation) as OpenAI's chunks and bodies."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response

from plinth.engine.outputs import TokenLogprobs
from plinth.server.errors import APIError
from plinth.server.generation import (
    Done,
    Event,
    Failed,
    GenerationPipeline,
    GenerationSpec,
    Prompt,
    Result,
    Run,
    Started,
)
from plinth.server.generation import Usage as TokenUsage
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
    JSONObject,
    ModelCard,
    ModelList,
    NamedToolChoice,
    PromptTokensDetails,
    ToolCall,
    TopLogprob,
    Usage,
)
from plinth.server.serving import (
    STREAM_RESPONSE,
    ServingContext,
    TemplateMessage,
    TemplateToolCall,
    clamp_logprob,
    now_s,
    random_id,
    sse,
    with_calls,
)
from plinth.server.tools import CallDelta, ToolPlan, arguments_object, make_tools, plan_tools


def chat_messages(messages: list[ChatMessage], param: str = "messages", *, native_tool_calls: bool = True) -> list[TemplateMessage]:
    """OpenAI messages as the chat template expects them (plain text content;
    ``developer`` is the newer name of ``system``; tool-call arguments as
    objects, as templates render them; ``with_calls`` for a template that
    knows no tool calls)."""
    out: list[TemplateMessage] = []
    for m in messages:
        content = m.content
        text = "" if content is None else content if isinstance(content, str) else "\n".join(part.text for part in content)
        msg: TemplateMessage = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls: list[TemplateToolCall] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": arguments_object(c.function.arguments)}}
                for c in m.tool_calls
            ]
            msg = with_calls(msg, calls, native_tool_calls)
        out.append(msg)
    return out


def chat_tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    """A chat request's tools and tool_choice as a plan (what the template shows, what the parser reads)."""
    tools = make_tools(((t.function.name, t.function.description, t.function.parameters) for t in req.tools or []), schema_field="function.parameters")
    mode, named = tool_choice_of(req.tool_choice)
    return plan_tools(tools, mode, named, req.parallel_tool_calls is not False)


def tool_choice_of(choice: Literal["none", "auto", "required"] | NamedToolChoice | None) -> tuple[str | None, str | None]:
    """OpenAI's tool_choice as (mode, function name)."""
    if choice is None or isinstance(choice, str):
        return choice, None
    return "named", choice.function.name


def usage_of(u: TokenUsage) -> Usage:
    return Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
    )


class OpenAIServing:
    def __init__(self, ctx: ServingContext, pipeline: GenerationPipeline) -> None:
        self.ctx = ctx
        self.pipeline = pipeline

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

    def prompt_logprobs(self, ids: list[int], plp: list[TokenLogprobs | None] | None, k: int) -> CompletionLogprobs:
        """The echoed prompt's logprobs (None for the first token and any not computed)."""
        given = list(plp or [])
        return self.completion_logprobs(ids, given + [None] * (len(ids) - len(given)), k, 0)

    # ---- /v1/models -------------------------------------------------------------------

    def models(self) -> ModelList:
        root = self.ctx.engine.describe().get("model")
        return ModelList(
            data=[ModelCard(id=name, root=root, max_model_len=self.ctx.engine.max_model_len) for name in self.ctx.settings.served_model_names]
        )

    # ---- /v1/completions ---------------------------------------------------------------

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.ctx.check_model(req.model)
        spec = GenerationSpec(
            request_id=random_id("cmpl-"),
            params=req.sampling_params(),
            prompts=req.prompts(),
            prompt_param="prompt",
            response_format=req.response_format,
            guided_json=req.guided_json,
            guided_regex=req.guided_regex,
            reasoning=False,  # completions are raw text
        )
        run = await self.pipeline.start(spec)
        rid, created = spec.request_id, now_s()
        return await self.pipeline.respond(
            raw,
            run,
            stream=req.stream,
            renderer=lambda: _CompletionStream(self, req, rid, created, model, run),
            body=lambda result: self._completion_response(req, rid, created, model, result),
        )

    def echo_prefix(self, prompt: Prompt) -> str:
        return prompt.text if prompt.text is not None else self.ctx.tokenizer.decode(prompt.ids, skip_special_tokens=False)

    def _completion_response(self, req: CompletionRequest, rid: str, created: int, model: str, result: Result) -> CompletionResponse:
        choices = []
        for c in result.choices:
            p = result.prompts[c.prompt_index]
            text = c.text
            logprobs = None
            if req.echo:
                text = self.echo_prefix(Prompt(p.text, p.token_ids)) + text
            if req.logprobs is not None:
                ids: list[int] = []
                lps: list[TokenLogprobs | None] = []
                if req.echo:
                    ids += p.token_ids
                    plp = list(p.prompt_logprobs or [])
                    lps += plp + [None] * (len(ids) - len(plp))
                ids += c.token_ids
                lps += list(c.logprobs or [])
                logprobs = self.completion_logprobs(ids, lps, req.logprobs, 0)
            choices.append(
                CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            )
        return CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=usage_of(result.usage))

    # ---- /v1/chat/completions -------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        if req.max_completion_tokens is not None and req.max_tokens is not None and req.max_tokens > ctx.engine.max_model_len:
            # max_completion_tokens is the one used; max_tokens still has the document's bound
            raise APIError(
                400, f"max_tokens {req.max_tokens} is beyond the context length, {ctx.engine.max_model_len}", param="max_tokens", code="context_length_exceeded"
            )
        spec = GenerationSpec(
            request_id=random_id("chatcmpl-"),
            params=req.sampling_params(),
            messages=chat_messages(req.messages, native_tool_calls=ctx.native_tool_calls),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_kwargs=req.chat_template_kwargs,
            response_format=req.response_format,
            guided_json=req.guided_json,
            guided_regex=req.guided_regex,
            plan=chat_tool_plan(req),
        )
        run = await self.pipeline.start(spec)
        rid, created = spec.request_id, now_s()
        return await self.pipeline.respond(
            raw,
            run,
            stream=req.stream,
            renderer=lambda: _ChatStream(self, req, rid, created, model),
            body=lambda result: self._chat_response(req, rid, created, model, result),
        )

    def _chat_response(self, req: ChatCompletionRequest, rid: str, created: int, model: str, result: Result) -> ChatCompletionResponse:
        k = req.top_logprobs or 0
        choices = []
        for c in result.choices:
            calls = [ToolCall(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments)) for t in c.calls]
            message = ChatResponseMessage(
                content=c.content if c.content or not calls else None, reasoning_content=c.reasoning, tool_calls=calls
            )
            choices.append(
                ChatCompletionChoice(
                    index=c.index,
                    message=message,
                    logprobs=self.chat_logprobs(c.logprobs or [], k) if req.logprobs else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices, usage=usage_of(result.usage))


class _CompletionStream:
    """/v1/completions chunks: the echoed prompt first, then text with its logprobs."""

    def __init__(self, serving: OpenAIServing, req: CompletionRequest, rid: str, created: int, model: str, run: Run) -> None:
        self.serving, self.req, self.rid, self.created, self.model, self.run = serving, req, rid, created, model, run
        self.offsets: dict[int, int] = {}  # choice -> text offset of its next token
        self.started: dict[int, Started] = {}  # prompt -> its first output's prompt details

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse(CompletionStreamResponse(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage).model_dump_json())

    def start(self) -> Iterable[str]:
        return ()

    def event(self, ev: Event) -> Iterable[str]:
        req = self.req
        if isinstance(ev, Started):
            self.started[ev.prompt_index] = ev
            return ()
        if isinstance(ev, Failed):
            return [sse(json.dumps(ev.error.openai_body()))]
        if isinstance(ev, Done):
            if req.stream_options and req.stream_options.include_usage:
                return [self._chunk([], usage_of(ev.usage))]
            return ()
        choices: list[CompletionChoice] = []
        if ev.index not in self.offsets:
            self.offsets[ev.index] = 0
            if req.echo:
                prefix = self.serving.echo_prefix(self.run.prompts[ev.prompt_index])
                lp = None
                if req.logprobs is not None:
                    st = self.started[ev.prompt_index]
                    lp = self.serving.prompt_logprobs(st.prompt_token_ids, st.prompt_logprobs, req.logprobs)
                self.offsets[ev.index] = len(prefix)
                choices.append(CompletionChoice(index=ev.index, text=prefix, logprobs=lp))
        lp = None
        if req.logprobs is not None and ev.token_ids:
            lp = self.serving.completion_logprobs(ev.token_ids, list(ev.logprobs or []), req.logprobs, self.offsets[ev.index])
            self.offsets[ev.index] += sum(self.serving.ctx.text_width(t) for t in ev.token_ids)
        if ev.content or lp is not None or ev.finish_reason:
            choices.append(
                CompletionChoice(index=ev.index, text=ev.content, logprobs=lp, finish_reason=ev.finish_reason, stop_reason=ev.stop_reason)
            )
        return [self._chunk(choices)] if choices else ()

    def end(self) -> Iterable[str]:
        return [sse("[DONE]")]


class _ChatStream:
    """/v1/chat/completions chunks: the role first, then content, reasoning and
    tool-call pieces with their logprobs; finish_reason on a choice's last."""

    def __init__(self, serving: OpenAIServing, req: ChatCompletionRequest, rid: str, created: int, model: str) -> None:
        self.serving, self.req, self.rid, self.created, self.model = serving, req, rid, created, model

    def _chunk(self, choices: list[ChatCompletionStreamChoice], usage: Usage | None = None) -> str:
        return sse(
            ChatCompletionStreamResponse(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage).model_dump_json()
        )

    def start(self) -> Iterable[str]:
        # the role first, for every choice, as OpenAI does
        return [self._chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(self.req.n)])]

    def event(self, ev: Event) -> Iterable[str]:
        req = self.req
        if isinstance(ev, Started):
            return ()
        if isinstance(ev, Failed):
            return [sse(json.dumps(ev.error.openai_body()))]
        if isinstance(ev, Done):
            if req.stream_options and req.stream_options.include_usage:
                return [self._chunk([], usage_of(ev.usage))]
            return ()
        logprobs = self.serving.chat_logprobs(list(ev.logprobs or []), req.top_logprobs or 0) if req.logprobs and ev.token_ids else None
        if not (ev.reasoning or ev.content or ev.calls or logprobs is not None or ev.finish_reason):
            return ()
        msg = DeltaMessage(
            content=ev.content or None,
            reasoning_content=ev.reasoning or None,
            tool_calls=[_call_delta(x) for x in ev.calls] or None,
        )
        choice = ChatCompletionStreamChoice(
            index=ev.index, delta=msg, logprobs=logprobs, finish_reason=ev.finish_reason, stop_reason=ev.stop_reason
        )
        return [self._chunk([choice])]

    def end(self) -> Iterable[str]:
        return [sse("[DONE]")]


def _call_delta(d: CallDelta) -> JSONObject:
    fn: JSONObject = {"arguments": d.arguments}
    out: JSONObject = {"index": d.index}
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
