"""Gemma 3's layers through the KV cache specs: the sliding-window layers
form their own group, whose pages behind the window go back to the pool
while a sequence decodes far past it, and tokens stay transformers'."""

from __future__ import annotations

from plinth import LLM, SamplingParams
from plinth.api import FullAttentionSpec, SlidingWindowSpec
from tiny_gemma import prompts, reference_greedy, saved_model

WINDOW = 8  # the "gemma3" tiny config's
PAGE = 4
NEW_TOKENS = 120  # 15 windows past the prompt


def test_sliding_group_pages_stay_bounded_while_decoding_far_past_the_window(tmp_path):
    path = saved_model("gemma3", str(tmp_path))
    llm = LLM(path, dtype="float32", backend="torch", load_progress=False, page_size=PAGE, num_pages=128)
    engine = llm.engine
    kv = engine.kv
    assert [g.spec for g in kv.groups] == [FullAttentionSpec(2, 32), SlidingWindowSpec(2, 32, window=WINDOW)]
    assert [g.layers for g in kv.groups] == [(2,), (0, 1)]
    prompt = prompts([20], seed=5)[0]
    engine.add_request("0", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    held, done = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done = out
        held.append(kv.group_pages_held())
    full, sliding = zip(*held)
    # a window of 8 tokens touches at most 3 pages of 4, plus this step's tokens; the full group holds everything
    assert max(sliding[1:]) <= -(-WINDOW // PAGE) + 1, sliding
    assert max(full) == -(-(len(prompt) + NEW_TOKENS - 1) // PAGE)
    assert done.outputs[0].token_ids == reference_greedy(path, tuple(prompt), NEW_TOKENS)
    assert engine.pages_held() == 0
