"""The one generation path behind /v1/completions, /v1/chat/completions,
/v1/responses and /v1/messages.

A route reads its protocol's request into a :class:`GenerationSpec` and
hands it to :meth:`GenerationPipeline.start`, which does everything else the
same way for every protocol: the prompt (chat template or plain prompts),
the grammar (structured output and forced tool calls), the sampling
parameters, submission to the engine (bad input and a full queue are answered
before the first byte), and then either

- ``Run.events()``: protocol-neutral events (:class:`Started`,
  :class:`ChoiceDelta` with reasoning, answer text and tool-call pieces,
  :class:`Done` with the usage, :class:`Failed`) that a route's
  :class:`StreamRenderer` turns into its server-sent events, or
- ``Run.result()``: the finished choices, parsed, that a route turns into its
  JSON body;

and :meth:`GenerationPipeline.respond` answers with one or the other, so a
client that disconnects, mid-stream or while waiting, aborts its engine
requests and frees their pages on every route alike.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.requests import Request

from plinth.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from plinth.engine.sampling_params import SamplingParams
from plinth.server.errors import APIError, engine_exception
from plinth.server.protocol import JSONObject
from plinth.server.serving import (
    ClientDisconnected,
    Generation,
    ServingContext,
    SSEResponse,
    TemplateMessage,
    merged,
    until_disconnect,
)
from plinth.server.tools import CallDelta, OutputParser, ToolPlan, template_tools

# ---------------------------------------------------------------------------
# what a route asks for
# ---------------------------------------------------------------------------


@dataclass
class GenerationSpec:
    """One generation request, whatever protocol it came in."""

    request_id: str
    #: the request's sampling options, checked (the protocol model made them)
    params: SamplingParams
    #: the prompt: chat messages for the template (chat, Responses, Anthropic) ...
    messages: list[TemplateMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: JSONObject | None = None
    #: ... or prompts as given (completions: each a string or token ids, each one engine request)
    prompts: list[str | list[int]] | None = None
    #: the request field that holds the prompt, for error messages
    prompt_param: str = "messages"
    #: structured output (OpenAI's response_format, vLLM's guided_*)
    response_format: JSONObject | None = None
    guided_json: JSONObject | None = None
    guided_regex: str | None = None
    #: tools: what is rendered into the template, how calls are read, what grammar forces one
    plan: ToolPlan | None = None
    #: split reasoning from the answer (when the server has a reasoning parser)
    reasoning: bool = True
    call_id_prefix: str = "call_"


# ---------------------------------------------------------------------------
# what a stream is made of
# ---------------------------------------------------------------------------


@dataclass
class Started:
    """An engine request's first output: its prompt is in (prefilled)."""

    prompt_index: int
    prompt_tokens: int
    cached_tokens: int
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None


@dataclass
class ChoiceDelta:
    """What one choice added since its last delta."""

    index: int  # prompt_index * n + sample
    prompt_index: int
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    #: set on the choice's last delta: stop | length | tool_calls | abort | error
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens: int = 0  # output tokens so far


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Done:
    """Every choice finished."""

    usage: Usage


@dataclass
class Failed:
    """The engine failed after the stream started: the stream's last event."""

    error: APIError


Event = Started | ChoiceDelta | Done | Failed


class StreamRenderer(Protocol):
    """A protocol's server-sent events for one run."""

    def start(self) -> Iterable[str]:
        """Before anything from the engine."""
        ...

    def event(self, ev: Event) -> Iterable[str]:
        """For each event, in order."""
        ...

    def end(self) -> Iterable[str]:
        """After the last event (``Done`` or ``Failed``)."""
        ...


# ---------------------------------------------------------------------------
# what an answer is made of
# ---------------------------------------------------------------------------


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ChoiceResult:
    index: int
    prompt_index: int
    text: str  # the raw output
    reasoning: str | None
    content: str
    calls: list[ParsedCall]
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None  # as in ChoiceDelta
    stop_reason: int | str | None


@dataclass
class PromptResult:
    text: str | None
    token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    cached_tokens: int


@dataclass
class Result:
    choices: list[ChoiceResult]  # by index
    prompts: list[PromptResult]
    usage: Usage


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that ended by itself after calling tools ended for them."""
    return "tool_calls" if called and reason == "stop" else reason


# ---------------------------------------------------------------------------
# a started request
# ---------------------------------------------------------------------------


@dataclass
class Prompt:
    text: str | None
    ids: list[int]


class _Choice:
    """One choice while it streams: the visible text so far and its parser."""

    __slots__ = ("parser", "text", "finished")

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.text = ""
        self.finished = False

    def step(self, index: int, prompt_index: int, c: CompletionOutput) -> ChoiceDelta | None:
        self.text += c.delta_text
        op = self.parser
        if op.active:
            # the parsers read everything shown so far (a held-back stop-string prefix is not shown)
            d = op.delta(self.text, final=c.finished)
            reasoning, content, calls = d.reasoning, d.content, d.calls
        else:
            reasoning, content, calls = "", c.delta_text, []
        finish = None
        if c.finished:
            self.finished = True
            finish = finish_reason(c.finish_reason, op.num_calls > 0)
        if not (reasoning or content or calls or c.delta_token_ids or c.finished):
            return None
        return ChoiceDelta(
            index=index,
            prompt_index=prompt_index,
            reasoning=reasoning,
            content=content,
            calls=calls,
            token_ids=list(c.delta_token_ids),
            logprobs=c.delta_logprobs,
            finish_reason=finish,
            stop_reason=c.stop_reason if c.finished else None,
            num_tokens=len(c.token_ids),
        )


class Run:
    """A generation on the engine: its events, or its result; read one, once."""

    def __init__(self, prompts: list[Prompt], gens: list[Generation], parsers: list[list[OutputParser]], n: int) -> None:
        self.prompts = prompts
        self.gens = gens
        self.parsers = parsers
        self.n = n

    @property
    def parsing(self) -> bool:
        """Whether reasoning or tool calls are read out of the text."""
        return self.parsers[0][0].active

    async def events(self) -> AsyncGenerator[Event, None]:
        choices = {p * self.n + i: _Choice(op) for p, ops in enumerate(self.parsers) for i, op in enumerate(ops)}
        usage: dict[int, tuple[int, int, int]] = {}  # prompt -> (prompt tokens, output tokens, cached)
        stream = merged(self.gens)
        try:
            async for p, out in stream:
                if p not in usage:
                    yield Started(p, len(out.prompt_token_ids), out.num_cached_tokens, list(out.prompt_token_ids), out.prompt_logprobs)
                usage[p] = (len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)
                for c in out.outputs:
                    index = p * self.n + c.index
                    ch = choices[index]
                    if ch.finished:
                        continue
                    ev = ch.step(index, p, c)
                    if ev is not None:
                        yield ev
            yield Done(Usage(*(sum(u[k] for u in usage.values()) for k in range(3))))
        except Exception as exc:
            yield Failed(engine_exception(exc))
        finally:
            await stream.aclose()

    async def result(self) -> Result:
        finals: dict[int, RequestOutput] = {}
        try:
            async for p, out in merged(self.gens):
                finals[p] = out
        except Exception as exc:
            raise engine_exception(exc) from None
        if len(finals) < len(self.gens):
            raise APIError(503, "the engine stopped before answering", code="overloaded")
        choices: list[ChoiceResult] = []
        prompts: list[PromptResult] = []
        usage = Usage()
        for p, prompt in enumerate(self.prompts):
            out = finals[p]
            prompts.append(PromptResult(prompt.text, list(out.prompt_token_ids), out.prompt_logprobs, out.num_cached_tokens))
            usage.prompt_tokens += len(out.prompt_token_ids)
            usage.cached_tokens += out.num_cached_tokens
            for c in out.outputs:
                usage.completion_tokens += len(c.token_ids)
                choices.append(self._choice(p, c, self.parsers[p][c.index]))
        choices.sort(key=lambda c: c.index)
        return Result(choices, prompts, usage)

    def _choice(self, p: int, c: CompletionOutput, op: OutputParser) -> ChoiceResult:
        reasoning, content, calls = None, c.text, []
        if op.active:
            parsed = op.parse(c.text, final=True)
            reasoning, content = parsed.reasoning or None, parsed.content
            ids = op.call_ids(parsed.calls)
            calls = [ParsedCall(i, t.name, t.arguments) for i, t in zip(ids, parsed.calls, strict=True)]
        return ChoiceResult(
            index=p * self.n + c.index,
            prompt_index=p,
            text=c.text,
            reasoning=reasoning,
            content=content,
            calls=calls,
            token_ids=list(c.token_ids),
            logprobs=c.logprobs,
            finish_reason=finish_reason(c.finish_reason, bool(calls)),
            stop_reason=c.stop_reason,
        )

    async def sse(self, renderer: StreamRenderer) -> AsyncGenerator[str, None]:
        events = self.events()
        try:
            for chunk in renderer.start():
                yield chunk
            async for ev in events:
                for chunk in renderer.event(ev):
                    yield chunk
            for chunk in renderer.end():
                yield chunk
        finally:
            await events.aclose()


# ---------------------------------------------------------------------------
# the pipeline
# ---------------------------------------------------------------------------


class GenerationPipeline:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def chat_prompt(
        self,
        messages: list[TemplateMessage],
        plan: ToolPlan | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: JSONObject | None = None,
        param: str = "messages",
    ) -> Prompt:
        """The chat template over ``messages`` (and the plan's tools)."""
        tools = template_tools(plan.tools) if plan is not None and plan.tools else None
        text, ids = self.ctx.chat_prompt(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
            tools=tools,
        )
        if not ids:
            raise APIError.bad_request("the chat template made an empty prompt", param=param)
        return Prompt(text, ids)

    def _prompts(self, spec: GenerationSpec) -> list[Prompt]:
        ctx = self.ctx
        if spec.messages is not None:
            return [
                self.chat_prompt(
                    spec.messages,
                    spec.plan,
                    add_generation_prompt=spec.add_generation_prompt,
                    continue_final_message=spec.continue_final_message,
                    template_kwargs=spec.template_kwargs,
                    param=spec.prompt_param,
                )
            ]
        if not spec.prompts:
            raise APIError.bad_request(f"{spec.prompt_param} must not be empty", param=spec.prompt_param)
        out = []
        for i, p in enumerate(spec.prompts):
            prompt = Prompt(p, ctx.encode(p, param=spec.prompt_param)) if isinstance(p, str) else Prompt(None, ctx.check_prompt_ids(p, spec.prompt_param))
            if not prompt.ids:
                raise APIError.bad_request(f"{spec.prompt_param} {i} is empty", param=spec.prompt_param)
            out.append(prompt)
        return out

    async def start(self, spec: GenerationSpec) -> Run:
        """Build and submit the request; every error it can be answered with
        (bad input, context length, a full queue) is raised here, as APIError."""
        ctx = self.ctx
        plan = spec.plan
        prompts = self._prompts(spec)
        grammar = await ctx.grammar(
            spec.response_format, spec.guided_json, spec.guided_regex, forced=plan.grammar if plan is not None else None
        )
        # the format's markers are special tokens: keep them in the text
        skip_special = spec.params.skip_special_tokens and not ctx.needs_special_tokens(plan)
        gens: list[Generation] = []
        try:
            for i, prompt in enumerate(prompts):
                # each engine request its own grammar state
                state = None if grammar is None else grammar if i == 0 else grammar.fork()
                params = replace(spec.params, grammar=state, skip_special_tokens=skip_special)
                rid = spec.request_id if len(prompts) == 1 else f"{spec.request_id}-{i}"
                gens.append(await ctx.start(prompt.ids, params, rid, prompt.text))
        except BaseException:
            for g in gens:
                g.close_nowait()
            raise
        n = spec.params.n
        parsers = [
            [ctx.output_parser(plan, p.text or "", reasoning=spec.reasoning, id_prefix=spec.call_id_prefix) for _ in range(n)]
            for p in prompts
        ]
        return Run(prompts, gens, parsers, n)

    async def respond(
        self,
        raw: Request,
        run: Run,
        *,
        stream: bool,
        renderer: Callable[[], StreamRenderer],
        body: Callable[[Result], BaseModel],
    ) -> Response:
        """The answer: server-sent events, or the JSON body once finished. A
        client that leaves aborts the run (its pages are freed at once)."""
        if stream:
            return SSEResponse(run.sse(renderer()), generations=run.gens)
        try:
            result = await until_disconnect(raw, run.result())
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(body(result).model_dump())
