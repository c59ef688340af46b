"""Tiny random Gemma 3 text models against transformers in float32: every
prefill logit (prompts longer than the window, in one step and in chunks
over paged KV), and 32 greedy tokens through the engine for 5 concurrent
prompts at page sizes 16 and 7 with prefix caching and preemption forced."""

from __future__ import annotations

import pytest
import torch
from paged import load_ours, paged_logits, torch_ops
from plinth import LLM, SamplingParams
from tiny_gemma import CONFIGS, prompts, reference_greedy, reference_logits, saved_model

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny_gemma"))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_transformers(root, name):
    path = saved_model(name, root)
    ops = torch_ops()
    model, cfg = load_ours(path, ops)
    windows = {w for w in model.arch.sliding_windows if w}
    worst = 0.0
    for prompt in prompts([3, 29, 61]):
        ref = reference_logits(path, prompt)
        for page_size, chunk in ((16, len(prompt)), (7, 11)):  # one step; chunks over a cached prefix
            ours = paged_logits(model, ops, cfg, prompt, page_size=page_size, chunk=chunk)
            worst = max(worst, (ours - ref).abs().max().item())
    assert max(windows) < 29  # the longer prompts run past every window
    assert worst < 1e-4, f"max |logit diff| {worst:.3g}"


def test_config_and_layout(root):
    path = saved_model("gemma3", root)
    model, cfg = load_ours(path, torch_ops())
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("Gemma3ForCausalLM", 3, 4, 2, 32)
    assert [layer.sliding_window for layer in model.layers] == [8, 8, None]
    global_table, local_table = model.tables
    assert all(layer.cos_sin is (local_table if layer.sliding_window else global_table) for layer in model.layers)
    assert not torch.equal(global_table, local_table)  # two rope bases
    assert model.arch.scale == pytest.approx(24**-0.5)
    assert model.lm_head is model.embed  # tied
    assert model.layers[0].qkv.shape == ((4 + 2 + 2) * 32, 64)
    untied, _ = load_ours(saved_model("gemma3-softcap", root), torch_ops())
    assert untied.lm_head is not untied.embed
    assert (untied.arch.attn_logit_softcapping, untied.arch.final_logit_softcapping) == (20.0, 15.0)


_engines: dict = {}


def _llm(path, **kw):
    key = (path, tuple(sorted(kw.items())))
    if key not in _engines:
        _engines.clear()  # one engine at a time keeps memory flat
        _engines[key] = LLM(path, dtype="float32", load_progress=False, **kw)
    return _engines[key]


def _greedy(n=NEW_TOKENS):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, page_size, backend",
    [(name, page_size, "torch") for name in CONFIGS for page_size in (16, 7)] + [("gemma3", 16, "cpukernels"), ("gemma3", 7, "cpukernels")],
)
def test_greedy_with_prefix_caching_and_preemption(root, name, page_size, backend):
    """5 concurrent prompts sharing a 40-token prefix, in a pool too small for
    all of them at once: later prompts reuse the cached prefix, sequences
    are preempted and recomputed, and every token stays transformers'
    (cpukernels: its decode kernel takes the window)."""
    path = saved_model(name, root)
    shared = prompts([40], seed=7)[0]
    batch = [shared + tail for tail in prompts([5, 9, 2, 14, 20], seed=1)]
    # one prompt plus its 32 tokens needs ~96 / page_size pages; five at once need five times that
    need_one = -(-(len(batch[-1]) + NEW_TOKENS) // page_size)
    llm = _llm(path, backend=backend, page_size=page_size, num_pages=2 * need_one + 1, max_num_batched_tokens=64)
    first = llm.generate([shared + [1, 2, 3]], _greedy())[0]  # fills the prefix cache
    assert first.outputs[0].token_ids == reference_greedy(path, tuple(shared + [1, 2, 3]), NEW_TOKENS)
    preempted = llm.engine.scheduler.num_preemptions
    outs = llm.generate(batch, _greedy())
    assert llm.engine.scheduler.num_preemptions > preempted
    assert any(out.num_cached_tokens >= 40 // page_size * page_size for out in outs)
    for prompt, out in zip(batch, outs):
        assert out.outputs[0].token_ids == reference_greedy(path, tuple(prompt), NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    assert llm.engine.pages_held() == 0
