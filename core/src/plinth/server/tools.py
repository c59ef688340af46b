"""Tool calls and reasoning, for every route: which parsers a request uses,
how ``required`` / named tool choices are enforced, and how streamed output
turns into reasoning, answer and tool-call deltas.

The parsers are plugins (``plinth.api.ToolParser`` and
``ReasoningParser``), resolved once at start-up by name or from the chat
template. Forcing a call (OpenAI ``required`` or a named function, Anthropic
``any`` or ``tool``) does not depend on the model's own format: the grammar
makes the model write JSON, and the parsers here read it (vLLM does the same):

- a named function: the arguments object itself, valid against its schema;
- required: ``[{"name": ..., "parameters": {...}}, ...]``, each item valid
  against one tool's schema (one item when parallel calls are off).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import JsonValue

from plinth.api import ReasoningParser, SelectionContext, ToolCallItem, ToolParse, ToolParser
from plinth.errors import PluginError
from plinth.parsing import INVALID, read_json_arguments, read_json_call, skip_ws
from plinth.server.errors import APIError
from plinth.server.protocol import JSONObject

if TYPE_CHECKING:
    from plinth.plugins import PluginRegistry

log = logging.getLogger("plinth.server")


def call_id(prefix: str = "call_") -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------
# start-up: which parsers
# ---------------------------------------------------------------------------


def resolve_parser(registry: PluginRegistry, category: str, name: str | None, chat_template: str | None) -> type | None:
    """The parser class for ``--tool-call-parser`` / ``--reasoning-parser``:
    a name (it must load, or start-up fails with every candidate's reasons),
    ``auto`` (the highest-priority one whose template markers the chat
    template contains; none is fine), or ``none``/None."""
    if not name or name == "none":
        return None
    if name != "auto":
        return registry.select(category, name, SelectionContext()).load()
    if not chat_template:
        return None
    for entry in sorted(registry.entries[category], key=lambda e: (-e.descriptor.priority, e.name)):
        markers = getattr(entry.descriptor, "template_markers", ())
        if any(m in chat_template for m in markers):
            try:
                cls = entry.load()
            except PluginError as exc:  # shown, not silently skipped
                log.warning("%s %s matches the chat template but cannot load: %s", category, entry.name, exc)
                raise
            log.info("%s: auto chose %s (its markers are in the chat template)", category, entry.label())
            return cls
    return None


# ---------------------------------------------------------------------------
# tools and tool_choice
# ---------------------------------------------------------------------------


@dataclass
class Tool:
    name: str
    description: str | None
    parameters: JSONObject


@dataclass
class ToolPlan:
    """What a request asks of tools: the tools, how calls are read, and the
    grammar that forces one (None: free text)."""

    tools: list[Tool] = field(default_factory=list)
    mode: str = "none"  # none | auto | required | named
    named: str | None = None
    parallel: bool = True
    grammar: tuple[str, JsonValue] | None = None  # (kind, spec) for the structured-output compiler

    def parser(self, auto_cls: type | None) -> ToolParser | None:
        if self.mode == "named":
            return NamedFunctionParser(self.named or "")
        if self.mode == "required":
            return RequiredCallsParser()
        if self.mode == "auto" and auto_cls is not None:
            return auto_cls([{"type": "function", "function": t.__dict__} for t in self.tools])
        return None


def _check_schema(schema: JSONObject | None, param: str) -> JSONObject:
    from plinth.errors import RequestError
    from plinth.server.structured import check_json_schema

    if schema is None:
        return {"type": "object", "properties": {}}
    try:
        check_json_schema(schema, param)
    except RequestError as exc:
        raise APIError.from_request_error(exc) from None
    if schema is True or schema == {}:
        return {"type": "object"}
    return schema


def plan_tools(
    tools: list[Tool],
    choice: str | None,
    named: str | None,
    parallel: bool,
    *,
    param: str = "tool_choice",
) -> ToolPlan:
    """choice: auto | none | required | named (None: auto when there are tools)."""
    if not tools:
        if choice in ("required", "named"):
            raise APIError.bad_request(f"{param} needs tools", param=param)
        return ToolPlan()
    mode = choice or "auto"
    plan = ToolPlan(tools=tools, mode=mode, named=named, parallel=parallel)
    if mode == "named":
        tool = next((t for t in tools if t.name == named), None)
        if tool is None:
            raise APIError.bad_request(
                f"{param} names {named!r}, which is not among the tools ({', '.join(t.name for t in tools)})", param=param
            )
        plan.grammar = ("json_schema", tool.parameters)
    elif mode == "required":
        items: list[JsonValue] = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        array: JSONObject = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        plan.grammar = ("json_schema", array)
    return plan


def make_tools(specs: Iterable[tuple[str, str | None, JSONObject | None]], param: str = "tools", schema_field: str = "parameters") -> list[Tool]:
    """A request's tools, each as (name, description, parameters schema), the
    schemas checked; ``schema_field`` is where a tool holds its schema (for
    error messages): OpenAI's ``function.parameters``, Responses'
    ``parameters``, Anthropic's ``input_schema``."""
    out = [Tool(name, description, _check_schema(schema, f"{param}.{i}.{schema_field}")) for i, (name, description, schema) in enumerate(specs)]
    _unique(out, param)
    return out


def _unique(tools: list[Tool], param: str) -> None:
    seen = set()
    for t in tools:
        if t.name in seen:
            raise APIError.bad_request(f"two tools are named {t.name!r}", param=param)
        seen.add(t.name)


def template_tools(tools: list[Tool]) -> list[JSONObject]:
    """Tools as chat templates expect them (OpenAI's shape)."""
    return [
        {"type": "function", "function": {k: v for k, v in t.__dict__.items() if v is not None}} for t in tools
    ]


# ---------------------------------------------------------------------------
# the core's own formats for forced calls
# ---------------------------------------------------------------------------


class NamedFunctionParser(ToolParser):
    """The whole output is the arguments of one named function."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.function = name

    def parse(self, text: str, *, final: bool) -> ToolParse:
        raw, end, valid = read_json_arguments(text, 0)
        if final:
            if valid and skip_ws(text, end or 0) == len(text):
                return ToolParse("", [ToolCallItem(self.function, raw)])
            return ToolParse(text, [])
        if end == INVALID:
            return ToolParse("", [])
        return ToolParse("", [ToolCallItem(self.function, raw, complete=end is not None)])


class RequiredCallsParser(ToolParser):
    """``[{"name": ..., "parameters": {...}}, ...]``."""

    def parse(self, text: str, *, final: bool) -> ToolParse:
        calls: list[ToolCallItem] = []
        pos = skip_ws(text, 0)
        ok = False
        if pos < len(text) and text[pos] == "[":
            pos += 1
            while True:
                pos = skip_ws(text, pos)
                if pos >= len(text):
                    break
                if text[pos] == "]":
                    ok = bool(calls) and skip_ws(text, pos + 1) == len(text)
                    break
                view = read_json_call(text, pos)
                if view.end is None:
                    if view.name is not None and not final:
                        calls.append(ToolCallItem(view.name, view.arguments, complete=False))
                    break
                if view.end == INVALID or not view.valid:
                    break
                calls.append(ToolCallItem(view.name or "", view.arguments))
                pos = skip_ws(text, view.end)
                if pos < len(text) and text[pos] == ",":
                    pos += 1
        if final:
            return ToolParse("", calls) if ok else ToolParse(text, [])
        return ToolParse("", calls)


# ---------------------------------------------------------------------------
# one choice's output: reasoning, answer, calls; whole or as deltas
# ---------------------------------------------------------------------------


@dataclass
class CallDelta:
    index: int
    id: str | None = None  # set with the name, on a call's first delta
    name: str | None = None
    arguments: str = ""


@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class ParsedOutput:
    reasoning: str | None
    content: str
    calls: list[ToolCallItem]


class OutputParser:
    """Reasoning and tool calls out of one choice's text, whole (``final``)
    or as deltas since the last call (``delta``).

    A stream's content and arguments only grow; a call that turns out
    malformed at the end (it was streamed, then never closed) leaves its
    text as a last content delta, as the unstreamed answer has it.
    """

    def __init__(self, tools: ToolParser | None, reasoning: ReasoningParser | None, id_prefix: str = "call_") -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.id_prefix = id_prefix
        self.ids: list[str] = []
        self._reasoning_len = 0
        self._content_len = 0
        self._args: list[str] = []
        #: calls in the latest view (a streamed call that turned out malformed is not counted)
        self.num_calls = 0

    @property
    def active(self) -> bool:
        return self.tools is not None or self.reasoning is not None

    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        reasoning: str | None = None
        if self.reasoning is not None:
            try:
                r = self.reasoning.parse(text, final=final)
                reasoning, text = r.reasoning, r.content
            except Exception:  # a parser bug must not lose the answer
                log.exception("reasoning parser failed; the output is returned as text")
        if self.tools is None:
            return ParsedOutput(reasoning, text, [])
        try:
            t = self.tools.parse(text, final=final)
        except Exception:
            log.exception("tool parser failed; the output is returned as text")
            return ParsedOutput(reasoning, text if final else "", [])
        return ParsedOutput(reasoning, t.content, t.calls)

    def call_ids(self, calls: list[ToolCallItem]) -> list[str]:
        while len(self.ids) < len(calls):
            given = calls[len(self.ids)].id
            self.ids.append(given or call_id(self.id_prefix))
        return self.ids[: len(calls)]

    def delta(self, text: str, *, final: bool) -> OutputDelta:
        view = self.parse(text, final=final)
        out = OutputDelta()
        if view.reasoning and len(view.reasoning) > self._reasoning_len:
            out.reasoning = view.reasoning[self._reasoning_len :]
            self._reasoning_len = len(view.reasoning)
        # trailing whitespace waits for what follows: before a call it is layout, dropped
        content = view.content if final or self.tools is None else view.content.rstrip()
        if len(content) > self._content_len:
            out.content = content[self._content_len :]
            self._content_len = len(content)
        ids = self.call_ids(view.calls)
        self.num_calls = len(view.calls)
        for i, c in enumerate(view.calls):
            if i >= len(self._args):
                self._args.append(c.arguments)
                out.calls.append(CallDelta(i, ids[i], c.name, c.arguments))
            elif c.arguments.startswith(self._args[i]) and len(c.arguments) > len(self._args[i]):
                out.calls.append(CallDelta(i, arguments=c.arguments[len(self._args[i]) :]))
                self._args[i] = c.arguments
        return out


def arguments_object(arguments: str) -> JSONObject:
    """A call's arguments as an object (Anthropic's ``input``; chat templates)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
