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
and the model takes those when present. The reference reads the KV layout
of the torch, cpukernels and triton backends ([Hkv, pages, page_size, D],
here one head of D = kv_lora_rank + qk_rope_head_dim, no separate V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from plinth.api import AttentionMetadata, KVCacheSpec


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


def _pages(kv_cache: Any) -> torch.Tensor:
    """The layer's latent pages as [pages, page_size, width]."""
    k = kv_cache[0]
    if k.dim() != 4 or k.shape[0] != 1:
        raise ValueError(
            f"the reference MLA ops read a [1, pages, page_size, width] latent cache; this backend allocated {tuple(k.shape)}"
        )
    return k[0]


def write_latent(kv_cache: Any, latent: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store this step's tokens: latent [T, L] and k_pe [T, R] at their slots."""
    pages = _pages(kv_cache)
    num_pages, page_size, width = pages.shape
    rows = torch.cat((latent, k_pe), dim=-1).to(pages.dtype)
    pages.view(num_pages * page_size, width).index_copy_(0, meta.slot_mapping, rows)


def _context(pages: torch.Tensor, meta: AttentionMetadata, i: int) -> torch.Tensor:
    """Sequence i's cached rows, [seq_len, width], in position order."""
    seq_len = meta.seq_lens_cpu[i]
    n = -(-seq_len // meta.page_size)
    return pages.index_select(0, meta.block_tables[i, :n].long()).reshape(-1, pages.shape[-1])[:seq_len]


def _causal_softmax(scores: torch.Tensor, seq_len: int) -> torch.Tensor:
    """scores [H, n, S] of the sequence's last n queries: softmax over the
    keys each may see (a query at position p sees keys 0..p), in float32."""
    n = scores.shape[1]
    q_pos = torch.arange(seq_len - n, seq_len, device=scores.device)
    hidden = torch.arange(seq_len, device=scores.device)[None, :] > q_pos[:, None]
    return torch.softmax(scores.float().masked_fill(hidden, float("-inf")), dim=-1)


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: Any,
                meta: AttentionMetadata, *, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Expanded form. q_nope [T, H, dn], q_pe [T, H, R], latent [T, L], k_pe
    [T, R] (rotated); w_uk [H, dn, L], w_uv [H, dv, L]. Writes the step's
    tokens into the cache, returns [T, H, dv]."""
    write_latent(kv_cache, latent, k_pe, meta)
    pages = _pages(kv_cache)
    rank = w_uk.shape[-1]
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        ctx = _context(pages, meta, i).to(q_nope.dtype)
        c, kpe = ctx[:, :rank], ctx[:, rank:]
        k_nope = torch.einsum("sl,hdl->hsd", c, w_uk)  # [H, S, dn]
        v = torch.einsum("sl,hvl->hsv", c, w_uv)  # [H, S, dv]
        scores = torch.einsum("nhd,hsd->hns", q_nope[a:b], k_nope) + torch.einsum("nhr,sr->hns", q_pe[a:b], kpe)
        p = _causal_softmax(scores * scale, seq_len).to(v.dtype)
        out[a:b] = torch.einsum("hns,hsv->nhv", p, v)
    return out


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: Any,
               meta: AttentionMetadata, *, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed form, same arguments and result as ``mla_prefill``: the
    queries are projected into the latent space and attend over the cached
    latents directly (correct for any query length; meant for decode)."""
    write_latent(kv_cache, latent, k_pe, meta)
    pages = _pages(kv_cache)
    rank = w_uk.shape[-1]
    q_lat = torch.einsum("thd,hdl->thl", q_nope, w_uk)  # [T, H, L]
    o_lat = q_lat.new_empty(q_lat.shape)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        ctx = _context(pages, meta, i).to(q_lat.dtype)
        c, kpe = ctx[:, :rank], ctx[:, rank:]
        scores = torch.einsum("nhl,sl->hns", q_lat[a:b], c) + torch.einsum("nhr,sr->hns", q_pe[a:b], kpe)
        p = _causal_softmax(scores * scale, seq_len).to(c.dtype)
        o_lat[a:b] = torch.einsum("hns,sl->nhl", p, c)
    return torch.einsum("thl,hvl->thv", o_lat, w_uv)
