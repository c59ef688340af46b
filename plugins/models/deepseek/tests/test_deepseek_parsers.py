"""The DeepSeek-V3 / Kimi K2 tool-call parsers and the DeepSeek-R1 reasoning
parser this plugin registers: their families' documented outputs parsed
whole, malformed calls returned as text, and plinth's conformance kit (every
output fed whole and one character at a time, noise and cuts)."""

from __future__ import annotations

import json

import pytest
from plinth.testing import check_reasoning_parser, check_tool_parser, discover_all
from plinth_plugin_deepseek.parsers import DeepSeekR1ReasoningParser, DeepSeekV3ToolParser, KimiK2ToolParser

W = {"city": "Paris", "unit": "celsius"}
T = {"tz": "Europe/Paris"}
WJ, TJ = json.dumps(W), json.dumps(T)

# (parser, output text, expected content, expected [(name, arguments dict)])
GOOD = [
    (
        DeepSeekV3ToolParser,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        f"{WJ}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{TJ}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
        [("get_weather", W), ("get_time", T)],
    ),
    (
        DeepSeekV3ToolParser,
        f"Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{WJ}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Checking.",
        [("get_weather", W)],
    ),
    (
        KimiK2ToolParser,
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        f"{WJ}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{TJ}"
        "<|tool_call_end|><|tool_calls_section_end|>",
        "",
        [("get_weather", W), ("get_time", T)],
    ),
]

MALFORMED = [
    (DeepSeekV3ToolParser, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\""),
    (DeepSeekV3ToolParser, "<｜tool▁calls▁begin｜>garbage"),
    (KimiK2ToolParser, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{bad}"),
    (KimiK2ToolParser, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"),
]

REASONING = [
    (DeepSeekR1ReasoningParser, "<｜Assistant｜>", "Hmm.\n</think>\n\nBlue.", "Hmm.", "Blue."),
    (DeepSeekR1ReasoningParser, "<｜Assistant｜>", "<think>\nHmm.\n</think>\n\nBlue.", "Hmm.", "Blue."),
]


@pytest.mark.parametrize("cls,text,content,calls", GOOD)
def test_parse(cls, text, content, calls):
    out = cls([]).parse(text, final=True)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls
    assert all(c.complete for c in out.calls)


@pytest.mark.parametrize("cls,text", MALFORMED)
def test_malformed_is_text(cls, text):
    out = cls([]).parse(text, final=True)
    assert out.calls == [] and out.content == text


def test_kimi_call_ids_are_kept():
    cls, text = GOOD[-1][0], GOOD[-1][1]
    assert [c.id for c in cls([]).parse(text, final=True).calls] == ["functions.get_weather:0", "functions.get_time:1"]


@pytest.mark.parametrize("cls,prompt,text,reasoning,content", REASONING)
def test_reasoning(cls, prompt, text, reasoning, content):
    out = cls(prompt).parse(text, final=True)
    assert (out.reasoning, out.content) == (reasoning, content)


@pytest.mark.parametrize("name,cls", [("deepseek_v3", DeepSeekV3ToolParser), ("kimi_k2", KimiK2ToolParser)])
def test_tool_parser_conformance(name, cls):
    check_tool_parser(name, tuple(text for c, text, _, calls in GOOD if c is cls and calls))


def test_reasoning_parser_conformance():
    check_reasoning_parser("deepseek_r1", tuple((prompt, text) for c, prompt, text, r, _ in REASONING if c is DeepSeekR1ReasoningParser and r))


@pytest.mark.parametrize("category", ["tool_parser", "reasoning_parser"])
def test_every_parser_it_registers_passes_the_kit_on_its_own_examples(category):
    """What `platform plugins check plinth-plugin-deepseek` runs: no samples given, the classes' ``examples``."""
    names = sorted(e.name for e in discover_all().entries[category] if e.distribution == "plinth-plugin-deepseek")
    assert names
    for name in names:
        (check_tool_parser if category == "tool_parser" else check_reasoning_parser)(name)
