"""A model with two KV-cache groups through the llama plugin, against
transformers in float32: a tiny Qwen3 whose even layers attend to a
12-token sliding window and odd layers to everything. The sliding group's
pages are freed as decoding moves past the window, and greedy tokens stay
those of transformers, with prefix caching and preemption."""

import pytest
import torch
from plinth import LLM, SamplingParams
from plinth.api import FullAttentionSpec, SlidingWindowSpec
from tiny_models import reference_greedy, tiny_model_dir

ARCH = "qwen3-hybrid"
WINDOW = 12
NEW_TOKENS = 40  # every prompt decodes past the window


def _prompts(seed=0, lens=(3, 17, 30, 45)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def _greedy(n=NEW_TOKENS):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tiny_root):
    return tiny_model_dir(ARCH, tiny_root)


@pytest.mark.parametrize("page_size", [16, 7])
def test_two_groups_greedy_tokens_match_transformers(hybrid, page_size):
    llm = LLM(hybrid, dtype="float32", backend="torch", load_progress=False, page_size=page_size, num_pages=256)
    kv = llm.engine.kv
    assert [g.spec for g in kv.groups] == [FullAttentionSpec(2, 24), SlidingWindowSpec(2, 24, window=WINDOW)]
    assert [g.layers for g in kv.groups] == [(1, 3), (0, 2)]
    prompts = _prompts()
    outs = llm.generate(prompts, _greedy())
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(hybrid, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    assert llm.engine.pages_held() == 0


def test_sliding_pages_are_freed_and_outputs_hold_under_prefix_caching_and_preemption(hybrid):
    ps = 4
    # a full pool of 48 pages (192 tokens) for 4 sequences of up to ~90 tokens: preemption
    # a small step budget admits the prompts over several steps, so later ones find the
    # first one's pages cached (a measured budget on a fast CPU takes them all in one step)
    llm = LLM(
        hybrid, dtype="float32", backend="torch", load_progress=False, page_size=ps, num_pages=48, max_num_seqs=4,
        max_num_batched_tokens=32,
    )
    engine = llm.engine
    shared = _prompts(1, (24,))[0]
    prompts = [shared + p for p in _prompts(2, (3, 9, 20, 30))]
    want = [reference_greedy(hybrid, p, NEW_TOKENS) for p in prompts]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, _greedy())
    held, done = [], {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        held.append(engine.kv.group_pages_held())
    assert [done[str(i)].outputs[0].token_ids for i in range(len(prompts))] == want
    assert engine.scheduler.num_preemptions > 0
    assert any(done[str(i)].num_cached_tokens > 0 for i in range(1, len(prompts)))  # the shared prefix was reused
    full, sliding = zip(*held)
    # the window group holds at most the window's pages (plus the one being
    # filled and this step's tokens) per running sequence; the full group grows
    assert max(full) > 2 * max(sliding), (max(full), max(sliding))
    assert engine.pages_held() == 0


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["hybrid-target", "hybrid-draft"])
def test_speculative_rollback_per_group_keeps_greedy_tokens(hybrid, tiny_root, pair):
    """A draft model proposes for a target (one of them the two-group model):
    rejected proposals roll back in every group of the target, and the draft
    rolls back its own committed proposals (starting over where its window
    already gave their pages back); greedy tokens stay transformers'."""
    from test_speculative import make_llm

    llama = tiny_model_dir("llama", tiny_root)
    target, draft = (hybrid, llama) if pair == "hybrid-target" else (llama, hybrid)
    llm = make_llm(target, page_size=4, num_pages=256, speculative_method="draft", speculative_model=draft, num_speculative_tokens=3)
    prompts = _prompts(3, (5, 20))
    outs = llm.generate(prompts, _greedy())
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(target, prompt, NEW_TOKENS)
    s = llm.engine.stats()
    assert s["spec_rejected_tokens"] > 0 and s["spec_accepted_tokens"] >= 0
    assert llm.engine.pages_held() == 0
