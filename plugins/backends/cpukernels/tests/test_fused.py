"""The attention backend's fused block (``qkv_fusion()``) against the reference backend's rotary and
attention on the same pages: decode batches (the C++ kernel), a mixed batch
(this backend's own ops), GQA/MHA, both rotary styles, partial rotary, page
sizes 16 and 7, with and without a sliding window, bfloat16 and float32; and the llama model uses it."""

import pytest
import torch
from plinth.api import SelectionContext, load_accelerator
from plinth.testing import attention_backend, op_table, random_attention_metadata


@pytest.fixture(scope="module")
def ops():
    """(the reference's ops and attention backend, cpukernels' attention backend)."""
    mine = attention_backend(SelectionContext(accelerator=load_accelerator("cpu")), "cpukernels")
    return (op_table(SelectionContext()), mine.reference), mine


def _composed(reference, qkv, positions, cos_sin, is_neox, cache, meta, *, num_heads, num_kv_heads, head_dim, scale, sliding_window):
    ref_ops, ref_attention = reference
    t = qkv.shape[0]
    q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1)
    q, k = ref_ops.rotary(q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), positions, cos_sin, is_neox)
    out = ref_attention.forward(q, k, v.view(t, num_kv_heads, head_dim), cache, meta, scale=scale, sliding_window=sliding_window)
    return out.reshape(t, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 7])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa3", "mha"])
@pytest.mark.parametrize("is_neox,rotary_dim", [(True, 64), (False, 64), (True, 32)], ids=["neox", "gptj", "partial"])
@pytest.mark.parametrize("query_lens", [[1] * 6, [1, 5, 1, 1, 3, 1]], ids=["decode", "mixed"])
@pytest.mark.parametrize("window", [None, 20])
def test_fused_equals_rotary_then_attention(ops, dtype, page_size, heads, is_neox, rotary_dim, query_lens, window):
    reference, table = ops
    num_heads, num_kv = heads
    dim = 64
    seq_lens = [1, 9, 17, 40, 70, 33]
    meta, num_pages = random_attention_metadata(query_lens, seq_lens, page_size, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    t = sum(query_lens)
    qkv = torch.randn(t, (num_heads + 2 * num_kv) * dim, generator=g).to(dtype)
    angles = torch.rand(128, rotary_dim // 2, generator=g) * 6.28
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=1)
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv, head_dim=dim, scale=dim**-0.5, sliding_window=window)
    outs, caches = [], []
    for which in ("fused", "reference"):
        attention = table if which == "fused" else reference[1]
        cache = attention.allocate(
            num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv, head_dim=dim, v_head_dim=dim, dtype=dtype,
            device=torch.device("cpu"),
        )
        gen = torch.Generator().manual_seed(5)
        for pages in cache:
            pages.copy_(torch.randn(pages.shape, generator=gen).to(dtype))
        meta.plan = attention.build_plan(meta)
        if which == "fused":
            outs.append(table.qkv_fusion()(qkv, meta.positions, cos_sin, is_neox, cache, meta, **kw))
        else:
            outs.append(_composed(reference, qkv, meta.positions, cos_sin, is_neox, cache, meta, **kw))
        caches.append(cache)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[0].float(), outs[1].float(), **tol)
    for a, b in zip(*caches):  # k rotated and v copied into the same slots, rounded the same way
        torch.testing.assert_close(a.float(), b.float(), **tol)
