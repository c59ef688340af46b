"""The paged latent cache: page bytes from the spec (the engine-side count
of tokens a budget holds is tests/test_kv_latent_pool.py), the absorbed
(decode) form of MLA equal to the expanded (prefill) form and to a
per-sequence float64 definition, in either page layout an attention backend
declares, with no host sync and a number of operations that does not grow
with the number of sequences (one batched computation, no loop over them)."""

from __future__ import annotations

import pytest
import torch
from plinth.api import HEADS_FIRST, PAGES_FIRST, AttentionMetadata, FullAttentionSpec, SelectionContext
from plinth_plugin_deepseek.mla import MLALatentSpec, latent_pages, mla_decode, mla_prefill
from test_deepseek_vs_transformers import torch_attention

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
    attention = torch_attention()
    query_lens, seq_lens = [5, 1, 1, 9], [20, 33, 2, 9]
    num_pages = 40
    caches = [attention.allocate(num_pages=num_pages, page_size=page_size, dtype=torch.float64, device=torch.device("cpu"), **spec.allocation()) for _ in range(2)]
    meta = _meta(query_lens, seq_lens, page_size, num_pages, g)
    caches[0][0].copy_(torch.randn(caches[0][0].shape, generator=g, dtype=torch.float64))  # earlier tokens
    t = sum(query_lens)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    args = (r(t, heads, dn), r(t, heads, dr), r(t, rank), r(t, dr))
    w = dict(w_uk=r(heads, dn, rank), w_uv=r(heads, dv, rank), scale=0.3)
    caches[1][0].copy_(caches[0][0])  # the same earlier tokens in both caches
    expanded = mla_prefill(*args, latent_pages(attention.layout, caches[0]), meta, **w)
    absorbed = mla_decode(*args, latent_pages(attention.layout, caches[1]), meta, **w)
    assert expanded.shape == (t, heads, dv)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-9, atol=1e-9)
    assert torch.equal(caches[0][0], caches[1][0])  # both wrote the step's tokens to the same slots
    # and the step's tokens are where the slot mapping says
    rows = caches[0][0][0].reshape(-1, rank + dr)
    assert torch.equal(rows[meta.slot_mapping], torch.cat((args[2], args[3]), -1))


def _definition(q_nope, q_pe, pages, meta, w_uk, w_uv, scale):
    """MLA by its definition, one sequence and one query at a time, in float64."""
    rank = w_uk.shape[-1]
    rows = pages.reshape(-1, pages.shape[-1])
    out, t = [], 0
    for i, (n, length) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        slots = torch.tensor([int(meta.block_tables[i, p // meta.page_size]) * meta.page_size + p % meta.page_size for p in range(length)])
        ctx = rows[slots].double()
        c, kpe = ctx[:, :rank], ctx[:, rank:]
        k = torch.einsum("sl,hdl->hsd", c, w_uk.double())
        v = torch.einsum("sl,hvl->hsv", c, w_uv.double())
        for j in range(n):
            pos = length - n + j
            scores = (torch.einsum("hd,hsd->hs", q_nope[t].double(), k) + torch.einsum("hr,sr->hs", q_pe[t].double(), kpe))[:, : pos + 1]
            out.append(torch.einsum("hs,hsv->hv", torch.softmax(scores * scale, -1), v[:, : pos + 1]))
            t += 1
    return torch.stack(out)


class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operations dispatched; a device-to-host read (``.tolist()``, ``.item()``) fails."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default,):
            raise AssertionError(f"a host sync in the MLA reference: {func}")
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _case(num_seqs, layout, g, page_size=5, decode=False):
    heads, dn, dr, dv, rank = 3, 8, 4, 6, 16
    seq_lens = [7 + (3 * i) % 11 for i in range(num_seqs)]
    query_lens = [1 if decode else 1 + (2 * i) % 4 for i in range(num_seqs)]
    num_pages = sum(-(-s // page_size) for s in seq_lens) + 2
    meta = _meta(query_lens, seq_lens, page_size, num_pages, g)
    cache = torch.randn(layout.shape(num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=rank + dr), generator=g, dtype=torch.float64)
    t = sum(query_lens)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    args = (r(t, heads, dn), r(t, heads, dr), r(t, rank), r(t, dr))
    w = dict(w_uk=r(heads, dn, rank), w_uv=r(heads, dv, rank), scale=0.3)
    return meta, (cache, None), args, w


@pytest.mark.parametrize("layout", [HEADS_FIRST, PAGES_FIRST], ids=["heads_first", "pages_first"])
@pytest.mark.parametrize("form", [mla_prefill, mla_decode], ids=["expanded", "absorbed"])
def test_batched_mla_matches_the_definition_without_a_host_sync(layout, form):
    """A mixed batch (chunks after cached prefixes beside decodes) over either
    layout's pages: the definition's output, the step's tokens written, and
    no device-to-host read (the old reference read query_start_loc with
    .tolist() each layer and looped over the sequences)."""
    g = torch.Generator().manual_seed(11)
    meta, cache, args, w = _case(6, layout, g)
    pages = latent_pages(layout, cache)
    with torch.no_grad(), _NoHostSync():
        got = form(*args, pages, meta, **w)
    want = _definition(args[0], args[1], pages, meta, **w)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-9, atol=1e-9)
    rows = pages.reshape(-1, pages.shape[-1])
    assert torch.equal(rows[meta.slot_mapping], torch.cat((args[2], args[3]), -1))


@pytest.mark.parametrize("form", [mla_prefill, mla_decode], ids=["expanded", "absorbed"])
def test_the_work_does_not_grow_with_the_number_of_sequences(form):
    """One batched computation: 24 sequences dispatch about as many
    operations as 2 (einsum picks a view or a copy by shape: a few either
    way); a loop over the sequences would dispatch ~12x more."""
    counts = []
    for num_seqs in (2, 24):
        meta, cache, args, w = _case(num_seqs, HEADS_FIRST, torch.Generator().manual_seed(num_seqs), decode=form is mla_decode)
        pages = latent_pages(HEADS_FIRST, cache)
        with torch.no_grad(), _NoHostSync() as mode:
            form(*args, pages, meta, **w)
        counts.append(mode.ops)
    assert abs(counts[1] - counts[0]) <= 8, counts


def test_a_latent_cache_of_more_than_one_head_is_refused():
    attention = torch_attention()
    cache = attention.allocate(num_pages=2, page_size=4, num_kv_heads=2, head_dim=8, v_head_dim=0, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="one head per token"):
        latent_pages(attention.layout, cache)
    assert SelectionContext().page_size is None  # (the context a backend judges a page size with)
