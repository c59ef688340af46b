"""MLA heads, the dense MLPs and every expert split over tp = 2 ranks (gloo):
each rank keeps the whole latent cache and its share of heads, and the
logits at every prompt position equal one process's; the engine at tp = 2,
and at ep = 2 (experts over two dp ranks, the nccl a2a plugin), keeps
transformers' greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plinth.testing import run_ranks
from test_deepseek_vs_transformers import load_ours, prefill_logits
from tiny_deepseek import prompts, saved_model


@pytest.mark.slow
def test_tp2_matches_one_process(tmp_path):
    path = saved_model("q_lora", str(tmp_path))
    model, ops, _ = load_ours(path)
    with torch.no_grad():
        want = [lg.numpy() for lg in prefill_logits(model, ops, prompts(), page_size=7)]
    for rank, got in enumerate(run_ranks("tp_ranks:tp_rank_logits", 2, path, timeout=240)):
        worst = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
        assert worst < 1e-4, f"rank {rank}: max |logit diff| {worst:.3g}"


@pytest.mark.slow
def test_tp2_through_the_engine_keeps_greedy_tokens(tmp_path):
    """LLM(tp=2) starts two ranks that each load their share: the greedy
    tokens of 5 concurrent prompts are transformers'."""
    from plinth import LLM, SamplingParams
    from tiny_deepseek import reference_greedy

    path = saved_model("q_lora", str(tmp_path))
    with LLM(path, dtype="float32", backend="torch", load_progress=False, tp=2, page_size=7, num_pages=200) as llm:
        outs = llm.generate(prompts(), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == reference_greedy(path, 8)


@pytest.mark.slow
def test_ep2_through_the_engine_keeps_greedy_tokens(tmp_path):
    """LLM(ep=2, a2a="nccl"): two dp ranks, each keeping 4 of the 8 routed
    experts, their tokens moving through the nccl a2a plugin over gloo: the
    greedy tokens of 5 concurrent prompts are transformers'."""
    from plinth import LLM, SamplingParams
    from tiny_deepseek import reference_greedy

    path = saved_model("q_lora", str(tmp_path))
    with LLM(path, dtype="float32", backend="torch", load_progress=False, ep=2, a2a="nccl", page_size=7, num_pages=200) as llm:
        outs = llm.generate(prompts(), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == reference_greedy(path, 8)
