"""Tiny random DeepSeek-V3 models (with and without q_lora_rank) against
transformers in float32: every prompt position's logits through the paged
latent cache (expanded MLA), and 32 greedy tokens through the engine
(absorbed MLA for decodes) for 5 concurrent prompts at page sizes 16 and 7,
with prefix caching and preemption."""

from __future__ import annotations

import pytest
import torch
from plinth import LLM, SamplingParams
from plinth.api import (
    AttentionBackend,
    AttentionMetadata,
    LoadContext,
    ModelSource,
    OpTable,
    SelectionContext,
    load_hf_config,
)
from plinth_plugin_deepseek.loader import DeepseekLoader
from plinth_plugin_deepseek.mla import MLALatentSpec
from tiny_deepseek import VARIANTS, prompts, reference, reference_greedy, saved_model

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny_deepseek"))


def torch_ops() -> OpTable:
    from plinth_plugin_torch.backend import TorchBackend

    return OpTable(TorchBackend(SelectionContext()).ops())


def torch_attention() -> AttentionBackend:
    from plinth_plugin_torch.attention import TorchAttention

    return TorchAttention(SelectionContext())


def load_ours(path: str):
    ops = torch_ops()
    hf = load_hf_config(path)
    source = ModelSource(path=path, format="hf", architecture=hf["architectures"][0], hf_config=hf)
    loader = DeepseekLoader()
    cfg = loader.load_config(source)
    model = loader.load_model(source, cfg, LoadContext(device=torch.device("cpu"), dtype=torch.float32, ops=ops, attention=torch_attention(), progress=False))
    return model, ops, cfg


def prefill_logits(model, ops, seqs: list[list[int]], page_size: int) -> list[torch.Tensor]:
    """Every prompt in one step over shuffled (non-contiguous) pages of the latent cache."""
    spec = model.kv_cache_specs()[0]
    pages_each = [-(-len(s) // page_size) for s in seqs]
    order = torch.randperm(sum(pages_each) + 3, generator=torch.Generator().manual_seed(1)).tolist()
    attention = model.attention
    caches = [attention.allocate(num_pages=len(order), page_size=page_size, dtype=torch.float32, device=torch.device("cpu"), **spec.allocation())
              for _ in model.kv_cache_specs()]
    tables, slots, positions, ids, starts = [], [], [], [], [0]
    for s, n in zip(seqs, pages_each):
        table = [order.pop() for _ in range(n)]
        tables.append(table + [0] * (max(pages_each) - n))
        positions += range(len(s))
        slots += [table[p // page_size] * page_size + p % page_size for p in range(len(s))]
        ids += s
        starts.append(starts[-1] + len(s))
    lens = [len(s) for s in seqs]
    meta = AttentionMetadata(
        positions=torch.tensor(positions), slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32), page_size=page_size,
        max_query_len=max(lens), max_seq_len=max(lens), query_lens_cpu=lens, seq_lens_cpu=lens,
    )
    meta.plan = attention.build_plan(meta)
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(ids), meta.positions, caches, meta))
    return [logits[a:b] for a, b in zip(starts, starts[1:])]


@pytest.mark.parametrize("name", VARIANTS)
def test_prefill_logits_match_transformers(root, name):
    path = saved_model(name, root)
    model, ops, cfg = load_ours(path)
    assert (model.arch.q_lora_rank is None) == (name == "no_q_lora")
    assert [layer.router is not None for layer in model.layers] == [False, False, True, True]
    worst = 0.0
    with torch.no_grad():
        for prompt, logits in zip(prompts(), prefill_logits(model, ops, prompts(), page_size=7)):
            ref = reference(path)(torch.tensor([prompt])).logits[0]
            worst = max(worst, (logits - ref).abs().max().item())
    assert worst < 1e-4, f"max |logit diff| {worst:.3g}"


def _greedy(n=NEW_TOKENS):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "page_size"), [("q_lora", 16), ("no_q_lora", 7)])  # each variant, each page size (3 min each, loaded)
def test_greedy_tokens_match_transformers_with_prefix_caching_and_preemption(root, name, page_size):
    path = saved_model(name, root)
    want = reference_greedy(path, NEW_TOKENS)
    ps = prompts()
    # pages for about two of the longest sequences at once: the scheduler must preempt
    num_pages = 2 * -(-(max(map(len, ps)) + NEW_TOKENS) // page_size) + 2
    llm = LLM(path, dtype="float32", backend="torch", load_progress=False, page_size=page_size, num_pages=num_pages,
              enable_prefix_caching=True)
    engine = llm.engine
    assert [g.spec for g in engine.kv.groups] == [MLALatentSpec(16, 8)]
    outs = llm.generate(ps, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == want
    assert engine.scheduler.num_preemptions > 0
    # the same prompts again: their full pages come from the prefix cache
    again = llm.generate(ps, _greedy())
    assert [o.outputs[0].token_ids for o in again] == want
    assert sum(o.num_cached_tokens for o in again) > 0
    assert engine.pages_held() == 0
