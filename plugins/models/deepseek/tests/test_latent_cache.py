"""The paged latent cache: page bytes from the spec (the engine-side count
of tokens a budget holds is tests/test_kv_latent_pool.py), and the absorbed (decode) form of MLA equal
to the expanded (prefill) form."""

from __future__ import annotations

import pytest
import torch
from plinth.api import AttentionMetadata, FullAttentionSpec
from plinth_plugin_deepseek.mla import MLALatentSpec, mla_decode, mla_prefill
from test_deepseek_vs_transformers import torch_ops

SPEC = MLALatentSpec(kv_lora_rank=512, rope_dim=64)  # DeepSeek-V3's latent


def test_page_bytes_per_token_not_per_head():
    assert SPEC.page_bytes(16, torch.bfloat16) == 16 * (512 + 64) * 2
    # DeepSeek-V3 with per-head K (192) and V (128) for its 128 heads would take 71x more
    per_head = FullAttentionSpec(128, 192, v_head_dim=128)
    assert per_head.page_bytes(16, torch.bfloat16) // SPEC.page_bytes(16, torch.bfloat16) == 71
    assert MLALatentSpec(512, 64) == SPEC and MLALatentSpec(512, 32) != SPEC  # equal specs: one group


def _meta(query_lens, seq_lens, page_size, num_pages, g):
    tables, slots, positions, starts = [], [], [], [0]
    free = torch.randperm(num_pages, generator=g).tolist()
    width = max(-(-s // page_size) for s in seq_lens)
    for q, s in zip(query_lens, seq_lens):
        table = [free.pop() for _ in range(-(-s // page_size))]
        tables.append(table + [0] * (width - len(table)))
        for p in range(s - q, s):
            positions.append(p)
            slots.append(table[p // page_size] * page_size + p % page_size)
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        positions=torch.tensor(positions), slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32), page_size=page_size,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
    )


@pytest.mark.parametrize("page_size", [16, 7])
def test_absorbed_equals_expanded(page_size):
    """Decode's absorbed form and prefill's expanded form give the same
    output over the same cache (mixed batch: a prefill chunk with a cached
    prefix, decodes, a fresh prompt), float64 so the check is tight."""
    g = torch.Generator().manual_seed(page_size)
    heads, dn, dr, dv, rank = 4, 8, 4, 6, 16
    spec = MLALatentSpec(rank, dr)
    ops = torch_ops()
    query_lens, seq_lens = [5, 1, 1, 9], [20, 33, 2, 9]
    num_pages = 40
    caches = [ops.allocate_kv_cache(num_pages=num_pages, page_size=page_size, dtype=torch.float64, device=torch.device("cpu"), **spec.allocation()) for _ in range(2)]
    meta = _meta(query_lens, seq_lens, page_size, num_pages, g)
    caches[0][0].copy_(torch.randn(caches[0][0].shape, generator=g, dtype=torch.float64))  # earlier tokens
    t = sum(query_lens)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    args = (r(t, heads, dn), r(t, heads, dr), r(t, rank), r(t, dr))
    w = dict(w_uk=r(heads, dn, rank), w_uv=r(heads, dv, rank), scale=0.3)
    caches[1][0].copy_(caches[0][0])  # the same earlier tokens in both caches
    expanded = mla_prefill(*args, caches[0], meta, **w)
    absorbed = mla_decode(*args, caches[1], meta, **w)
    assert expanded.shape == (t, heads, dv)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-9, atol=1e-9)
    assert torch.equal(caches[0][0], caches[1][0])  # both wrote the step's tokens to the same slots
    # and the step's tokens are where the slot mapping says
    rows = caches[0][0][0].reshape(-1, rank + dr)
    assert torch.equal(rows[meta.slot_mapping], torch.cat((args[2], args[3]), -1))
