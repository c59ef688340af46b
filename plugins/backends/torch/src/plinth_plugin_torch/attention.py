"""Paged attention in plain PyTorch: the reference attention backend
(``TorchAttention``; ``TorchDeterministicAttention`` under ``--deterministic``).

``build_plan`` runs once per step and turns the batch metadata into a
plan (``TorchPlan``, in ``meta.plan``) that every layer reuses:

* decode sequences (one query token each) are attended together with two
  batched matmuls over their gathered pages, padded to the longest, with a
  padding mask; grouped-query heads ride along as extra query rows of their
  KV head, so K/V are never repeated;
* every other sequence (a prefill chunk, possibly with a cached prefix) gets
  its own SDPA call: plain ``is_causal`` when the chunk starts at position 0,
  else an offset-causal mask over prefix + chunk.

Masks for a sliding window (and the logit soft cap path) are built on first
use in a step and cached in the plan, so layers never rebuild them.

KV layout: each layer's pages are one tensor ``[Hkv, num_pages, page_size,
D]``, heads outermost. Gathering a batch's pages along dim 1 then gives
``[Hkv, B, L, D]``, the layout the batched matmuls read, with no further copy
(token-major pages cost one more full copy of K and V per layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from plinth.api import HEADS_FIRST, AttentionBackend, AttentionMetadata, AttentionPlan


@dataclass
class DecodePlan:
    """Sequences with one query token, attended in one batched call."""

    num_seqs: int
    num_pages: int  # pages gathered per sequence (the longest one's)
    page_index: torch.Tensor  # [num_seqs * num_pages] int64, pages to gather
    seq_lens: torch.Tensor  # [num_seqs]
    token_index: torch.Tensor | None  # their rows in the flat batch; None: all rows, in order
    key_positions: torch.Tensor  # [num_pages * page_size]
    length: int | None  # the one sequence's length (host), when there is one
    masks: dict[Any, torch.Tensor | None] = field(default_factory=dict)  # (window, dtype) -> [B, 1, 1, L]


@dataclass
class PrefillPlan:
    """One sequence with a chunk of query tokens (maybe after a cached prefix)."""

    start: int  # its rows in the flat batch: start:end
    end: int
    seq_len: int  # context length including the chunk
    pages: torch.Tensor | None  # int64 pages holding its context; None when there is no prefix
    masks: dict[Any, torch.Tensor | None] = field(default_factory=dict)  # (window, dtype) -> [q, s] or None (causal)

    @property
    def query_len(self) -> int:
        return self.end - self.start

    @property
    def prefix_len(self) -> int:
        return self.seq_len - self.query_len


@dataclass
class TorchPlan(AttentionPlan):
    num_tokens: int
    slots: torch.Tensor  # slot_mapping as int64
    decode: DecodePlan | None
    prefills: list[PrefillPlan]


def build_plan(meta: AttentionMetadata) -> TorchPlan:
    """This step's plan, from the host-side lengths (no device sync)."""
    query_lens = list(meta.query_lens_cpu)
    seq_lens = list(meta.seq_lens_cpu)
    page_size = meta.page_size
    device = meta.block_tables.device
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)

    decode_ids = [i for i, n in enumerate(query_lens) if n == 1]
    decode = None
    if decode_ids:
        num_pages = -(-max(seq_lens[i] for i in decode_ids) // page_size)
        if len(decode_ids) == len(query_lens):
            tables, lens, token_index = meta.block_tables, meta.seq_lens, None
        else:
            sel = torch.tensor(decode_ids, dtype=torch.long, device=device)
            tables = meta.block_tables.index_select(0, sel)
            lens = meta.seq_lens.index_select(0, sel.to(meta.seq_lens.device))
            token_index = torch.tensor([starts[i] for i in decode_ids], dtype=torch.long, device=device)
        decode = DecodePlan(
            num_seqs=len(decode_ids),
            num_pages=num_pages,
            page_index=tables[:, :num_pages].reshape(-1).long(),
            seq_lens=lens.to(device=device, dtype=torch.long),
            token_index=token_index,
            key_positions=torch.arange(num_pages * page_size, device=device),
            length=seq_lens[decode_ids[0]] if len(decode_ids) == 1 else None,
        )

    prefills = []
    for i, n in enumerate(query_lens):
        if n == 1 or n == 0:
            continue
        pages = None
        if seq_lens[i] > n:  # a cached prefix: read the context back from the pages
            pages = meta.block_tables[i, : -(-seq_lens[i] // page_size)].long()
        prefills.append(PrefillPlan(start=starts[i], end=starts[i] + n, seq_len=seq_lens[i], pages=pages))

    return TorchPlan(num_tokens=starts[-1], slots=meta.slot_mapping.long(), decode=decode, prefills=prefills)


def _additive(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attended, -inf elsewhere: SDPA adds a float mask as it is,
    while a boolean one is converted on every call."""
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))


def _decode_mask(plan: DecodePlan, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
    """[1, B, 1, L] additive mask, or None when nothing needs masking (one
    sequence, no window: its keys are sliced to its length instead)."""
    key = (window, dtype)
    if key not in plan.masks:
        if window is None and plan.length is not None:
            plan.masks[key] = None
        else:
            pos = plan.key_positions.unsqueeze(0)
            lens = plan.seq_lens.unsqueeze(1)
            valid = pos < lens
            if window is not None:
                valid &= pos >= lens - window
            plan.masks[key] = _additive(valid, dtype)[None, :, None, :]  # over [Hkv, B, G, L]
    return plan.masks[key]


def _prefill_mask(plan: PrefillPlan, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """[q, s] additive mask, or None for plain causal attention from position 0."""
    key = (window, dtype)
    if key not in plan.masks:
        if plan.prefix_len == 0 and window is None:
            plan.masks[key] = None
        else:
            q_pos = torch.arange(plan.prefix_len, plan.seq_len, device=device).unsqueeze(1)
            k_pos = torch.arange(plan.seq_len, device=device).unsqueeze(0)
            valid = k_pos <= q_pos
            if window is not None:
                valid &= k_pos > q_pos - window
            plan.masks[key] = _additive(valid, dtype)
    return plan.masks[key]


def token_major(pages: torch.Tensor) -> torch.Tensor:
    """A writable [num_pages, page_size, Hkv, D] view of a layer's pages."""
    return HEADS_FIRST.token_major(pages)


def _write_pages(pages: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    heads, num_pages, page_size, dim = pages.shape
    pages.view(heads, num_pages * page_size, dim).index_copy_(1, slots, x.transpose(0, 1).to(pages.dtype))


def _gather(pages: torch.Tensor, page_index: torch.Tensor) -> torch.Tensor:
    """[Hkv, len(page_index) * page_size, D]: those pages, in order."""
    heads, _, page_size, dim = pages.shape
    return pages.index_select(1, page_index).view(heads, -1, dim)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: Any,
    plan: TorchPlan,
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
) -> torch.Tensor:
    """Write k, v [T, Hkv, D] into the pages at the plan's slots, then attend
    q [T, Hq, D] causally over each sequence's pages. -> [T, Hq, Dv]."""
    k_pages, v_pages = kv_cache
    slots = plan.slots
    _write_pages(k_pages, k, slots)
    if v_pages is None:  # V shares K's cache (MLA-style): V is read from the K pages
        v_pages = k_pages
    else:
        _write_pages(v_pages, v, slots)

    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k_pages.shape[0]
    group = num_heads // num_kv_heads
    head_dim_v = v_pages.shape[-1]
    window = sliding_window if sliding_window and sliding_window > 0 else None

    decode = plan.decode
    if decode is not None and not plan.prefills and decode.token_index is None:
        return _decode(q, k_pages, v_pages, decode, window, scale, logit_cap, group)

    out = q.new_empty(num_tokens, num_heads, head_dim_v)
    if decode is not None:
        qd = q.index_select(0, decode.token_index) if decode.token_index is not None else q
        od = _decode(qd, k_pages, v_pages, decode, window, scale, logit_cap, group)
        if decode.token_index is None:
            out.copy_(od)
        else:
            out.index_copy_(0, decode.token_index, od)
    for p in plan.prefills:
        qi = q[p.start : p.end].transpose(0, 1)  # [Hq, q, D]
        if p.pages is None:
            ki, vi = k[p.start : p.end].transpose(0, 1), v[p.start : p.end].transpose(0, 1)  # [Hkv, s, D]
        else:
            ki = _gather(k_pages, p.pages)[:, : p.seq_len].to(q.dtype)
            vi = _gather(v_pages, p.pages)[:, : p.seq_len].to(q.dtype)
        if logit_cap is None:
            # SDPA's fused (flash) kernel: on CPU only with a batch dimension
            # (3-D inputs take a path 2.5x slower at 512 tokens), with KV
            # heads shared by the group (enable_gqa) instead of repeated;
            # causal from position 0, else the offset-causal / window mask
            mask = _prefill_mask(p, window, q.dtype, q.device)
            oi = F.scaled_dot_product_attention(
                qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), attn_mask=mask, is_causal=mask is None, scale=scale,
                enable_gqa=group > 1,
            ).squeeze(0)
        else:  # soft-capped logits (no SDPA form): two matmuls
            mask = _prefill_mask(p, window, torch.float32, q.device)
            qg = qi.reshape(num_kv_heads, group * p.query_len, qi.shape[-1])
            ki, vi = ki.contiguous(), vi.contiguous()
            scores = torch.matmul(qg, ki.transpose(-1, -2)).float() * scale
            scores = scores.view(num_kv_heads, group, p.query_len, -1)
            if logit_cap is not None:
                scores = logit_cap * torch.tanh(scores / logit_cap)
            if mask is not None:
                scores = scores + mask
            elif logit_cap is not None:  # causal from 0 on the capped path
                lq, lk = scores.shape[-2], scores.shape[-1]
                scores = scores.masked_fill(~torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq), float("-inf"))
            probs = scores.softmax(-1).to(vi.dtype).view(num_kv_heads, group * p.query_len, -1)
            oi = torch.matmul(probs, vi).view(num_heads, p.query_len, -1)
        out[p.start : p.end] = oi.transpose(0, 1)
    return out


def _decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: DecodePlan,
    window: int | None,
    scale: float,
    logit_cap: float | None,
    group: int,
) -> torch.Tensor:
    """B single-token queries over their gathered pages, padded to the
    longest: two batched matmuls over [Hkv, B] (not SDPA: with a mask and a
    few query rows CPU SDPA takes a path about 20x slower here)."""
    b, num_heads, head_dim = plan.num_seqs, q.shape[1], q.shape[2]
    num_kv_heads = k_pages.shape[0]
    keys = _gather(k_pages, plan.page_index).view(num_kv_heads, b, -1, head_dim)  # [Hkv, B, L, D]
    values = _gather(v_pages, plan.page_index).view(num_kv_heads, b, -1, v_pages.shape[-1])
    if keys.dtype != q.dtype:
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    mask = _decode_mask(plan, window, torch.float32)
    if mask is None:  # one sequence: its keys, not the padded pages
        keys, values = keys[:, :, : plan.length], values[:, :, : plan.length]
    # the `group` query heads sharing a KV head become `group` query rows
    qg = q.view(b, num_kv_heads, group, head_dim).transpose(0, 1)  # [Hkv, B, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [Hkv, B, G, L]
    if logit_cap is not None:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if mask is not None:
        scores = scores + mask
    out = torch.matmul(scores.softmax(-1).to(values.dtype), values)  # [Hkv, B, G, Dv]
    return out.transpose(0, 1).reshape(b, num_heads, values.shape[-1])


# ---- batch-invariant attention (--deterministic) ------------------------------------

#: keys per block of the batch-invariant form: block j holds positions
#: 32j..32j+31 whatever the page size, the chunking or the batch
DETERMINISTIC_KEY_BLOCK = 32
#: query rows per pass (bounds the [rows, Hkv, G, block, D] products; rows are independent)
DETERMINISTIC_ROWS = 64


@dataclass
class RowPlan(AttentionPlan):
    """Each query row's sequence (block table) and position, for the batch-invariant form."""

    slots: torch.Tensor  # [T] int64, slot_mapping
    tables: torch.Tensor  # [T, max_pages] int64: the row's sequence's block table
    positions: torch.Tensor  # [T] int64
    positions_cpu: list[int]


def build_row_plan(meta: AttentionMetadata) -> RowPlan:
    """The batch-invariant form's plan, from the host-side lengths."""
    device = meta.block_tables.device
    positions_cpu: list[int] = []
    for n, length in zip(meta.query_lens_cpu, meta.seq_lens_cpu):
        positions_cpu.extend(range(length - n, length))
    seq_of_row = torch.repeat_interleave(
        torch.arange(len(meta.query_lens_cpu), device=device),
        torch.tensor(meta.query_lens_cpu, dtype=torch.long, device=device),
    )
    return RowPlan(
        slots=meta.slot_mapping.long(),
        tables=meta.block_tables.index_select(0, seq_of_row).long(),
        positions=torch.tensor(positions_cpu, dtype=torch.long, device=device),
        positions_cpu=positions_cpu,
    )


def deterministic_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: Any,
    rows: RowPlan,
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
) -> torch.Tensor:
    """``attention`` with each row's result fixed by its own query, position
    and keys (``--deterministic``): never by the other rows, the chunking, a
    prefix-cache hit or the page size. Every row reads its keys back from the
    pages in blocks of ``DETERMINISTIC_KEY_BLOCK`` at fixed positions, with an
    online softmax rescaled at those block boundaries. Dot products are
    elementwise products summed over the head dimension, and every sum has a
    fixed length (D, or the block), so the reduction order does not depend on
    how many rows share a call (a matmul's may: its kernel is chosen by shape).
    Positions outside a row's range add exact zeros. About 10-50x slower than
    the SDPA path on prefill; decode steps cost about the same order as the
    padded matmuls."""
    k_pages, v_pages = kv_cache
    _write_pages(k_pages, k, rows.slots)
    if v_pages is None:
        v_pages = k_pages
    else:
        _write_pages(v_pages, v, rows.slots)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    head_dim_v = v_pages.shape[-1]
    group = num_heads // num_kv_heads
    window = sliding_window if sliding_window and sliding_window > 0 else None
    k_flat = k_pages.view(num_kv_heads, num_pages * page_size, head_dim)
    v_flat = v_pages.view(num_kv_heads, num_pages * page_size, head_dim_v)
    blk = DETERMINISTIC_KEY_BLOCK
    offsets = torch.arange(blk, device=q.device)
    max_page = rows.tables.shape[1] - 1
    out = q.new_empty(num_tokens, num_heads, head_dim_v)
    for r0 in range(0, num_tokens, DETERMINISTIC_ROWS):
        r1 = min(num_tokens, r0 + DETERMINISTIC_ROWS)
        n = r1 - r0
        hi = rows.positions[r0:r1] + 1
        lo = (hi - window).clamp(min=0) if window is not None else torch.zeros_like(hi)
        host = rows.positions_cpu[r0:r1]
        first = max(0, min(host) + 1 - window) // blk if window is not None else 0
        last = max(host) + 1
        tables = rows.tables[r0:r1]
        qf = q[r0:r1].float().view(n, num_kv_heads, group, 1, head_dim) * scale
        m = torch.full((n, num_kv_heads, group), -1e30, device=q.device)
        den = torch.zeros(n, num_kv_heads, group, device=q.device)
        acc = torch.zeros(n, num_kv_heads, group, head_dim_v, device=q.device)
        for start in range(first * blk, last, blk):
            kpos = start + offsets
            valid = (kpos >= lo[:, None]) & (kpos < hi[:, None])  # [n, blk]
            slots = tables[:, (kpos // page_size).clamp(max=max_page)] * page_size + kpos % page_size
            kb = k_flat[:, slots].permute(1, 0, 2, 3).float()  # [n, Hkv, blk, D]
            scores = (qf * kb.unsqueeze(2)).sum(-1)  # [n, Hkv, G, blk]
            if logit_cap is not None:
                scores = logit_cap * torch.tanh(scores / logit_cap)
            scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
            m_new = torch.maximum(m, scores.amax(-1))
            p = torch.exp(scores - m_new.unsqueeze(-1))
            alpha = torch.exp(m - m_new)
            vb = v_flat[:, slots].permute(1, 0, 2, 3).float()  # [n, Hkv, blk, Dv]
            den = den * alpha + p.sum(-1)
            acc = acc * alpha.unsqueeze(-1) + (p.unsqueeze(-1) * vb.unsqueeze(2)).sum(-2)
            m = m_new
        out[r0:r1] = (acc / den.unsqueeze(-1)).view(n, num_heads, head_dim_v).to(out.dtype)
    return out


# ---- the attention backends ----------------------------------------------------------


class TorchAttention(AttentionBackend[TorchPlan]):
    """The reference attention backend: pages ``[Hkv, num_pages, page_size,
    D]`` (``HEADS_FIRST``), any page size, any floating dtype, sliding
    windows, soft caps, latent caches (V sharing K's pages)."""

    layout = HEADS_FIRST
    dtypes = ("float32", "bfloat16", "float16", "float64")
    plan_type = TorchPlan

    def build_plan(self, meta: AttentionMetadata) -> TorchPlan:
        from plinth_plugin_torch.ops import new_step

        new_step()  # the rotary memo's step (a positions buffer refilled in place)
        return build_plan(meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, meta: AttentionMetadata, *, scale: float, sliding_window: int | None = None, logit_cap: float | None = None) -> torch.Tensor:
        return attention(q, k, v, kv_cache, self.plan(meta), scale=scale, sliding_window=sliding_window, logit_cap=logit_cap)


class TorchDeterministicAttention(AttentionBackend[RowPlan]):
    """``--deterministic``: the batch-invariant form (``deterministic_attention``)
    over the reference's pages."""

    layout = HEADS_FIRST
    dtypes = TorchAttention.dtypes
    plan_type = RowPlan

    def build_plan(self, meta: AttentionMetadata) -> RowPlan:
        from plinth_plugin_torch.ops import new_step

        new_step()
        return build_row_plan(meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, meta: AttentionMetadata, *, scale: float, sliding_window: int | None = None, logit_cap: float | None = None) -> torch.Tensor:
        return deterministic_attention(q, k, v, kv_cache, self.plan(meta), scale=scale, sliding_window=sliding_window, logit_cap=logit_cap)
