"""The llama plugin against plinth's conformance kit: its registration, its
model loader on a tiny random Llama (paged chunked prefill and decode agree
with one prefill), and every tool and reasoning parser it registers on its
family's documented outputs."""

from __future__ import annotations

import pytest
from plinth.testing import ModelLoaderConformance, check_reasoning_parser, check_tool_parser, discover_all
from test_llama_vs_transformers import saved_model
from test_parsers import GOOD, REASONING

#: registered name -> the parser class whose documented outputs it reads
TOOL_PARSERS = {
    "hermes": "HermesToolParser",
    "qwen": "HermesToolParser",
    "llama3_json": "Llama3JsonToolParser",
    "mistral": "MistralToolParser",
}
REASONING_PARSERS = {"qwen3": "ThinkReasoningParser"}


class TestConformance(ModelLoaderConformance):
    name = "llama"
    tokenizer = False  # a random-weight checkpoint without tokenizer files

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path_factory):
        self.root = str(tmp_path_factory.mktemp("llama_conformance"))

    def model_path(self) -> str:
        return saved_model("llama", self.root)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_tool_parser_conformance(name):
    samples = tuple(text for cls, text, _, calls in GOOD if cls.__name__ == TOOL_PARSERS[name] and calls)
    check_tool_parser(name, samples)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_reasoning_parser_conformance(name):
    samples = tuple((prompt, text) for cls, prompt, text, reasoning, _ in REASONING if cls.__name__ == REASONING_PARSERS[name] and reasoning)
    check_reasoning_parser(name, samples)


@pytest.mark.parametrize("category", ["tool_parser", "reasoning_parser"])
def test_every_parser_it_registers_passes_the_kit_on_its_own_examples(category):
    """What `platform plugins check plinth-plugin-llama` runs: no samples given, the classes' ``examples``."""
    names = sorted(e.name for e in discover_all().entries[category] if e.distribution == "plinth-plugin-llama")
    assert names
    for name in names:
        check = check_tool_parser if category == "tool_parser" else check_reasoning_parser
        report = check(name)
        assert any(line.startswith("sample 2") for line in report.passed), name  # at least two examples each
