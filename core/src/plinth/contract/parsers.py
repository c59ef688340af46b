"""The tool_parser and reasoning_parser categories (``--tool-call-parser``,
``--reasoning-parser``): structured tool calls and reasoning text out of a
model's raw output."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

from plinth.contract.base import PluginDescriptor, PluginImpl


@dataclass(frozen=True)
class ToolParserDescriptor(PluginDescriptor):
    """Reads tool calls out of a model's output (``--tool-call-parser``).
    impl -> a ``ToolParser`` subclass. Registered by the model plugin whose
    families write calls this way.

    template_markers: strings whose presence in a chat template means the
    model writes calls this way; with ``auto`` the server takes the
    highest-priority parser with a marker in the served model's template.
    """

    category: ClassVar[str] = "tool_parser"
    template_markers: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReasoningParserDescriptor(PluginDescriptor):
    """Splits a model's reasoning from its answer (``--reasoning-parser``).
    impl -> a ``ReasoningParser`` subclass; template_markers as for tool parsers."""

    category: ClassVar[str] = "reasoning_parser"
    template_markers: tuple[str, ...] = ()


@dataclass
class ToolCallItem:
    """One tool call read out of the output.

    arguments: the JSON text of the arguments, as the model wrote it; in a
        streaming view, what has arrived of it so far.
    id: an id the model's format carries (Kimi K2's ``functions.get_weather:0``);
        None lets the server make one.
    """

    name: str
    arguments: str = "{}"
    complete: bool = True
    id: str | None = None


@dataclass
class ToolParse:
    """What a tool parser makes of the output: answer text and calls."""

    content: str
    calls: list[ToolCallItem] = field(default_factory=list[ToolCallItem])


class ToolParser(PluginImpl):
    """Reads a model family's tool-call format. One instance per request
    (``tools`` is the request's tool list, for formats that need it).

    ``parse`` is a pure function of the text so far, so the server streams
    by diffing successive views; a parser keeps no state between calls.
    """

    #: outputs in this format, each with a well-formed call: what the
    #: conformance kit (and ``platform plugins check``) parses by default
    examples: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self.tools = list(tools)

    @abc.abstractmethod
    def parse(self, text: str, *, final: bool) -> ToolParse:
        """text: everything the model wrote so far (after its reasoning).

        final=True: the whole output. Every call returned is complete, with
        arguments that are a JSON object; a call that is malformed (bad
        JSON, no name, never closed) is left in ``content`` as written.
        Never raises on any text.

        final=False: a streaming view. ``content`` holds only text that is
        certainly answer text (a possible beginning of a call marker at the
        end is held back); a call appears once its name is complete, and
        its ``arguments`` only ever grow (each view's is a prefix of the
        next one's and of the final one).
        """
        raise NotImplementedError


@dataclass
class ReasoningParse:
    """Reasoning text and the answer after it."""

    reasoning: str
    content: str


class ReasoningParser(PluginImpl):
    """Splits reasoning (``<think>...</think>``) from the answer; stateless
    like ``ToolParser``. ``prompt`` is the rendered prompt, for templates
    that open the reasoning block in the prompt itself."""

    #: (prompt, output) pairs with reasoning in this format: what the
    #: conformance kit (and ``platform plugins check``) parses by default
    examples: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, prompt: str = "") -> None:
        self.prompt = prompt

    @abc.abstractmethod
    def parse(self, text: str, *, final: bool) -> ReasoningParse:
        """final=False: a streaming view (a possible beginning of a tag at
        the end is held back from both parts; both parts only grow)."""
        raise NotImplementedError
