"""MLA heads, the dense MLPs and every expert split over tp = 2 ranks (gloo):
each rank keeps the whole latent cache and its share of heads, and the
logits at every prompt position equal one process's."""

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
