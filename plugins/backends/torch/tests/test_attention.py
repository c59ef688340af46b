"""Paged attention against a dense per-sequence reference."""

from __future__ import annotations

import dense_reference as ref
import pytest
import torch
from plinth.api import AttentionMetadata, SelectionContext
from plinth_plugin_torch.attention import TorchAttention, TorchPlan, build_plan, token_major

ATTENTION = TorchAttention(SelectionContext())


def attention(q, k, v, cache, meta, **kw):
    return ATTENTION.forward(q, k, v, cache, meta, **kw)


def prepare_attention(meta):
    meta.plan = ATTENTION.build_plan(meta)


def make_batch(seqs, *, page_size, num_heads, num_kv_heads, head_dim, head_dim_v=None, dtype=torch.float32, seed=0):
    """seqs: (cached prefix length, query length) per sequence. Pages are
    assigned at random from a pool, the prefixes are written into them, and
    the new tokens' q, k, v are random.

    Returns (meta, (k_pages, v_pages), q, k, v, histories), where histories
    holds each sequence's full K and V (prefix + new tokens) for the reference.
    """
    g = torch.Generator().manual_seed(seed)
    head_dim_v = head_dim_v or head_dim
    pages_per_seq = [-(-(p + n) // page_size) for p, n in seqs]
    num_pages = sum(pages_per_seq) + 5
    order = torch.randperm(num_pages, generator=g).tolist()
    # the backend's layout, with garbage everywhere the sequences do not write
    k_pages = torch.randn(num_kv_heads, num_pages, page_size, head_dim, generator=g).to(dtype)
    v_pages = torch.randn(num_kv_heads, num_pages, page_size, head_dim_v, generator=g).to(dtype)
    k_tokens, v_tokens = token_major(k_pages), token_major(v_pages)  # [page, offset, head, dim] views
    max_pages = max(pages_per_seq)
    block_tables = torch.zeros(len(seqs), max_pages, dtype=torch.int32)
    positions, slots, qs, ks, vs, histories = [], [], [], [], [], []
    for i, ((prefix, n), npages) in enumerate(zip(seqs, pages_per_seq)):
        pages = [order.pop() for _ in range(npages)]
        block_tables[i, :npages] = torch.tensor(pages)
        hist_k = torch.randn(prefix + n, num_kv_heads, head_dim, generator=g).to(dtype)
        hist_v = torch.randn(prefix + n, num_kv_heads, head_dim_v, generator=g).to(dtype)
        for pos in range(prefix):  # the cached prefix
            k_tokens[pages[pos // page_size], pos % page_size] = hist_k[pos]
            v_tokens[pages[pos // page_size], pos % page_size] = hist_v[pos]
        for pos in range(prefix, prefix + n):
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        qs.append(torch.randn(n, num_heads, head_dim, generator=g).to(dtype))
        ks.append(hist_k[prefix:])
        vs.append(hist_v[prefix:])
        histories.append((hist_k, hist_v))
    query_lens = [n for _, n in seqs]
    seq_lens = [p + n for p, n in seqs]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        page_size=page_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return meta, (k_pages, v_pages), torch.cat(qs), torch.cat(ks), torch.cat(vs), histories


def reference(meta, q, histories, scale, **kw):
    outs = []
    for i, (hk, hv) in enumerate(histories):
        a, b = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
        outs.append(ref.attention(q[a:b], hk, hv, meta.positions[a:b], scale, **kw))
    return torch.cat(outs)


MIXED = [(0, 13), (20, 5), (37, 1), (0, 1), (100, 1), (5, 30), (48, 17)]
DECODE = [(3, 1), (60, 1), (15, 1), (47, 1), (48, 1)]
PREFILL = [(0, 9), (0, 50), (0, 1), (0, 16)]


@pytest.mark.parametrize("page_size", [16, 48, 7, 1])
@pytest.mark.parametrize("seqs", [MIXED, DECODE, PREFILL], ids=["mixed", "decode", "prefill"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa"])
def test_paged_attention_matches_dense(page_size, seqs, heads):
    num_heads, num_kv = heads
    meta, cache, q, k, v, hist = make_batch(seqs, page_size=page_size, num_heads=num_heads, num_kv_heads=num_kv, head_dim=32)
    scale = 32**-0.5
    prepare_attention(meta)
    out = attention(q, k, v, cache, meta, scale=scale)
    assert out.shape == (q.shape[0], num_heads, 32)
    torch.testing.assert_close(out.double(), reference(meta, q, hist, scale), atol=1e-4, rtol=1e-4)
    # the new K/V landed at their slots
    k_flat = token_major(cache[0]).reshape(-1, num_kv, 32)
    torch.testing.assert_close(k_flat[meta.slot_mapping], k)


@pytest.mark.parametrize("page_size", [16, 7])
@pytest.mark.parametrize("seqs", [MIXED, DECODE, PREFILL], ids=["mixed", "decode", "prefill"])
def test_sliding_window_and_layers_share_the_plan(page_size, seqs):
    meta, cache, q, k, v, hist = make_batch(seqs, page_size=page_size, num_heads=6, num_kv_heads=2, head_dim=16, seed=1)
    scale = 0.3
    prepare_attention(meta)
    plan = meta.plan
    assert isinstance(plan, TorchPlan)
    # layer 1 with a window, layer 2 without, layer 3 with it again (cached masks)
    for window in (8, None, 8, 20):
        out = attention(q, k, v, cache, meta, scale=scale, sliding_window=window)
        expected = reference(meta, q, hist, scale, sliding_window=window)
        torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    assert meta.plan is plan


@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_logit_soft_cap(seqs):
    meta, cache, q, k, v, hist = make_batch(seqs, page_size=16, num_heads=4, num_kv_heads=2, head_dim=16, seed=2)
    q = q * 4  # large logits, so the cap matters
    out = attention(q, k, v, cache, meta, scale=0.5, logit_cap=5.0, sliding_window=12)
    expected = reference(meta, q, hist, 0.5, logit_cap=5.0, sliding_window=12)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    uncapped = reference(meta, q, hist, 0.5, sliding_window=12)
    assert (uncapped - expected).abs().max() > 1e-2


def test_value_head_dim_differs():
    meta, cache, q, k, v, hist = make_batch(MIXED, page_size=7, num_heads=4, num_kv_heads=2, head_dim=24, head_dim_v=16)
    out = attention(q, k, v, cache, meta, scale=0.2)
    assert out.shape == (q.shape[0], 4, 16)
    torch.testing.assert_close(out.double(), reference(meta, q, hist, 0.2), atol=1e-4, rtol=1e-4)


def test_bf16_close_to_dense():
    meta, cache, q, k, v, hist = make_batch(MIXED, page_size=16, num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    out = attention(q, k, v, cache, meta, scale=0.125)
    torch.testing.assert_close(out.double(), reference(meta, q, hist, 0.125), atol=2e-2, rtol=2e-2)


def test_plan_needs_no_device_values():
    """The plan is built from host lengths; batch order is kept for decode-only steps."""
    meta, *_ = make_batch(DECODE, page_size=16, num_heads=2, num_kv_heads=1, head_dim=8)
    plan = build_plan(meta)
    assert plan.decode is not None and plan.decode.token_index is None and not plan.prefills
    assert plan.decode.num_pages == -(-60 // 16)
    meta, *_ = make_batch(MIXED, page_size=16, num_heads=2, num_kv_heads=1, head_dim=8)
    plan = build_plan(meta)
    assert plan.decode.num_seqs == 3 and len(plan.prefills) == 4
    assert [p.prefix_len for p in plan.prefills] == [0, 20, 5, 48]
