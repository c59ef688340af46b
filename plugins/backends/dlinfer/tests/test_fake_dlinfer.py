"""The fake dlinfer refuses what the Ascend vendor (or its kernels) refuse, so
a backend that passes against it hands the real kernels what they take."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def ext(fake_dlinfer):
    import dlinfer.ops as ext_ops

    return ext_ops


def _cache(pages=4, block=16, heads=2, dim=8):
    return torch.zeros(pages, block, heads, dim, dtype=torch.float16), torch.zeros(pages, block, heads, dim, dtype=torch.float16)


def _decode_args(block=16, q_seq_len=None):
    k_cache, v_cache = _cache(block=block)
    q = torch.randn(2, 4, 8, dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    q_seq_len = torch.arange(1, 3, dtype=torch.int32) if q_seq_len is None else q_seq_len
    return (q, k_cache, v_cache, table, block, q_seq_len, torch.tensor([5, 9], dtype=torch.int32), 9, 4, 2)


def test_decode_returns_a_new_tensor_and_leaves_attn_output_alone(ext):
    out = torch.zeros(2, 4, 8, dtype=torch.float16)
    got = ext.paged_decode_attention(*_decode_args(), softmax_scale=0.3, attn_output=out)
    assert got.shape == (2, 4, 8) and got.data_ptr() != out.data_ptr() and float(out.abs().sum()) == 0


def test_decode_wants_cumulative_query_ends(ext):
    # TND: q_seq_len are cumulative ends (1..B for decode), not per-sequence lengths
    with pytest.raises(AssertionError):
        ext.paged_decode_attention(*_decode_args(q_seq_len=torch.ones(2, dtype=torch.int32)), attn_output=torch.empty(2, 4, 8))


def test_paged_kernels_refuse_a_block_size_not_a_power_of_two(ext):
    with pytest.raises(AssertionError, match="power of 2"):
        ext.paged_decode_attention(*_decode_args(block=24), attn_output=torch.empty(2, 4, 8))


def test_decode_needs_attn_output(ext):
    with pytest.raises(AttributeError):  # upstream calls attn_output.contiguous() (torch_npu_ops.py:395)
        ext.paged_decode_attention(*_decode_args())


def test_paged_prefill_wants_int32_block_tables_and_the_2048_mask(ext):
    k_cache, v_cache = _cache()
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    args = [q, k, v, k_cache, v_cache, torch.tensor([[0, 1]], dtype=torch.int32), 16, torch.tensor([0]),
            torch.tensor([3], dtype=torch.int32), torch.tensor([20], dtype=torch.int32), None, 3, 20, 4, 2, [mask]]
    assert ext.paged_prefill_attention(*args).shape == (3, 4, 8)
    bad = list(args)
    bad[5] = bad[5].long()
    with pytest.raises(AssertionError):
        ext.paged_prefill_attention(*bad)
    bad = list(args)
    bad[15] = [mask[:64, :64]]
    with pytest.raises(AssertionError, match="2048"):
        ext.paged_prefill_attention(*bad)


def test_fill_kv_cache_wants_ascend_layout(ext):
    k = torch.randn(3, 2, 8, dtype=torch.float16)
    k_cache, v_cache = _cache()
    ext.fill_kv_cache(k, k.clone(), k_cache, v_cache, torch.tensor([0, 17, 63]))
    assert torch.equal(k_cache[1, 1], k[1]) and torch.equal(v_cache[3, 15], k[2])
    heads_first = torch.zeros(2, 4, 16, 8, dtype=torch.float16)  # the torch reference's [Hkv, pages, page, D]
    with pytest.raises(AssertionError):
        ext.fill_kv_cache(k, k, heads_first, heads_first.clone(), torch.tensor([0, 1, 2]))


def test_fused_moe_takes_only_ids_in_range(ext):
    from dlinfer.utils.type_annotation import MoeMetadata

    x, w13, w2 = torch.randn(2, 8), torch.randn(4, 12, 8), torch.randn(4, 8, 6)
    weights = torch.full((2, 2), 0.5)
    ok = ext.fused_moe(x, w13, w2, weights, torch.tensor([[0, 3], [1, 2]]), 2, False, MoeMetadata())
    assert ok.shape == (2, 8)
    with pytest.raises(AssertionError, match="active_expert_range"):
        ext.fused_moe(x, w13, w2, weights, torch.tensor([[0, -1], [1, 2]]), 2, False, MoeMetadata())


def test_rotary_takes_three_dimensional_heads(ext):
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    cos, sin = torch.ones(3, 8), torch.zeros(3, 8)
    q_out, k_out = ext.apply_rotary_pos_emb(q, k, cos, sin)
    assert q_out.shape == (1, 3, 4, 8) and torch.allclose(q_out.view(q.shape), q)  # cos 1, sin 0: unchanged
    with pytest.raises(AssertionError):
        ext.apply_rotary_pos_emb(q.unsqueeze(0), k.unsqueeze(0), cos, sin)
