"""A model plugin's own KV-cache spec (the deepseek plugin's latent cache)
sizes the pool with no MLA code in core: the budget buys the pages the
spec's bytes say, and the KV-cache manager hands out exactly that many
tokens (a fill that counts them)."""

from types import SimpleNamespace

import pytest
import torch
from plinth.api import SelectionContext
from plinth.engine.config import EngineConfig
from plinth.engine.kv_cache_manager import KVCacheManager
from plinth.engine.model_runner import ModelRunner
from plinth.engine.startup import kv_pool_pages
from plinth_plugin_torch.attention import TorchAttention

mla = pytest.importorskip("plinth_plugin_deepseek.mla")


@pytest.mark.parametrize("page_size", [16, 7])
def test_latent_pool_holds_the_tokens_its_bytes_say(page_size):
    spec = mla.MLALatentSpec(kv_lora_rank=32, rope_dim=8)
    layers, dtype = 3, torch.float32
    model = SimpleNamespace(kv_cache_specs=lambda: [spec] * layers)
    budget_gib = 1 / 1024  # 1 MiB
    config = EngineConfig.from_kwargs(page_size=page_size, kv_cache_memory=budget_gib, max_num_seqs=256)
    plan = kv_pool_pages(config, None, model, dtype, max_model_len=4096)
    token_bytes = layers * (32 + 8) * 4  # one latent and one rope key per token and layer, no heads
    assert plan.page_bytes == [page_size * token_bytes]
    assert plan.num_pages == (1 << 20) // (page_size * token_bytes)
    runner = ModelRunner(model, TorchAttention(SelectionContext()), SimpleNamespace(num_layers=layers), device=torch.device("cpu"), dtype=dtype,
                         num_pages=plan.pages, page_size=page_size)
    assert sum(t.numel() * t.element_size() for cache in runner.kv_caches for t in cache if t is not None) <= 1 << 20
    kv = KVCacheManager(runner.kv_groups)
    tokens = 0
    for i in range(10_000):
        seq = SimpleNamespace(seq_id=i, num_computed=0, num_tokens=page_size, token_ids=[0] * page_size, page_hashes=[])
        if not kv.allocate_slots(seq, page_size):
            break
        tokens += page_size
    assert tokens == plan.num_pages * page_size
    assert tokens >= ((1 << 20) // token_bytes) - page_size  # the budget's worth of tokens, to within a page

