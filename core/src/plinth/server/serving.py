"""What the routes share: the served model, prompts and chat messages,
structured output, and running a request on the engine with its errors
answered before the first byte and its pages freed when the client leaves.
The generation path built from these is plinth.server.generation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict, TypeVar

import anyio
from pydantic import JsonValue
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from plinth.engine.interfaces import EngineClient
from plinth.engine.outputs import RequestOutput
from plinth.engine.sampling_params import SamplingParams
from plinth.errors import PlinthError, RequestError
from plinth.server.errors import APIError, engine_exception
from plinth.server.metrics import RequestTracker, ServerMetrics
from plinth.server.protocol import JSONObject
from plinth.server.tools import OutputParser, ToolPlan
from plinth.tokenizer import Tokenizer

if TYPE_CHECKING:
    from plinth.engine.grammar import GrammarState
    from plinth.plugins import PluginRegistry
    from plinth.server.structured import GrammarCompiler

T = TypeVar("T")


@dataclass
class ServerSettings:
    """Server options (``platform serve`` flags)."""

    served_model_names: list[str]
    api_key: str | None = None
    max_request_body_bytes: int = 16 << 20
    enable_metrics: bool = True
    #: serve vLLM's metric names beside plinth's (llm-d's scorers read them)
    vllm_metric_names: bool = True
    retry_after_s: int = 1
    #: parser names (``--tool-call-parser``, ``--reasoning-parser``): a
    #: registered name, "auto" (from the chat template) or "none"
    tool_call_parser: str | None = "auto"
    reasoning_parser: str | None = "auto"
    #: the plugin registry to find parsers in (discovered when needed and not given)
    registry: PluginRegistry | None = None


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


def random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def encode_text(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
    """A prompt's token ids, as every route (and `platform router`) computes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800") in the JSON
        raise APIError.bad_request(f"the text is not valid Unicode: {exc.reason} at {exc.start}", param=param) from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


class TemplateFunction(TypedDict):
    name: str
    arguments: JSONObject  # as templates render them: an object, not JSON text


class TemplateToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: TemplateFunction


class _Turn(TypedDict):
    role: str
    content: str


class TemplateMessage(_Turn, total=False):
    """A chat message as chat templates take it."""

    name: str
    tool_call_id: str
    tool_calls: list[TemplateToolCall]


def with_calls(msg: TemplateMessage, calls: list[TemplateToolCall], native: bool) -> TemplateMessage:
    """An assistant message with its tool calls: as ``tool_calls`` for a
    template that renders them, else as JSON lines after its text, so the
    model still sees what it called."""
    if native:
        return {**msg, "tool_calls": calls}
    shown = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}) for c in calls)
    return {**msg, "content": f"{msg['content']}\n{shown}" if msg["content"] else shown}


def render_chat(
    tokenizer: Tokenizer,
    messages: list[TemplateMessage],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: JSONObject | None = None,
    tools: list[JSONObject] | None = None,
) -> tuple[str, list[int]]:
    """The chat template applied to ``messages``: (text, token ids). One
    function for the server and `platform router`, so the router's block
    hashes are the replicas'. ``continue_final_message``: the text ends where
    the last message's content does (as transformers' option), so the model
    continues it."""
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools or None, **(template_kwargs or {})
        )
    except PlinthError as exc:  # e.g. a model without a chat template
        raise APIError.bad_request(f"{exc}; use /v1/completions with a plain prompt", param="messages") from None
    except TypeError as exc:
        if template_kwargs:
            raise APIError.bad_request(f"chat_template_kwargs: {exc}", param="chat_template_kwargs") from None
        raise
    except (ValueError, KeyError) as exc:
        raise APIError.bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None
    except Exception as exc:  # jinja2 errors (raise_exception in a template) and the like
        if type(exc).__module__.startswith("jinja2"):
            raise APIError.bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None
        raise
    if continue_final_message and messages:
        final = messages[-1]["content"].strip()
        if final not in text:
            raise APIError.bad_request(
                "continue_final_message: the chat template does not show the last message's content", param="messages"
            )
        text = text[: text.rindex(final) + len(final)]
    return text, encode_text(tokenizer, text, add_special_tokens=False, param="messages")


# ---------------------------------------------------------------------------
# the context of one app
# ---------------------------------------------------------------------------


class ServingContext:
    """The engine and everything derived from it, shared by the routes of one app."""

    def __init__(self, engine: EngineClient, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.tokenizer
        self.model_name = settings.served_model_names[0]
        self.metrics = ServerMetrics(engine, self.model_name, vllm_names=settings.vllm_metric_names) if settings.enable_metrics else None
        self._grammars: GrammarCompiler | None = None
        self._token_strs: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        self._text_widths: dict[int, int] = {}
        self.tool_parser_cls, self.reasoning_parser_cls = self._resolve_parsers()

    def _resolve_parsers(self) -> tuple[type | None, type | None]:
        """Once, at start-up: a named parser that cannot load stops start-up."""
        from plinth.server.tools import resolve_parser

        s = self.settings
        template = getattr(self.tokenizer, "chat_template", None)
        wanted = [(c, n) for c, n in (("tool_parser", s.tool_call_parser), ("reasoning_parser", s.reasoning_parser))]
        if all(not n or n == "none" or (n == "auto" and not template) for _, n in wanted):
            return None, None
        if s.registry is None:
            from plinth.plugins import PluginRegistry

            s.registry = PluginRegistry.discover()
        tool_cls, reasoning_cls = (resolve_parser(s.registry, c, n, template) for c, n in wanted)
        return tool_cls, reasoning_cls

    def output_parser(self, plan: ToolPlan | None, prompt: str, *, reasoning: bool = True, id_prefix: str = "call_") -> OutputParser:
        """The per-choice reader of reasoning and tool calls for a request."""
        from plinth.server.tools import OutputParser

        tools = plan.parser(self.tool_parser_cls) if plan is not None else None
        rp = self.reasoning_parser_cls(prompt) if reasoning and self.reasoning_parser_cls is not None else None
        return OutputParser(tools, rp, id_prefix)

    @property
    def native_tool_calls(self) -> bool:
        """Whether the chat template renders an assistant's tool_calls itself."""
        return "tool_calls" in (getattr(self.tokenizer, "chat_template", None) or "")

    def needs_special_tokens(self, plan: ToolPlan | None) -> bool:
        """Formats whose markers are special tokens need them kept in the text."""
        return plan is not None and plan.mode == "auto" and bool(getattr(self.tool_parser_cls, "needs_special_tokens", False))

    # ---- model names ---------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        """The name to report back; 404 for a model this server does not serve."""
        if name is None or name == "":
            return self.model_name
        if name not in self.settings.served_model_names:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {', '.join(map(repr, self.settings.served_model_names))}",
                param="model",
                code="model_not_found",
            )
        return name

    # ---- prompts -------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        return encode_text(self.tokenizer, text, add_special_tokens=add_special_tokens, param=param)

    def chat_prompt(
        self,
        messages: list[TemplateMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: JSONObject | None = None,
        tools: list[JSONObject] | None = None,
    ) -> tuple[str, list[int]]:
        """The chat template applied to ``messages``: (text, token ids)."""
        return render_chat(
            self.tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
            tools=tools,
        )

    def token_str(self, token_id: int) -> str:
        """One token as text (for logprobs); a piece of a multi-byte character
        shows as U+FFFD, its ``token_bytes`` are exact."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_strs[token_id] = s
        return s

    def text_width(self, token_id: int) -> int:
        """How many characters a token adds to text decoded without special
        tokens (0 for BOS and the like): what ``text_offset`` counts."""
        w = self._text_widths.get(token_id)
        if w is None:
            w = len(self.tokenizer.decode([token_id], skip_special_tokens=True))
            self._text_widths[token_id] = w
        return w

    def token_bytes(self, token_id: int) -> list[int]:
        """The UTF-8 bytes one token stands for, from its vocabulary spelling
        where the tokenizer tells it (byte-level 'Ġ...', byte-fallback '<0xE2>')."""
        b = self._token_bytes.get(token_id)
        if b is None:
            b = _piece_bytes(self.tokenizer, token_id)
            if b is None:
                b = self.token_str(token_id).encode("utf-8")
            self._token_bytes[token_id] = b
        return list(b)

    def check_prompt_ids(self, ids: Sequence[int], param: str = "prompt") -> list[int]:
        vocab = self.engine.model_config.vocab_size
        out = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise APIError.bad_request(f"token id {t!r} is outside the vocabulary [0, {vocab})", param=param)
            out.append(t)
        return out

    # ---- structured output -----------------------------------------------------------

    @property
    def grammars(self) -> GrammarCompiler:
        if self._grammars is None:
            from plinth.server.structured import GrammarCompiler

            eos = set(getattr(self.tokenizer, "eos_token_ids", ()) or ())
            eos.update(getattr(self.engine.model_config, "eos_token_ids", ()) or ())
            self._grammars = GrammarCompiler(self.tokenizer, self.engine.model_config.vocab_size, sorted(eos))
        return self._grammars

    async def grammar(
        self,
        response_format: JSONObject | None = None,
        guided_json: JSONObject | None = None,
        guided_regex: str | None = None,
        *,
        forced: tuple[str, JsonValue] | None = None,
    ) -> GrammarState | None:
        """A fresh grammar state for the request's structured-output fields, or None.
        forced: a ``(kind, spec)`` a tool choice imposes (it excludes the others)."""
        from plinth.server.structured import normalize

        try:
            spec = normalize(response_format, guided_json, guided_regex)
            if forced is not None:
                if spec is not None:
                    raise APIError.bad_request(
                        "a required or named tool choice cannot be combined with response_format or guided_*",
                        param="tool_choice",
                    )
                spec = forced
            if spec is None:
                return None
            compiler = self.grammars
            # compiling can take a while: off the event loop (cache hits are quick either way)
            return await asyncio.to_thread(compiler.state, *spec)
        except RequestError as exc:
            raise APIError.from_request_error(exc) from None

    # ---- running ---------------------------------------------------------------------

    def tracker(self) -> RequestTracker:
        return RequestTracker(self.metrics)

    async def start(self, prompt_ids: list[int], params: SamplingParams, request_id: str, prompt: str | None) -> Generation:
        """Submit a request; bad input and a full queue raise APIError here,
        before any response byte is sent."""
        gen = self.engine.generate(prompt_ids, params, request_id=request_id, prompt=prompt)
        first = asyncio.ensure_future(gen.__anext__())
        # one turn of the loop runs generate() up to its first wait: it has
        # validated the request and checked the queue by then
        await asyncio.sleep(0)
        exc = first.exception() if first.done() and not first.cancelled() else None
        if exc is not None:
            await gen.aclose()
            err = engine_exception(exc)
            if err.status == 503:
                err.headers["Retry-After"] = str(self.settings.retry_after_s)
            raise err
        return Generation(gen, first, self.tracker())


_BYTE_DECODER: dict[str, int] | None = None
_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _piece_bytes(tokenizer: Tokenizer, token_id: int) -> bytes | None:
    global _BYTE_DECODER
    to_piece = getattr(tokenizer, "id_to_piece", None)
    kind = str(getattr(tokenizer, "vocab_type", "raw"))
    if to_piece is None or token_id in getattr(tokenizer, "special_token_ids", ()):
        return None
    try:
        piece = to_piece(token_id)
    except Exception:
        return None
    if kind == "byte_level":
        if _BYTE_DECODER is None:
            from plinth.tokenizer import bytes_to_unicode

            _BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}
        if all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        return None
    if kind == "byte_fallback":
        m = _HEX_BYTE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")
    return None


class Generation:
    """A started engine request: iterate its outputs (with their deltas) once."""

    def __init__(self, gen: AsyncGenerator[RequestOutput, None], first: asyncio.Future[RequestOutput], tracker: RequestTracker) -> None:
        self.gen = gen
        self.first = first
        self.tracker = tracker
        self.last: RequestOutput | None = None

    async def outputs(self) -> AsyncGenerator[RequestOutput, None]:
        reason: str | None = "abort"
        try:
            try:
                out = await self.first
            except StopAsyncIteration:
                return
            while True:
                self.last = out
                self.tracker.observe(out)
                if out.finished:
                    reason = out.outputs[0].finish_reason if out.outputs else "abort"
                yield out
                if out.finished:
                    return
                try:
                    out = await self.gen.__anext__()
                except StopAsyncIteration:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            if self.last is None or not self.last.finished:
                reason = "abort"
            raise
        except BaseException:
            reason = None
            raise
        finally:
            self.tracker.finish(reason)
            if not self.first.done():
                self.first.cancel()  # its task closes the engine's generator: the request is aborted
            else:
                await self.gen.aclose()  # aborts the request if it had not finished

    def close_nowait(self) -> None:
        """Abort the request if it is still running (for one never iterated,
        or a stream whose body never started)."""
        if not self.first.done():
            self.first.cancel()
        else:
            asyncio.ensure_future(_quiet_aclose(self.gen))


async def _quiet_aclose(agen: AsyncGenerator[RequestOutput, None]) -> None:
    with contextlib.suppress(Exception):
        await agen.aclose()


async def merged(gens: list[Generation]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Outputs of several requests as they come: (request index, output)."""
    if len(gens) == 1:
        agen = gens[0].outputs()
        try:
            async for out in agen:
                yield 0, out
        finally:
            await agen.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for out in g.outputs():
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` unless the client leaves first, in which case cancel it
    (which aborts its engine requests) and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientDisconnected()


class SSEResponse(StreamingResponse):
    """A server-sent-event stream whose body iterator is always closed, also
    when the client disconnects mid-stream (so the engine request is aborted
    and its pages freed at once, not when the iterator is garbage collected)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], *, generations: Sequence[Generation] = ()) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generations = list(generations)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                for g in self.generations:  # a body that never started never closed them
                    g.close_nowait()


#: the OpenAPI description of a route's streamed answer (``stream: true``)
STREAM_RESPONSE: dict[int | str, JSONObject] = {
    200: {
        "content": {
            # OpenAPI 3.1: the schema of one event (its data is a JSON chunk, or [DONE])
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}},
                }
            }
        },
        "description": "JSON, or with stream: true server-sent events",
    }
}


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def sse_event(event: str, data: str) -> str:
    return f"event: {event}\ndata: {data}\n\n"


def clamp_logprob(v: float) -> float:
    return v if v > -9999.0 else -9999.0
