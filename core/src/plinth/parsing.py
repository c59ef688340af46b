"""Helpers for tool-call and reasoning parsers (exported through ``plinth.api``),
and the ``<think>`` reasoning parser the families' plugins share.

Parsers are pure functions of the text so far (see ``plinth.api.ToolParser``):
these helpers read JSON that may still be arriving, without ever raising.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plinth.contract.parsers import ReasoningParser

if TYPE_CHECKING:
    from plinth.contract.parsers import ReasoningParse, ToolCallItem, ToolParse

_WS = " \t\r\n"
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
INVALID = -1


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def held_back(text: str, markers: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could be the beginning of one
    of ``markers`` (and so must not be shown as answer text yet)."""
    keep = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), keep, -1):
            if text.endswith(m[:k]):
                keep = k
                break
    return keep


def _string_end(text: str, i: int) -> int | None:
    """text[i] is a quote: the index past the closing quote, None if not yet closed."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value that begins at ``text[start]``
    (leading whitespace skipped): None while it is incomplete, ``INVALID``
    when no JSON value can begin there. Brackets and strings are matched,
    not validated: json.loads has the last word."""
    i = skip_ws(text, start)
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth = 0
        j = i
        while j < len(text):
            c = text[j]
            if c == '"':
                e = _string_end(text, j)
                if e is None:
                    return None
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
                if depth < 0:
                    return INVALID
            j += 1
        return None
    m = _SCALAR.match(text, i)
    if m is None:
        # a prefix of true/false/null/a number may still be arriving
        rest = text[i:]
        if any(w.startswith(rest) for w in ("true", "false", "null")) or re.fullmatch(r"-?\d*\.?\d*[eE]?[+-]?\d*", rest):
            return None
        return INVALID
    if m.end() == len(text):  # a number may go on
        return None
    return m.end()


@dataclass
class JsonCallView:
    """A ``{"name": ..., "arguments": {...}}`` object, as far as it has arrived.

    name: None until the name string is complete.
    arguments: the raw JSON text of the arguments value so far (a prefix of
        the final one); "" when none has arrived or when it is string-encoded
        and not complete yet.
    end: index past the closing brace; None while incomplete; INVALID when
        the text cannot be such an object.
    valid: complete, with a string name and arguments that are a JSON object.
    """

    name: str | None = None
    arguments: str = ""
    end: int | None = None
    valid: bool = False


def read_json_call(
    text: str,
    start: int = 0,
    *,
    name_keys: Sequence[str] = ("name",),
    args_keys: Sequence[str] = ("arguments", "parameters"),
) -> JsonCallView:
    """Read a call object beginning at ``text[start]`` (whitespace skipped)."""
    view = JsonCallView()
    i = skip_ws(text, start)
    if i >= len(text):
        return view
    if text[i] != "{":
        view.end = INVALID
        return view
    i += 1
    args_raw: str | None = None
    args_span: tuple[int, int | None] | None = None
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            break
        if text[i] == "}":
            view.end = i + 1
            break
        if text[i] != '"':
            view.end = INVALID
            break
        kend = _string_end(text, i)
        if kend is None:
            break
        try:
            key = json.loads(text[i:kend])
        except ValueError:
            view.end = INVALID
            break
        i = skip_ws(text, kend)
        if i >= len(text):
            break
        if text[i] != ":":
            view.end = INVALID
            break
        vstart = skip_ws(text, i + 1)
        vend = json_value_end(text, vstart)
        if vend == INVALID:
            view.end = INVALID
            break
        if key in name_keys and view.name is None:
            if vend is not None:
                try:
                    name = json.loads(text[vstart:vend])
                except ValueError:
                    name = None
                if not isinstance(name, str) or not name:
                    view.end = INVALID
                    break
                view.name = name
        elif key in args_keys and args_span is None:
            args_span = (vstart, vend)
        if vend is None:
            break
        i = skip_ws(text, vend)
        if i < len(text) and text[i] == ",":
            i += 1
        elif i < len(text) and text[i] != "}":
            view.end = INVALID
            break
    if args_span is not None:
        vstart, vend = args_span
        raw = text[vstart:vend] if vend is not None else text[vstart:]
        if raw.startswith('"'):  # arguments sent as a JSON-encoded string: shown once complete
            args_raw = ""
            if vend is not None:
                try:
                    args_raw = json.loads(raw)
                except ValueError:
                    args_raw = None
        else:
            args_raw = raw
    view.arguments = args_raw or ""
    if view.end is not None and view.end != INVALID:
        if args_span is None:
            view.arguments = args_raw = "{}"
        view.valid = view.name is not None and args_raw is not None and is_json_object(view.arguments)
    return view


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def read_json_arguments(text: str, start: int) -> tuple[str, int | None, bool]:
    """A bare arguments object at ``text[start]``: (raw text so far, end or
    None/INVALID, valid)."""
    i = skip_ws(text, start)
    end = json_value_end(text, i)
    if end == INVALID:
        return "", INVALID, False
    raw = text[i:end] if end is not None else text[i:]
    return raw, end, end is not None and is_json_object(raw)


# ---- what tool and reasoning parsers share ---------------------------------------------------


def tail_text(text: str, final: bool, markers: tuple[str, ...]) -> str:
    """Answer text at the end of the output: all of it when final, else
    without a possible beginning of a marker."""
    return text if final else text[: len(text) - held_back(text, markers)]


def finish_tool_parse(parts: list[str], calls: "list[ToolCallItem]", final: bool) -> "ToolParse":
    """The parse of a tool parser: its content parts joined (stripped around
    calls when final: the blank lines around them are layout) and its calls."""
    from plinth.contract.parsers import ToolParse

    content = "".join(parts)
    if final and calls:
        content = content.strip()
    return ToolParse(content, calls)


class ThinkReasoningParser(ReasoningParser):
    """``<think>...</think>``, the reasoning format several families share
    (Qwen3, QwQ, SmolLM3, DeepSeek-R1): each family's plugin registers it (or
    a subclass) under its own name. The reasoning is open from the start when
    the output begins with ``<think>``, the prompt ends with it (templates
    that open it in the prompt) or ``always_open``."""

    START, END = "<think>", "</think>"
    #: the model always reasons first, whether or not it writes <think> (DeepSeek-R1)
    always_open = False
    examples = (
        ("", "<think>\nThe user wants a colour.\n</think>\n\nBlue."),
        ("<|im_start|>assistant\n<think>\n", "Hmm, a colour.\n</think>\n\nBlue."),  # a template that opens it
    )

    def parse(self, text: str, *, final: bool) -> "ReasoningParse":
        from plinth.contract.parsers import ReasoningParse

        opened = self.always_open or self.prompt.rstrip().endswith(self.START)
        s = skip_ws(text, 0)
        body = 0
        if text.startswith(self.START, s):
            opened, body = True, s + len(self.START)
        elif not final and s < len(text) and self.START.startswith(text[s:]):
            return ReasoningParse("", "")  # may be the beginning of <think>
        if not opened:
            return ReasoningParse("", text)
        e = text.find(self.END, body)
        if e < 0:
            reasoning = tail_text(text[body:], final, (self.END,)).lstrip()
            return ReasoningParse(reasoning.rstrip() if final else reasoning, "")
        reasoning = text[body:e].strip() if final else text[body:e].lstrip()
        return ReasoningParse(reasoning, text[e + len(self.END) :].lstrip())
