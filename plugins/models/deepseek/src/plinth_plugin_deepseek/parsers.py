"""The tool-call and reasoning formats of the models this plugin serves.

- deepseek_v3: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
  (V3.1: ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``)
- kimi_k2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>``
- deepseek_r1: ``<think>...</think>`` before the answer, the block open from the start

Each parser is a pure function of the text so far (``plinth.api.ToolParser``):
with ``final=True`` a malformed call is returned as text; with
``final=False`` a possible marker at the end is held back and a call shows
once its name is complete.
"""

from __future__ import annotations

import re

from plinth.api import (
    INVALID,
    ThinkReasoningParser,
    ToolCallItem,
    ToolParse,
    ToolParser,
    finish_tool_parse,
    read_json_arguments,
    skip_ws,
    tail_text,
)


class DeepSeekV3ToolParser(ToolParser):
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    needs_special_tokens = True
    examples = (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"tz": "Europe/Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        'Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    )

    def parse(self, text: str, *, final: bool) -> ToolParse:
        i = text.find(self.CALLS_BEGIN)
        if i < 0:
            i = text.find(self.CALL_BEGIN)  # some outputs leave out the section marker
        if i < 0:
            return ToolParse(tail_text(text, final, (self.CALLS_BEGIN, self.CALL_BEGIN)), [])
        head = text[:i]
        calls: list[ToolCallItem] = []
        pos = i + len(self.CALLS_BEGIN) if text.startswith(self.CALLS_BEGIN, i) else i
        ok = False
        while True:
            pos = skip_ws(text, pos)
            if text.startswith(self.CALLS_END, pos) or (pos >= len(text) and calls):
                ok = bool(calls)
                break
            if not text.startswith(self.CALL_BEGIN, pos):
                break
            pos += len(self.CALL_BEGIN)
            sep = text.find(self.SEP, pos)
            if sep < 0:
                break
            kind = text[pos:sep].strip()
            j = sep + len(self.SEP)
            rest = text[j:]
            nl = rest.find("\n")
            if kind == "function" and not final and (nl < 0 or (len(rest) - nl - 1 < 7 and "```json".startswith(rest[nl + 1 :]))):
                break  # V3's name line and fence may still be arriving
            if kind == "function" and re.match(r"[^\n`]+\n```json", rest):
                nl = text.index("\n", j)
                name = text[j:nl].strip()
                raw, end, valid = read_json_arguments(text, nl + len("\n```json"))
                fence = "```"
            else:  # V3.1: the name before the separator, the arguments right after it
                name = kind
                raw, end, valid = read_json_arguments(text, j)
                fence = ""
            if not name:
                break
            if end is None:
                if not final:
                    calls.append(ToolCallItem(name, raw, complete=False))
                break
            if end == INVALID or not valid:
                break
            k = skip_ws(text, end)
            if fence and text.startswith(fence, k):
                k = skip_ws(text, k + len(fence))
            elif fence and not final and fence.startswith(text[k:]):
                calls.append(ToolCallItem(name, raw))  # the closing fence is arriving
                break
            if text.startswith(self.CALL_END, k):
                k += len(self.CALL_END)
            elif not (k >= len(text) or (not final and self.CALL_END.startswith(text[k:]))):
                break
            calls.append(ToolCallItem(name, raw))
            pos = k
            if k >= len(text):
                ok = True
                break
        if final and not ok:
            return ToolParse(text, [])
        return finish_tool_parse([head], calls, final)


class KimiK2ToolParser(ToolParser):
    SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    _ID = re.compile(r"\s*(?:functions\.)?([A-Za-z0-9_.\-]+?)(?::(\d+))?\s*$")
    needs_special_tokens = True
    examples = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
        '{"tz": "Europe/Paris"}<|tool_call_end|><|tool_calls_section_end|>',
    )

    def parse(self, text: str, *, final: bool) -> ToolParse:
        i = text.find(self.SECTION_BEGIN)
        if i < 0:
            return ToolParse(tail_text(text, final, (self.SECTION_BEGIN,)), [])
        head = text[:i]
        calls: list[ToolCallItem] = []
        pos = i + len(self.SECTION_BEGIN)
        ok = False
        while True:
            pos = skip_ws(text, pos)
            if text.startswith(self.SECTION_END, pos) or (pos >= len(text) and calls):
                ok = bool(calls)
                break
            if not text.startswith(self.CALL_BEGIN, pos):
                break
            pos += len(self.CALL_BEGIN)
            a = text.find(self.ARG_BEGIN, pos)
            if a < 0:
                break
            call_id = text[pos:a].strip()
            m = self._ID.match(call_id)
            if m is None:
                break
            raw, end, valid = read_json_arguments(text, a + len(self.ARG_BEGIN))
            if end is None:
                if not final:
                    calls.append(ToolCallItem(m.group(1), raw, complete=False, id=call_id))
                break
            if end == INVALID or not valid:
                break
            k = skip_ws(text, end)
            if text.startswith(self.CALL_END, k):
                k += len(self.CALL_END)
            elif not (k >= len(text) or (not final and self.CALL_END.startswith(text[k:]))):
                break
            calls.append(ToolCallItem(m.group(1), raw, id=call_id))
            pos = k
            if k >= len(text):
                ok = True
                break
        if final and not ok:
            return ToolParse(text, [])
        return finish_tool_parse([head], calls, final)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    always_open = True
    examples = (("<｜Assistant｜>", "Hmm.\n</think>\n\nBlue."), ("<｜Assistant｜>", "<think>\nHmm.\n</think>\n\nBlue."))
