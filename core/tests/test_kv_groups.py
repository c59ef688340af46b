"""KV-cache groups: a model with a full-attention layer and a sliding-window
layer (the toy's ``window``), whose outputs must equal the reference
exactly under paging, chunking, preemption, prefix caching, n>1 forks and a
KV connector, while the sliding group frees what falls out of its window."""

import pytest
import torch
from plinth import SamplingParams
from plinth.api import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from plinth.engine.kv_cache_manager import KVCacheManager, make_group
from plinth.engine.sequence import Request, Sequence
from toy_engine import reference, run_all, toy_engine

WINDOW = 6


def _prompts(n, lo, hi, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _check(engine, prompts, max_tokens=24, window=WINDOW, **kw):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw))
    done = run_all(engine)
    for i, p in enumerate(prompts):
        want = reference(p, max_tokens, eos=False, window=window)
        for c in done[str(i)].outputs:
            assert c.token_ids == want, f"prompt {i} ({len(p)} tokens), sample {c.index}"
    assert engine.pages_held() == 0
    return done


def test_specs_say_their_bytes_and_group_by_equality():
    full, same = FullAttentionSpec(2, 16), FullAttentionSpec(2, 16, v_head_dim=16)
    window = SlidingWindowSpec(2, 16, window=8)
    assert full == same and hash(full) == hash(same) and full != window
    assert full.page_bytes(16, torch.bfloat16) == 16 * 2 * (16 + 16) * 2
    assert FullAttentionSpec(1, 576, v_head_dim=0).page_bytes(4, torch.float32) == 4 * 576 * 4  # V shares K's pages
    assert full.first_needed(100) == 0 and window.first_needed(100) == 93 and window.first_needed(3) == 0
    with pytest.raises(TypeError):
        KVCacheSpec()  # abstract
    with pytest.raises(ValueError):
        SlidingWindowSpec(2, 16)  # no window


@pytest.mark.parametrize("page_size", [4, 7, 1])
def test_two_groups_match_the_reference(page_size):
    engine = toy_engine(page_size=page_size, num_pages=2048 // page_size, window=WINDOW)
    assert [g.layers for g in engine.kv.groups] == [(0,), (1,)]
    _check(engine, _prompts(9, 1, 40))


def test_sliding_group_pages_stay_bounded_while_decoding_far_past_the_window():
    ps = 4
    engine = toy_engine(page_size=ps, num_pages=200, window=WINDOW, window_pages=8)
    prompt = _prompts(1, 20, 21)[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
    held = []
    while engine.has_unfinished():
        outs = engine.step()
        held.append(engine.kv.group_pages_held())
    assert outs[0].outputs[0].token_ids == reference(prompt, 300, eos=False, window=WINDOW)
    full, sliding = zip(*held[:-1])  # the last step finished the request: nothing held
    assert full[-1] == -(-(len(prompt) + 299) // ps)  # the full group keeps every page
    # the window's pages plus the one being filled, however long it decodes
    assert max(sliding) <= -(-(WINDOW - 1) // ps) + 1, max(sliding)
    assert held[-1] == [0, 0]


def test_preemption_and_chunks_with_a_small_sliding_pool():
    """Decode-time pressure on the full pool preempts; a window pool much
    smaller than the full one never runs short for the scheduler."""
    engine = toy_engine(page_size=4, num_pages=40, window=WINDOW, window_pages=24, max_num_batched_tokens=16)
    _check(engine, _prompts(8, 5, 30, seed=1), max_tokens=40)
    assert engine.scheduler.num_preemptions > 0


def test_preemption_without_prefix_cache():
    engine = toy_engine(page_size=3, num_pages=30, caching=False, window=WINDOW)
    _check(engine, _prompts(6, 5, 25, seed=2), max_tokens=30)
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_reuses_pages_of_both_groups():
    engine = toy_engine(page_size=4, num_pages=256, window=WINDOW)
    shared = _prompts(1, 33, 34, seed=3)[0]
    _check(engine, [shared + [5, 6, 7]], max_tokens=8)
    done = _check(engine, [shared + [9, 9]], max_tokens=8)
    assert done["0"].num_cached_tokens == 32  # every full page of the shared part


def test_a_prefix_whose_window_pages_were_evicted_is_not_reused():
    """The full group still caches the whole prefix, the sliding group lost
    the pages its window needs: the hit shrinks to what both hold (here
    nothing), and the output stays exact."""
    engine = toy_engine(page_size=4, num_pages=256, window=WINDOW, window_pages=12)
    shared = _prompts(1, 33, 34, seed=4)[0]
    _check(engine, [shared + [5]], max_tokens=4)
    sliding = engine.kv.groups[1].pool
    sliding.release(sliding.allocate(sliding.num_free))  # evicts every cached sliding page
    done = _check(engine, [shared + [8]], max_tokens=4)
    assert done["0"].num_cached_tokens == 0


def test_n_samples_fork_in_both_groups():
    engine = toy_engine(page_size=4, num_pages=128, window=WINDOW)
    _check(engine, _prompts(3, 9, 30, seed=5), max_tokens=20, n=3, seed=1)


def _seq(tokens):
    return Sequence(Request("x", None, list(tokens), SamplingParams(max_tokens=1)), 0, list(tokens))


def test_hybrid_hit_rule_takes_the_longest_prefix_every_window_allows():
    ps, window = 4, 6
    groups = [
        make_group(FullAttentionSpec(1, 1), (0,), 32, ps, enable_caching=True),
        make_group(SlidingWindowSpec(1, 1, window=window), (1,), 32, ps, enable_caching=True),
    ]
    kv = KVCacheManager(groups)
    first = _seq(range(1, 26))  # 6 full pages of 25 tokens
    assert kv.get_computed_tokens(first) == 0
    assert kv.allocate_slots(first, 25)
    kv.commit(first, 25)
    tables = kv.block_table(first)
    null = groups[1].null_page
    # the next query (token 25) reads tokens 20..25: pages 5, 6; pages 0..4 went back (still cached)
    assert tables[1][:5] == [null] * 5 and null not in tables[1][5:]
    assert groups[0].null_page is None and len(set(tables[0])) == 7  # the full group holds every page
    kv.free(first)
    # evict sliding page 2 (tokens 8..11): a prefix of 6 pages needs pages 4, 5 (tokens 18..23), still cached
    h = first.page_hashes
    sliding = groups[1].pool
    sliding.page_hash[sliding.cached.pop(h[2])] = None
    again = _seq(range(1, 27))
    assert kv.get_computed_tokens(again) == 24
    t = kv.block_table(again)
    assert len(t[0]) == 6 and t[1][:4] == [null] * 4
    kv.free(again)
    # evict page 5 too: 6 pages cannot be reused; 5 pages need pages 3, 4 (tokens 14..19)
    sliding.page_hash[sliding.cached.pop(h[5])] = None
    third = _seq(range(1, 27))
    assert kv.get_computed_tokens(third) == 20
    kv.free(third)
    assert kv.pages_held() == 0


def test_a_second_engine_loads_both_groups_through_a_connector():
    """Pages travel with every group's K/V: the loading engine computes only
    the tail, and its sliding-window layer reads what was loaded."""
    from test_kv_connector_engine import DictStore

    store = DictStore()

    def engine():
        return toy_engine(page_size=4, num_pages=128, window=WINDOW, connector=store.connector, connector_options={"deadline_s": 5})

    a, b = engine(), engine()
    assert a.executor.runner.page_bytes() == 2 * 2 * 4 * 8  # two layers, K and V, 4 tokens of float64
    prompt = _prompts(1, 42, 43, seed=6)[0]
    a.add_request("a", prompt + [5], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    run_all(a)
    a.kv.connector.flush(5)
    b.add_request("b", prompt + [7, 8], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    out = run_all(b)["b"]
    assert out.num_external_cached_tokens == 40
    assert out.outputs[0].token_ids == reference(prompt + [7, 8], 6, eos=False, window=WINDOW)
    assert b.pages_held() == 0


def test_rollback_keeps_pages_unless_the_window_already_let_them_go():
    ps = 4
    groups = [
        make_group(FullAttentionSpec(1, 1), (0,), 32, ps, enable_caching=False),
        make_group(SlidingWindowSpec(1, 1, window=6), (1,), 32, ps, enable_caching=False),
    ]
    kv = KVCacheManager(groups)
    seq = _seq(range(1, 31))
    assert kv.allocate_slots(seq, 30)
    kv.commit(seq, 30)  # the next query reads from token 25 (page 6): pages 0..5 went back
    assert kv.rollback(seq, 29) == 29 and seq.num_computed == 29  # reads from 24: page 6, still held
    assert kv.num_pages_of(seq) == 8
    assert kv.rollback(seq, 27) == 0 and seq.num_computed == 0  # reads from 22: page 5 is gone, start over
    assert kv.num_pages_of(seq) == 0 and kv.pages_held() == 0


class _DescribedModel:
    """Only what pool sizing reads of a model."""

    def kv_cache_specs(self):
        full, window = FullAttentionSpec(2, 8), SlidingWindowSpec(2, 8, window=16)
        return [full, window, None, full, window]  # the middle layer caches nothing

    def weight_bytes(self):
        return 0


def test_pool_sizes_come_from_the_specs():
    from plinth.engine.config import EngineConfig
    from plinth.engine.startup import kv_pool_pages

    cfg = dict(page_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    plan = kv_pool_pages(EngineConfig.from_kwargs(kv_cache_memory=1 / 1024, **cfg), None, _DescribedModel(), torch.float32, max_model_len=4096)
    # a page: 16 tokens x 2 heads x (8 + 8) x 4 bytes = 2048 bytes a layer, two layers a group
    assert plan.page_bytes == [4096, 4096]
    # the window group: 4 sequences x (its 16-token window + the page being filled) + a 64-token step
    assert plan.pages[1] == 4 * 2 + 4
    assert plan.pages[0] == (1 << 20) // 4096 - 12  # the rest of the 1 MiB budget
    assert plan.total_bytes <= 1 << 20
    explicit = kv_pool_pages(EngineConfig.from_kwargs(num_pages=100, **cfg), None, _DescribedModel(), torch.float32, max_model_len=4096)
    assert explicit.pages == [100, 12] and explicit.budget is None
