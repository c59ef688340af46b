"""The engine's scheduling, paging, prefix cache and stop handling, on a toy
model whose every output depends on reading its KV pages right."""

import random

import pytest
from plinth.engine.sampling_params import SamplingParams
from plinth.errors import RequestError
from toy_engine import EOS, VOCAB, reference, run_all, toy_engine


def _prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _check(engine, prompts, max_tokens=24, ignore_eos=True):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = run_all(engine)
    for i, p in enumerate(prompts):
        assert done[f"r{i}"].outputs[0].token_ids == reference(p, max_tokens, eos=not ignore_eos), f"request r{i}"
    assert engine.pages_held() == 0
    return done


@pytest.mark.parametrize("page_size", [1, 4, 7, 16, 48])
def test_batch_matches_reference_any_page_size(page_size):
    _check(toy_engine(page_size=page_size, num_pages=4096 // page_size + 8), _prompts(9, 1, 60))


def test_chunked_prefill_long_prompt():
    engine = toy_engine(page_size=5, num_pages=200, max_num_batched_tokens=16)
    done = _check(engine, [list(range(1, VOCAB)) * 3, [5, 6, 7]])
    assert done["r0"].outputs[0].finish_reason == "length"


def test_preemption_under_page_pressure_gives_same_output():
    # 8 sequences growing to ~70 tokens need ~140 pages of 4; the pool has 40
    engine = toy_engine(page_size=4, num_pages=40, max_num_seqs=8, max_num_batched_tokens=64)
    _check(engine, _prompts(8, 20, 40, seed=3), max_tokens=30)
    assert engine.scheduler.num_preemptions > 0


def test_preemption_without_prefix_cache():
    engine = toy_engine(page_size=3, num_pages=30, caching=False)
    _check(engine, _prompts(6, 10, 30, seed=4), max_tokens=20)
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_reuses_pages_and_output_is_identical():
    engine = toy_engine(page_size=4, num_pages=256)
    shared = _prompts(1, 50, 50, seed=5)[0]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine.add_request("a", shared + [1, 2], params)
    first = run_all(engine)["a"]
    engine.add_request("b", shared + [3, 4, 5], params)
    second = run_all(engine)["b"]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48  # the 12 full pages of the shared 50 tokens
    assert second.outputs[0].token_ids == reference(shared + [3, 4, 5], 10, eos=False)
    assert engine.pool.hit_rate() > 0


def test_identical_prompt_recomputes_last_page_only():
    engine = toy_engine(page_size=4, num_pages=64)
    prompt = list(range(1, 17))  # exactly 4 pages
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request("a", prompt, params)
    run_all(engine)
    engine.add_request("b", prompt, params)
    out = run_all(engine)["b"]
    assert out.num_cached_tokens == 12  # one token must be computed for logits: its page is recomputed
    assert out.outputs[0].token_ids == reference(prompt, 5, eos=False)


def test_n_samples_share_one_prefill():
    engine = toy_engine(page_size=4, num_pages=128)
    prompt = list(range(1, 23))  # 22 tokens: 5 full pages + a partial one, copied per sample
    engine.add_request("n", prompt, SamplingParams(n=3, max_tokens=8, temperature=0, ignore_eos=True))
    out = run_all(engine)["n"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for o in out.outputs:
        assert o.token_ids == reference(prompt, 8, eos=False)
    assert engine.stats()["prompt_tokens"] == 22
    assert engine.pages_held() == 0


def test_eos_and_max_tokens_and_stop_token_ids():
    engine = toy_engine()
    prompts = _prompts(30, 1, 12, seed=6)
    done = _check(engine, prompts, max_tokens=40, ignore_eos=False)
    reasons = {o.outputs[0].finish_reason for o in done.values()}
    assert reasons <= {"stop", "length"}
    stopped = [o for o in done.values() if o.outputs[0].finish_reason == "stop"]
    assert stopped and all(o.outputs[0].stop_reason == EOS for o in stopped)
    p = prompts[0]
    ref = reference(p, 10, eos=False)
    engine.add_request("s", p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[ref[3]]))
    out = run_all(engine)["s"].outputs[0]
    assert out.token_ids == ref[: ref.index(ref[3]) + 1] and out.finish_reason == "stop"


def test_stop_string_across_tokens_is_excluded():
    engine = toy_engine()
    p = [5, 9, 13]
    ref = reference(p, 12, eos=False)
    text = "".join(chr(0x40 + t) for t in ref)
    stop = text[4:7]  # spans three tokens
    engine.add_request("s", p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))
    out = run_all(engine)["s"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_abort_frees_pages():
    engine = toy_engine(page_size=4, num_pages=64)
    engine.add_request("x", list(range(1, 30)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.step()
    assert engine.pages_held() > 0
    out = engine.abort_request("x")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.pages_held() == 0 and not engine.has_unfinished()


def test_bad_requests_are_refused():
    engine = toy_engine(max_model_len=32, num_pages=64)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request("b", [VOCAB + 5], SamplingParams())
    with pytest.raises(RequestError, match="maximum context length"):
        engine.add_request("c", [1] * 40, SamplingParams())
    with pytest.raises(RequestError, match="max_tokens"):
        engine.add_request("d", [1] * 20, SamplingParams(max_tokens=20))
    with pytest.raises(RequestError):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestError):
        SamplingParams(top_p=0)


def test_sequence_longer_than_pool_ends_with_length():
    engine = toy_engine(page_size=4, num_pages=8)  # 32 tokens of KV
    engine.add_request("x", list(range(1, 21)), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    out = run_all(engine)["x"].outputs[0]
    assert out.finish_reason == "length"
    assert out.token_ids == reference(list(range(1, 21)), len(out.token_ids), eos=False)
    assert engine.pages_held() == 0
