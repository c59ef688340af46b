"""The draft-model proposer: check() reasons, and greedy output unchanged
with a draft run by the core (tiny random models sharing a tokenizer)."""

import os
import sys

import pytest
from plinth.api import SelectionContext
from plinth_plugin_draft.proposer import DraftProposer, tokenizer_difference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "tests"))


class Tok:
    def __init__(self, vocab):
        self.vocab_size = len(vocab)
        self._v = vocab

    def raw_vocab(self):
        return list(self._v)


def test_tokenizer_difference():
    assert tokenizer_difference(Tok(["a", "b"]), Tok(["a", "b"])) is None
    assert "vocabulary sizes 2 (draft) and 3 (target)" in tokenizer_difference(Tok(["a", "b"]), Tok(["a", "b", "c"]))
    assert "token 1 is 'x' in the draft and 'b' in the target" in tokenizer_difference(Tok(["a", "x"]), Tok(["a", "b"]))


def test_check_reasons():
    assert DraftProposer.check(SelectionContext()) == []  # `platform plugins`: nothing to judge

    class Spec:
        speculative_model = None

    assert "--speculative-model PATH is required" in DraftProposer.check(SelectionContext(speculative=Spec()))[0]

    class Broken(Spec):
        speculative_model = "/nowhere"
        tokenizer = Tok(["a"])

        @staticmethod
        def load_tokenizer(path):
            raise FileNotFoundError(path)

    assert DraftProposer.check(SelectionContext(speculative=Broken()))[0].startswith("the draft model /nowhere cannot load")


def test_engine_greedy_output_unchanged(tmp_path):
    pytest.importorskip("transformers")
    from plinth import LLM, SamplingParams
    from tiny_models import tiny_model_dir

    target = tiny_model_dir("llama", str(tmp_path))
    draft = tiny_model_dir("qwen2", str(tmp_path))  # another architecture, the same tokenizer
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5], list(range(60, 90))]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", backend="torch", load_progress=False, page_size=7)
    base = LLM(target, **kw).generate(prompts, params)
    for d in (draft, target):
        llm = LLM(target, speculative_method="draft", speculative_model=d, num_speculative_tokens=3, **kw)
        got = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in base]
        s = llm.engine.stats()
        assert s["spec_proposed_tokens"] > 0
        if d == target:  # the target drafting for itself: every proposal passes
            assert s["spec_acceptance_rate"] == 1.0
        # finished sequences' draft caches are dropped: nothing held in the draft's pool
        runner = llm.engine.spec.proposer.runner
        assert runner.kv.pages_held() == 0 and not runner.seqs
