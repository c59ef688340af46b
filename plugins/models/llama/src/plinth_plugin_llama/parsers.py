"""Tool-call and reasoning formats of the families this plugin serves (and
their MoE / DeepSeek-V3 relatives, whose formats are the same kind of text).

Each parser is a pure function of the text so far (see
``plinth.api.ToolParser``): with ``final=True`` a malformed call is returned
as text; with ``final=False`` a possible marker at the end is held back and
a call shows once its name is complete. Formats, as the models document them:

- hermes (Hermes 2/3, Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, repeated
- llama3_json (Llama 3.1/3.2/3.3): the whole answer is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several joined by ``;``
- mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizer), or
  ``[TOOL_CALLS]name[ARGS]{...}`` / ``name[CALL_ID]id[ARGS]{...}`` (v11+)
- deepseek_v3: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
  (V3.1: ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``)
- kimi_k2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>``
- reasoning (Qwen3, DeepSeek-R1, QwQ): ``<think>...</think>`` before the answer
"""

from __future__ import annotations

import re

from plinth.api import (
    INVALID,
    ReasoningParse,
    ReasoningParser,
    ToolCallItem,
    ToolParse,
    ToolParser,
    held_back,
    read_json_arguments,
    read_json_call,
    skip_ws,
)


def _tail(text: str, final: bool, markers: tuple[str, ...]) -> str:
    """Answer text at the end of the output: all of it when final, else
    without a possible beginning of a marker."""
    return text if final else text[: len(text) - held_back(text, markers)]


def _finish(parts: list[str], calls: list[ToolCallItem], final: bool) -> ToolParse:
    content = "".join(parts)
    if final and calls:
        content = content.strip()  # the blank lines around calls are layout
    return ToolParse(content, calls)


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, *, final: bool) -> ToolParse:
        parts: list[str] = []
        calls: list[ToolCallItem] = []
        pos = 0
        while True:
            i = text.find(self.START, pos)
            if i < 0:
                parts.append(_tail(text[pos:], final, (self.START,)))
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
        return _finish(parts, calls, final)


class Llama3JsonToolParser(ToolParser):
    """The answer is the call (or calls joined by ';'): anything else is text."""

    TAG = "<|python_tag|>"

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
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")
    needs_special_tokens = True

    def parse(self, text: str, *, final: bool) -> ToolParse:
        i = text.find(self.TAG)
        if i < 0:
            return ToolParse(_tail(text, final, (self.TAG,)), [])
        head = text[:i]
        calls: list[ToolCallItem] = []
        body = skip_ws(text, i + len(self.TAG))
        if body >= len(text):
            return ToolParse(text if final else head, [])
        ok = self._array(text, body, calls, final) if text[body] == "[" else self._named(text, body, calls, final)
        if final and not ok:
            return ToolParse(text, [])
        return _finish([head], calls, final)

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


class DeepSeekV3ToolParser(ToolParser):
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    needs_special_tokens = True

    def parse(self, text: str, *, final: bool) -> ToolParse:
        i = text.find(self.CALLS_BEGIN)
        if i < 0:
            i = text.find(self.CALL_BEGIN)  # some outputs leave out the section marker
        if i < 0:
            return ToolParse(_tail(text, final, (self.CALLS_BEGIN, self.CALL_BEGIN)), [])
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
        return _finish([head], calls, final)


class KimiK2ToolParser(ToolParser):
    SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    _ID = re.compile(r"\s*(?:functions\.)?([A-Za-z0-9_.\-]+?)(?::(\d+))?\s*$")
    needs_special_tokens = True

    def parse(self, text: str, *, final: bool) -> ToolParse:
        i = text.find(self.SECTION_BEGIN)
        if i < 0:
            return ToolParse(_tail(text, final, (self.SECTION_BEGIN,)), [])
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
        return _finish([head], calls, final)


class ThinkReasoningParser(ReasoningParser):
    """``<think>...</think>``. The reasoning is open from the start when the
    output begins with ``<think>`` or the prompt ends with it (Qwen3's and
    DeepSeek-R1's newer templates open it in the prompt)."""

    START, END = "<think>", "</think>"
    #: DeepSeek-R1 always reasons first, whether or not it writes <think>
    always_open = False

    def parse(self, text: str, *, final: bool) -> ReasoningParse:
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
            reasoning = _tail(text[body:], final, (self.END,)).lstrip()
            return ReasoningParse(reasoning.rstrip() if final else reasoning, "")
        reasoning = text[body:e].strip() if final else text[body:e].lstrip()
        return ReasoningParse(reasoning, text[e + len(self.END) :].lstrip())


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    always_open = True
