"""Multi-head latent attention over a paged latent KV cache.

Each token caches what DeepSeek's ``kv_a_proj_with_mqa`` makes of it, once
for all heads: the normalized latent ``c`` [kv_lora_rank] and the rotated
rope key ``k_pe`` [qk_rope_head_dim], side by side in one page row. Per head
keys and values come from ``kv_b_proj`` (W_UK [H, dn, L], W_UV [H, dv, L]):

- prefill, expanded: k = [c W_UK^T, k_pe], v = c W_UV^T for every cached
  token, then ordinary causal attention (DeepSeek's ``attn_impl="naive"``,
  vLLM's MLA prefill);
- decode, absorbed: the query moves into the latent space, q_lat = q_nope
  W_UK, scores = q_lat c^T + q_pe k_pe^T, and the output leaves it,
  o = (p c) W_UV^T, so no per-head K/V is ever built (DeepSeek's
  ``attn_impl="absorb"``, vLLM's MLA decode).

These are the reference ops (``mla_prefill``, ``mla_decode``); a backend
may bring its own under the same names in its op table (the table is open),
and the model takes those when present. They read the pages as the attention
backend lays them out (its ``layout``: ``latent_pages`` views them as [pages,
page_size, width], one head of width = kv_lora_rank + qk_rope_head_dim, no
separate V), and attend every sequence of the step at once: the sequences'
contexts gathered into one padded batch [B, S, width] and their queries
into [B, Q, H, .] (Q the longest query), a causal mask from the positions;
no loop over sequences and no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from plinth.api import AttentionMetadata, KVCacheLayout, KVCacheSpec


@dataclass(frozen=True)
class MLALatentSpec(KVCacheSpec):
    """One latent of ``kv_lora_rank`` plus a rope key of ``rope_dim`` per
    token (not per head): a page of ``page_size`` tokens holds
    page_size * (kv_lora_rank + rope_dim) values."""

    kv_lora_rank: int
    rope_dim: int

    def __post_init__(self) -> None:
        if self.kv_lora_rank < 1 or self.rope_dim < 0:
            raise ValueError(f"a latent cache needs kv_lora_rank >= 1 and rope_dim >= 0: {self}")

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def page_bytes(self, page_size: int, dtype: torch.dtype) -> int:
        return page_size * self.width * dtype.itemsize

    def allocation(self) -> dict[str, int]:
        return {"num_kv_heads": 1, "head_dim": self.width, "v_head_dim": 0}


def latent_pages(layout: KVCacheLayout, kv_cache: Any) -> torch.Tensor:
    """A layer's latent pages as a [pages, page_size, width] view, whatever
    the attention backend's layout (its one head selected)."""
    k = layout.token_major(kv_cache[0])
    if k.dim() != 4 or k.shape[2] != 1:
        raise ValueError(f"a latent cache has one head per token; the attention backend allocated {tuple(kv_cache[0].shape)} in {layout.dims}")
    return k[:, :, 0]


def write_latent(pages: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store this step's tokens: latent [T, L] and k_pe [T, R] at their slots."""
    page_size = pages.shape[1]
    slots = meta.slot_mapping.long()
    pages[slots // page_size, slots % page_size] = torch.cat((latent, k_pe), dim=-1).to(pages.dtype)


@dataclass
class _Batch:
    """The step's sequences as one padded batch (all device tensors)."""

    seq: torch.Tensor  # [T] each token's sequence
    row: torch.Tensor  # [T] its row among that sequence's queries
    context: torch.Tensor  # [B, S, width] each sequence's cached rows in position order (padded)
    hidden: torch.Tensor  # [B, 1, Q, S] True where a query may not see a key (causal, padding)
    num_queries: int  # Q


def _batch(pages: torch.Tensor, meta: AttentionMetadata, num_tokens: int, dtype: torch.dtype) -> _Batch:
    device = pages.device
    page_size, num_seqs = pages.shape[1], meta.num_seqs
    span = max(meta.max_seq_len, 1)
    num_pages = -(-span // page_size)
    tables = meta.block_tables[:, :num_pages].long()
    if tables.shape[1] < num_pages:  # a table narrower than the longest context: pad (masked below)
        tables = torch.nn.functional.pad(tables, (0, num_pages - tables.shape[1]))
    context = pages.index_select(0, tables.reshape(-1)).view(num_seqs, num_pages * page_size, -1)[:, :span].to(dtype)
    starts = meta.query_start_loc.to(device=device, dtype=torch.long)
    token = torch.arange(num_tokens, device=device)
    seq = torch.searchsorted(starts[1:], token, right=True)
    row = token - starts[seq]
    queries = max(meta.max_query_len, 1)
    # a padded query row sees key 0 only (its output is dropped): no row is all -inf
    position = torch.zeros(num_seqs, queries, dtype=torch.long, device=device)
    position[seq, row] = meta.positions.to(device=device, dtype=torch.long)
    keys = torch.arange(span, device=device)
    hidden = (keys[None, None, :] > position[:, :, None]).unsqueeze(1)
    return _Batch(seq=seq, row=row, context=context, hidden=hidden, num_queries=queries)


def _padded(x: torch.Tensor, b: _Batch) -> torch.Tensor:
    """[T, ...] tokens into [B, Q, ...] query rows (zeros where a sequence has fewer)."""
    out = x.new_zeros(b.context.shape[0], b.num_queries, *x.shape[1:])
    out[b.seq, b.row] = x
    return out


def _softmax(scores: torch.Tensor, b: _Batch) -> torch.Tensor:
    """scores [B, H, Q, S]: softmax over the keys each query may see, in float32 at least."""
    wide = scores.to(torch.promote_types(scores.dtype, torch.float32))
    return torch.softmax(wide.masked_fill(b.hidden, float("-inf")), dim=-1)


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, pages: torch.Tensor,
                meta: AttentionMetadata, *, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Expanded form. q_nope [T, H, dn], q_pe [T, H, R], latent [T, L], k_pe
    [T, R] (rotated); pages [pages, page_size, L + R] (``latent_pages``);
    w_uk [H, dn, L], w_uv [H, dv, L]. Writes the step's tokens into the
    pages, returns [T, H, dv]."""
    write_latent(pages, latent, k_pe, meta)
    rank = w_uk.shape[-1]
    b = _batch(pages, meta, q_nope.shape[0], q_nope.dtype)
    c, kpe = b.context[..., :rank], b.context[..., rank:]
    k_nope = torch.einsum("bsl,hdl->bhsd", c, w_uk)  # [B, H, S, dn]
    v = torch.einsum("bsl,hvl->bhsv", c, w_uv)  # [B, H, S, dv]
    scores = torch.einsum("bqhd,bhsd->bhqs", _padded(q_nope, b), k_nope) + torch.einsum("bqhr,bsr->bhqs", _padded(q_pe, b), kpe)
    p = _softmax(scores * scale, b).to(v.dtype)
    return torch.einsum("bhqs,bhsv->bqhv", p, v)[b.seq, b.row]


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, pages: torch.Tensor,
               meta: AttentionMetadata, *, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed form, same arguments and result as ``mla_prefill``: the
    queries are projected into the latent space and attend over the cached
    latents directly (correct for any query length; meant for decode)."""
    write_latent(pages, latent, k_pe, meta)
    rank = w_uk.shape[-1]
    q_lat = torch.einsum("thd,hdl->thl", q_nope, w_uk)  # [T, H, L]
    b = _batch(pages, meta, q_lat.shape[0], q_lat.dtype)
    c, kpe = b.context[..., :rank], b.context[..., rank:]
    scores = torch.einsum("bqhl,bsl->bhqs", _padded(q_lat, b), c) + torch.einsum("bqhr,bsr->bhqs", _padded(q_pe, b), kpe)
    p = _softmax(scores * scale, b).to(c.dtype)
    o_lat = torch.einsum("bhqs,bsl->bqhl", p, c)[b.seq, b.row]  # [T, H, L]
    return torch.einsum("thl,hvl->thv", o_lat, w_uv)
