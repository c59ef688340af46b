"""What one tensor-parallel rank computes (run by plinth.testing.run_ranks)."""

from __future__ import annotations

import torch


def tp_rank_logits(rank: int, world: int, path: str) -> list:
    import torch.distributed as dist
    from plinth.api import LoadContext, ModelSource, load_hf_config
    from plinth_plugin_deepseek.loader import DeepseekLoader
    from test_deepseek_vs_transformers import prefill_logits, torch_attention, torch_ops
    from tiny_deepseek import prompts

    ops = torch_ops()
    hf = load_hf_config(path)
    source = ModelSource(path=path, format="hf", architecture=hf["architectures"][0], hf_config=hf)
    loader = DeepseekLoader()
    cfg = loader.load_config(source)
    ctx = LoadContext(device=torch.device("cpu"), dtype=torch.float32, ops=ops, attention=torch_attention(), progress=False, tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD)
    model = loader.load_model(source, cfg, ctx)
    assert model.num_heads == model.arch.num_heads // world
    return [lg.numpy() for lg in prefill_logits(model, ops, prompts(), page_size=7)]
