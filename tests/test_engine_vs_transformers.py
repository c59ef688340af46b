"""The engine with the torch backend and the llama plugin against
transformers (the reference implementation), in float32: logits, greedy
tokens, and that paging, prefix caching, preemption and chunked prefill never
change an output."""

import math

import pytest
import torch
from plinth import LLM, SamplingParams
from tiny_models import reference_greedy, reference_logprobs, tiny_model_dir

ARCHS = ["llama", "llama3-rope", "qwen2", "qwen3", "mistral"]
PROMPT_LENS = [3, 17, 40, 64, 101]
NEW_TOKENS = 32


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


_engines = {}


def _llm(path, **kw):
    key = (path, tuple(sorted(kw.items())))
    if key not in _engines:
        _engines.clear()  # one engine at a time keeps memory flat
        kw.setdefault("num_pages", 4096 // kw.get("page_size", 16) + 16)
        _engines[key] = LLM(path, dtype="float32", backend="torch", load_progress=False, **kw)
    return _engines[key]


def _greedy(n=NEW_TOKENS, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("page_size", [16, 48, 7])
def test_greedy_tokens_match_transformers(tiny_root, arch, page_size):
    path = tiny_model_dir(arch, tiny_root)
    prompts = _prompts()
    outs = _llm(path, page_size=page_size).generate(prompts, _greedy())
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(path, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logprobs_match_transformers(tiny_root, arch):
    """Every prompt position's log-probabilities (the logits up to a constant)."""
    path = tiny_model_dir(arch, tiny_root)
    prompts = _prompts(1)
    outs = _llm(path, page_size=7).generate(prompts, _greedy(1, prompt_logprobs=5, logprobs=5))
    for prompt, out in zip(prompts, outs):
        ref = reference_logprobs(path, prompt + out.outputs[0].token_ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        worst = 0.0
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=0):
            worst = max(worst, abs(entry.logprob - ref[pos, prompt[pos + 1]].item()))
            for alt in entry.top:
                worst = max(worst, abs(alt.logprob - ref[pos, alt.token_id].item()))
            assert [a.token_id for a in entry.top] == ref[pos].topk(5).indices.tolist()
        sampled = out.outputs[0].logprobs[0]
        worst = max(worst, abs(sampled.logprob - ref[len(prompt) - 1, sampled.token_id].item()))
        assert worst < 1e-4


def test_prefix_cache_reuses_pages_with_identical_output(tiny_root):
    path = tiny_model_dir("qwen3", tiny_root)
    llm = _llm(path, page_size=16)
    shared = _prompts(2)[4][:96]
    first = llm.generate([shared + [5, 6, 7]], _greedy())[0]
    second = llm.generate([shared + [9, 10]], _greedy())[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96
    assert second.outputs[0].token_ids == reference_greedy(path, shared + [9, 10], NEW_TOKENS)


def test_preemption_keeps_outputs_identical(tiny_root):
    path = tiny_model_dir("llama", tiny_root)
    prompts = _prompts(3)
    # together the 5 sequences need 130 pages of 3 tokens; the longest alone 45
    llm = _llm(path, page_size=3, num_pages=50)
    outs = llm.generate(prompts, _greedy())
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(path, prompt, NEW_TOKENS)
    assert llm.engine.pages_held() == 0


def test_chunked_prefill_keeps_outputs_identical(tiny_root):
    path = tiny_model_dir("mistral", tiny_root)
    prompts = _prompts(4)
    llm = _llm(path, page_size=16, max_num_batched_tokens=16)
    outs = llm.generate(prompts, _greedy())
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(path, prompt, NEW_TOKENS)


def test_sampling_seed_top_k_and_logprobs(tiny_root):
    path = tiny_model_dir("qwen2", tiny_root)
    llm = _llm(path, page_size=16)
    prompt = _prompts(5)[2]
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True, logprobs=3)
    a = llm.generate([prompt], seeded)[0].outputs[0]
    # the same seed in a different batch gives the same tokens
    b = llm.generate([prompt, _prompts(6)[1]], [seeded, SamplingParams(max_tokens=8, temperature=0.8)])[0].outputs[0]
    assert a.token_ids == b.token_ids
    other = llm.generate([prompt], seeded.clone(seed=99))[0].outputs[0]
    assert other.token_ids != a.token_ids
    # top_k=1 is greedy whatever the temperature
    k1 = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=1.7, top_k=1, ignore_eos=True))[0]
    assert k1.outputs[0].token_ids == reference_greedy(path, prompt, 24)
    # logprobs are the reference log_softmax at each sampled position
    ref = reference_logprobs(path, prompt + a.token_ids)
    for i, entry in enumerate(a.logprobs):
        assert math.isclose(entry.logprob, ref[len(prompt) - 1 + i, entry.token_id].item(), abs_tol=1e-4)
        assert [x.token_id for x in entry.top] == ref[len(prompt) - 1 + i].topk(3).indices.tolist()


def test_stop_strings_end_the_text_and_are_excluded(tiny_root):
    path = tiny_model_dir("llama", tiny_root)
    llm = _llm(path, page_size=16)
    prompt = _prompts(7)[3]
    full = llm.generate([prompt], _greedy(40))[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[8:12]
    out = llm.generate([prompt], _greedy(40, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text


def test_n_samples_fork_after_one_prefill(tiny_root):
    path = tiny_model_dir("llama", tiny_root)
    llm = _llm(path, page_size=7)
    prompt = _prompts(8)[3]  # 64 tokens: a partial last page of 7
    before = llm.engine.stats()["prompt_tokens"]
    out = llm.generate([prompt], SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert llm.engine.stats()["prompt_tokens"] - before == len(prompt)  # one prefill
    assert sorted(o.index for o in out.outputs) == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # each sample is what its own seed gives alone: the forked pages hold the right KV
    for o in out.outputs:
        alone = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=3 + o.index, ignore_eos=True))[0]
        assert alone.outputs[0].token_ids == o.token_ids
