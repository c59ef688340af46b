"""Tool-call and reasoning formats of the families this plugin serves
(DeepSeek-V3's and Kimi K2's are the deepseek plugin's).

Each parser is a pure function of the text so far (see
``plinth.api.ToolParser``): with ``final=True`` a malformed call is returned
as text; with ``final=False`` a possible marker at the end is held back and
a call shows once its name is complete. Formats, as the models document them:

- hermes (Hermes 2/3, Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, repeated
- llama3_json (Llama 3.1/3.2/3.3): the whole answer is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several joined by ``;``
- mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizer), or
  ``[TOOL_CALLS]name[ARGS]{...}`` / ``name[CALL_ID]id[ARGS]{...}`` (v11+)
- reasoning (Qwen3, QwQ): ``<think>...</think>`` before the answer (plinth.api's ``ThinkReasoningParser``)
"""

from __future__ import annotations

import re

from plinth.api import (
    INVALID,
    ToolCallItem,
    ToolParse,
    ToolParser,
    finish_tool_parse,
    read_json_arguments,
    read_json_call,
    skip_ws,
    tail_text,
)
from plinth.api import ThinkReasoningParser as _ThinkReasoningParser


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    examples = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
    )

    def parse(self, text: str, *, final: bool) -> ToolParse:
        parts: list[str] = []
        calls: list[ToolCallItem] = []
        pos = 0
        while True:
            i = text.find(self.START, pos)
            if i < 0:
                parts.append(tail_text(text[pos:], final, (self.START,)))
                break
            parts.append(text[pos:i])
            view = read_json_call(text, i + len(self.START))
            if view.end is None or view.end == INVALID:
                if final or view.end == INVALID:
                    parts.append(text[i:] if final else "")
                elif view.name is not None:
                    calls.append(ToolCallItem(view.name, view.arguments, complete=False))
                break
            k = skip_ws(text, view.end)
            if text.startswith(self.END, k):
                after = k + len(self.END)
            elif k == len(text) and (final or not text[k:]):
                after = k  # the closing tag was a stop string, or is still coming
            elif not final and self.END.startswith(text[k:]):
                after = len(text)
            else:  # something else follows the object: not a call
                if not final:
                    break
                end = text.find(self.END, k)
                after = len(text) if end < 0 else end + len(self.END)
                parts.append(text[i:after])
                pos = after
                continue
            if view.valid:
                calls.append(ToolCallItem(view.name or "", view.arguments, complete=after > k or final))
            elif final:
                parts.append(text[i:after])
            else:
                break
            pos = after
        return finish_tool_parse(parts, calls, final)


class Llama3JsonToolParser(ToolParser):
    """The answer is the call (or calls joined by ';'): anything else is text."""

    TAG = "<|python_tag|>"
    examples = (
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
    )

    def parse(self, text: str, *, final: bool) -> ToolParse:
        s = skip_ws(text, 0)
        body = s
        if text.startswith(self.TAG, s):
            body = skip_ws(text, s + len(self.TAG))
        elif not final and self.TAG.startswith(text[s:]) and s < len(text):
            return ToolParse("", [])
        if body >= len(text):
            return ToolParse(text if final else "", [])
        if text[body] != "{":
            return ToolParse(text, [])
        calls: list[ToolCallItem] = []
        pos = body
        while True:
            view = read_json_call(text, pos)
            if view.end == INVALID or (final and (view.end is None or not view.valid)):
                return ToolParse(text, []) if final else ToolParse("", calls)
            if view.end is None:
                if view.name is not None:
                    calls.append(ToolCallItem(view.name, view.arguments, complete=False))
                return ToolParse("", calls)
            if not view.valid:
                return ToolParse("", calls)
            calls.append(ToolCallItem(view.name or "", view.arguments))
            k = skip_ws(text, view.end)
            if k >= len(text):
                return ToolParse("", calls)
            if text[k] != ";":
                return ToolParse(text, []) if final else ToolParse("", calls)
            pos = k + 1
            if skip_ws(text, pos) >= len(text):
                return ToolParse("", calls)


class MistralToolParser(ToolParser):
    TAG = "[TOOL_CALLS]"
    examples = (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "Europe/Paris"}',
    )
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")
    needs_special_tokens = True

    def parse(self, text: str, *, final: bool) -> ToolParse:
        i = text.find(self.TAG)
        if i < 0:
            return ToolParse(tail_text(text, final, (self.TAG,)), [])
        head = text[:i]
        calls: list[ToolCallItem] = []
        body = skip_ws(text, i + len(self.TAG))
        if body >= len(text):
            return ToolParse(text if final else head, [])
        ok = self._array(text, body, calls, final) if text[body] == "[" else self._named(text, body, calls, final)
        if final and not ok:
            return ToolParse(text, [])
        return finish_tool_parse([head], calls, final)

    def _array(self, text: str, pos: int, calls: list[ToolCallItem], final: bool) -> bool:
        pos += 1
        while True:
            pos = skip_ws(text, pos)
            if pos >= len(text):
                return False
            if text[pos] == "]":
                return bool(calls)
            view = read_json_call(text, pos)
            if view.end is None:
                if view.name is not None and not final:
                    calls.append(ToolCallItem(view.name, view.arguments, complete=False))
                return False
            if view.end == INVALID or not view.valid:
                return False
            calls.append(ToolCallItem(view.name or "", view.arguments))
            pos = skip_ws(text, view.end)
            if pos < len(text) and text[pos] == ",":
                pos += 1

    def _named(self, text: str, pos: int, calls: list[ToolCallItem], final: bool) -> bool:
        while True:
            m = self._NAME.match(text, pos)
            if m is None:
                return False
            name, j = m.group(0), m.end()
            call_id = None
            if text.startswith(self.CALL_ID, j):
                m2 = re.compile(r"[A-Za-z0-9]+").match(text, j + len(self.CALL_ID))
                if m2 is None:
                    return False
                call_id, j = m2.group(0), m2.end()
            if not text.startswith(self.ARGS, j):
                return False  # the name may still be arriving
            raw, end, valid = read_json_arguments(text, j + len(self.ARGS))
            if end is None:
                if not final:
                    calls.append(ToolCallItem(name, raw, complete=False, id=call_id))
                return False
            if end == INVALID or not valid:
                return False
            calls.append(ToolCallItem(name, raw, id=call_id))
            pos = skip_ws(text, end)
            if text.startswith(self.TAG, pos):
                pos = skip_ws(text, pos + len(self.TAG))
            if pos >= len(text):
                return True


#: the ``<think>`` format (Qwen3, QwQ, SmolLM3), shared through plinth.api
ThinkReasoningParser = _ThinkReasoningParser
