"""The prompt-lookup proposer: what it proposes, its options, and that the
engine's greedy output is unchanged with it (tiny random model)."""

import os
import sys

import numpy as np
import pytest
from plinth.api import SelectionContext
from plinth_plugin_ngram.proposer import NgramIndex, NgramProposer, propose_ngram


def arr(xs):
    return np.asarray(xs, dtype=np.int64)


def test_longest_most_recent_match_is_copied():
    # suffix [3, 4] occurs twice before; the most recent is followed by 9, 9
    assert propose_ngram(arr([3, 4, 5, 6, 3, 4, 9, 9, 1, 3, 4]), 2, 1, 4) == [9, 9]
    # a longer match beats a more recent shorter one: [2, 3, 4] -> 7
    assert propose_ngram(arr([2, 3, 4, 7, 8, 3, 4, 5, 2, 3, 4]), 1, 1, 4) == [7]
    # no earlier occurrence of any suffix of length >= min_n: nothing
    assert propose_ngram(arr([1, 2, 3, 4, 5]), 3, 2, 4) == []
    assert propose_ngram(arr([1, 2, 3, 1]), 2, 2, 4) == []
    assert propose_ngram(arr([1, 2, 3, 1]), 2, 1, 4) == [2, 3]


def test_a_match_near_the_end_continues_the_pattern():
    # period 2: copying runs past the end of the sequence into its own proposals
    assert propose_ngram(arr([8, 1, 2, 1, 2]), 5, 2, 2) == [1, 2, 1, 2, 1]


def test_options_are_checked_and_state_follows_each_sequence():
    ctx = SelectionContext(options={"ngram_min_n": 0})
    assert "--ngram-min-n must be an integer >= 1" in NgramProposer.check(ctx)[0]
    assert NgramProposer.check(SelectionContext(options={"ngram_min_n": 3, "ngram_max_n": 2}))
    assert NgramProposer.check(SelectionContext()) == []

    class Spec:
        num_speculative_tokens = 3

    p = NgramProposer(SelectionContext(options={"ngram_min_n": 1}, speculative=Spec()))
    from plinth.api import ProposeItem

    toks = [5, 6, 7, 5, 6]
    assert p.propose([ProposeItem(1, toks, 2, 3)]) == [[7, 5, 6]]
    toks = toks + [7, 9]  # grows: the index is extended; 9 never occurred before
    assert p.propose([ProposeItem(1, toks, 2, 2)]) == [[]]
    assert p._indexes[1].tokens == toks
    rolled = [5, 6, 7, 5, 6, 7]  # same key, shorter (rolled back): the index is rebuilt
    assert p.propose([ProposeItem(1, rolled, 2, 2)]) == [[5, 6]]
    assert p._indexes[1].tokens == rolled
    p.free(1)
    assert 1 not in p._indexes


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 4), (2, 2), (3, 5)])
def test_incremental_index_matches_the_scan(min_n, max_n):
    """The per-step index gives propose_ngram's answer at every length of a
    growing sequence (a small alphabet, so matches of every n occur)."""
    rng = np.random.default_rng(min_n * 10 + max_n)
    toks = rng.integers(0, 5, size=300).tolist()
    idx = NgramIndex(min_n, max_n)
    for size in range(1, len(toks) + 1):
        k = 1 + size % 5
        assert idx.propose(toks[:size], k) == propose_ngram(arr(toks[:size]), k, min_n, max_n), size


def test_engine_greedy_output_unchanged(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "tests"))
    pytest.importorskip("transformers")
    from plinth import LLM, SamplingParams
    from tiny_models import tiny_model_dir

    path = tiny_model_dir("llama", str(tmp_path))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [40, 41] * 8, list(range(60, 90))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", backend="torch", load_progress=False, page_size=7)
    base = LLM(path, **kw).generate(prompts, params)
    llm = LLM(path, speculative_method="ngram", num_speculative_tokens=3, plugin_options={"ngram_min_n": 1}, **kw)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in base]
    assert llm.engine.stats()["spec_proposed_tokens"] > 0
