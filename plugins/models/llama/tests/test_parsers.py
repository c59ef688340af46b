"""Tool-call and reasoning parsers against their families' documented output
formats, whole and streamed one character at a time, malformed and partial
calls included (a malformed call comes back as text, never an exception)."""

from __future__ import annotations

import json

import pytest
from plinth_plugin_llama.parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ThinkReasoningParser,
)

W = {"city": "Paris", "unit": "celsius"}
T = {"tz": "Europe/Paris"}
WJ, TJ = json.dumps(W), json.dumps(T)

# (parser, output text, expected content, expected [(name, arguments dict)])
GOOD = [
    (HermesToolParser, f'<tool_call>\n{{"name": "get_weather", "arguments": {WJ}}}\n</tool_call>', "", [("get_weather", W)]),
    (
        HermesToolParser,
        f'Let me check.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {WJ}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "get_time", "arguments": {TJ}}}\n</tool_call>',
        "Let me check.",
        [("get_weather", W), ("get_time", T)],
    ),
    (HermesToolParser, '<tool_call>\n{"name": "ping"}\n</tool_call>', "", [("ping", {})]),
    # the closing tag cut off as a stop string
    (HermesToolParser, f'<tool_call>\n{{"name": "get_weather", "arguments": {WJ}}}', "", [("get_weather", W)]),
    (HermesToolParser, "Paris is sunny today.", "Paris is sunny today.", []),
    (Llama3JsonToolParser, f'{{"name": "get_weather", "parameters": {WJ}}}', "", [("get_weather", W)]),
    (Llama3JsonToolParser, f'<|python_tag|>{{"name": "get_weather", "parameters": {WJ}}}', "", [("get_weather", W)]),
    (
        Llama3JsonToolParser,
        f'{{"name": "get_weather", "parameters": {WJ}}}; {{"name": "get_time", "parameters": {TJ}}}',
        "",
        [("get_weather", W), ("get_time", T)],
    ),
    (Llama3JsonToolParser, "It is {probably} sunny.", "It is {probably} sunny.", []),
    (MistralToolParser, f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WJ}}}]', "", [("get_weather", W)]),
    (
        MistralToolParser,
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WJ}}}, {{"name": "get_time", "arguments": {TJ}}}]',
        "",
        [("get_weather", W), ("get_time", T)],
    ),
    (MistralToolParser, f"[TOOL_CALLS]get_weather[ARGS]{WJ}", "", [("get_weather", W)]),
    (
        MistralToolParser,
        f"Sure.[TOOL_CALLS]get_weather[ARGS]{WJ}[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{TJ}",
        "Sure.",
        [("get_weather", W), ("get_time", T)],
    ),
]

MALFORMED = [
    (HermesToolParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut off
    (HermesToolParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'),
    (HermesToolParser, '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>'),  # not an object
    (HermesToolParser, "<tool_call>not json</tool_call>"),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": '),
    (Llama3JsonToolParser, '{"city": "Paris"}'),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {}} and then some text'),
    (MistralToolParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city"'),
    (MistralToolParser, "[TOOL_CALLS]get_weather[ARGS]{oops}"),
    (MistralToolParser, "[TOOL_CALLS]"),
]


def _calls(parse):
    return [(c.name, json.loads(c.arguments)) for c in parse.calls]


def _stream(parser, text, strict=True):
    """Feed the text one character at a time; check what a stream may rely
    on (content and arguments only grow; a call's name never changes) and
    return the assembled (content, calls). Not strict: a call that turns out
    malformed may vanish from later views (the server then sends its text)."""
    content = ""
    calls: list[list[str]] = []
    for n in range(len(text) + 1):
        view = parser.parse(text[:n], final=False)
        assert view.content.startswith(content), (text[:n], view.content, content)
        content = view.content
        if not strict:
            continue
        for i, c in enumerate(view.calls):
            if i < len(calls):
                assert calls[i][0] == c.name
                assert c.arguments.startswith(calls[i][1]), (c.arguments, calls[i][1])
                calls[i][1] = c.arguments
            else:
                assert i == len(calls)
                calls.append([c.name, c.arguments])
        assert len(view.calls) >= len(calls)
    return content, calls


@pytest.mark.parametrize("cls,text,content,calls", GOOD)
def test_parse(cls, text, content, calls):
    p = cls([])
    out = p.parse(text, final=True)
    assert out.content == content
    assert _calls(out) == calls
    assert all(c.complete for c in out.calls)


@pytest.mark.parametrize("cls,text,content,calls", GOOD)
def test_streamed_views_add_up(cls, text, content, calls):
    p = cls([])
    s_content, s_calls = _stream(p, text)
    final = p.parse(text, final=True)
    # what was streamed is the final answer (content may lose trailing layout whitespace)
    assert s_content.strip() == final.content
    assert [(n, json.loads(a)) for n, a in s_calls] == _calls(final)
    for (_, a), c in zip(s_calls, final.calls, strict=True):
        assert a == c.arguments


@pytest.mark.parametrize("cls,text", MALFORMED)
def test_malformed_is_text(cls, text):
    out = cls([]).parse(text, final=True)
    assert out.calls == []
    assert out.content == text
    _stream(cls([]), text, strict=False)  # streaming views never raise either


def test_stream_holds_back_a_possible_marker():
    p = HermesToolParser([])
    assert p.parse("Sure <tool_", final=False).content == "Sure "
    assert p.parse("Sure <tool_", final=True).content == "Sure <tool_"
    assert p.parse("a < b", final=False).content == "a < b"
    view = p.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', final=False)
    assert [(c.name, c.arguments, c.complete) for c in view.calls] == [("get_weather", '{"city": "Pa', False)]
    assert p.parse('<tool_call>\n{"name": "get_wea', final=False).calls == []  # the name is not complete yet


def test_mistral_call_ids_are_kept():
    out = MistralToolParser([]).parse(f"[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{TJ}", final=True)
    assert out.calls[0].id == "a1B2c3D4e"


# ---- reasoning ---------------------------------------------------------------------------

REASONING = [
    (ThinkReasoningParser, "", "<think>\nThe user wants a colour.\n</think>\n\nBlue.", "The user wants a colour.", "Blue."),
    (ThinkReasoningParser, "", "Blue.", "", "Blue."),
    # Qwen3 with enable_thinking=false: an empty think block in the prompt, none in the output
    (ThinkReasoningParser, "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Blue.", "", "Blue."),
    # the template opened the block in the prompt
    (ThinkReasoningParser, "<|im_start|>assistant\n<think>\n", "Hmm, a colour.\n</think>\n\nBlue.", "Hmm, a colour.", "Blue."),
    # cut off while reasoning
    (ThinkReasoningParser, "", "<think>\nstill thinking", "still thinking", ""),
]


@pytest.mark.parametrize("cls,prompt,text,reasoning,content", REASONING)
def test_reasoning(cls, prompt, text, reasoning, content):
    p = cls(prompt)
    out = p.parse(text, final=True)
    assert (out.reasoning, out.content) == (reasoning, content)
    r = c = ""
    for n in range(len(text) + 1):
        view = p.parse(text[:n], final=False)
        assert view.reasoning.startswith(r) and view.content.startswith(c), (text[:n], view)
        r, c = view.reasoning, view.content
        assert "<think" not in r + c and "</think" not in r + c
    assert r.strip() == reasoning and c == content
