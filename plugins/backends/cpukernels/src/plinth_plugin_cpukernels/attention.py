"""Paged-decode attention as a C++ kernel, built at first use.

Decoding is memory-bound on reading the context's K and V. Plain torch ops
must gather each sequence's pages into a padded batch and then read it again
in the matmuls; the kernel reads every K and V row once, straight from the
pages, with no padding (about 4x faster per layer in bfloat16 at 32 sequences
of 100-768 tokens here). Short multi-token queries (a decode scoring
speculative proposals: 1 + k tokens) go through the same kernel, one row per
query token over its own causal prefix of the pages, so a speculative step
costs the kernel's per-token price, not the reference's. Batches that
include longer prefill chunks, and the soft-capped path, go to the reference
backend's attention, whose KV layout (``[Hkv, num_pages, page_size, D]``)
this kernel shares: ``allocate`` checks that it still is.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from plinth.api import PluginError

#: longest query the kernel takes as one row per token; longer ones are
#: prefill chunks, which the reference's matmuls do better
MAX_KERNEL_QUERY_LEN = 16
#: per-token block tables and lengths, when a step has short multi-token queries
PER_TOKEN_STATE = "cpukernels.per_token"


def make_attention_ops(kernels: Any, reference: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    import torch

    kernel = kernels.paged_decode_attention
    ref_attention = reference["attention"]
    ref_allocate = reference["allocate_kv_cache"]
    ref_prepare = reference["prepare_attention"]

    def prepare_attention(meta):
        ref_prepare(meta)
        if 1 < meta.max_query_len <= MAX_KERNEL_QUERY_LEN:
            # token i of sequence s attends to its sequence's pages up to its
            # own position: a decode row with s's block table and length pos + 1
            lens = torch.tensor(meta.query_lens_cpu, dtype=torch.long, device=meta.block_tables.device)
            seq_of_token = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
            meta.backend_state[PER_TOKEN_STATE] = (
                meta.block_tables.index_select(0, seq_of_token).contiguous(),
                (meta.positions + 1).to(torch.int32),
            )

    def allocate_kv_cache(num_pages, page_size, num_kv_heads, head_dim, v_head_dim, dtype, device):
        k, v = ref_allocate(
            num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
            v_head_dim=v_head_dim, dtype=dtype, device=device,
        )
        if tuple(k.shape) != (num_kv_heads, num_pages, page_size, head_dim):
            raise PluginError(
                f"cpukernels reads the reference KV layout [Hkv, pages, page_size, D]; "
                f"the reference backend now allocates {tuple(k.shape)}"
            )
        return k, v

    def attention(q, k, v, kv_cache, meta, *, scale, sliding_window=None, logit_cap=None):
        per_token = meta.backend_state.get(PER_TOKEN_STATE)
        if (meta.max_query_len != 1 and per_token is None) or logit_cap is not None or q.dtype not in (torch.bfloat16, torch.float32):
            return ref_attention(q, k, v, kv_cache, meta, scale=scale, sliding_window=sliding_window, logit_cap=logit_cap)
        k_pages, v_pages = kv_cache
        heads, num_pages, page_size, dim = k_pages.shape
        slots = meta.slot_mapping
        k_pages.view(heads, num_pages * page_size, dim).index_copy_(1, slots, k.transpose(0, 1).to(k_pages.dtype))
        if v_pages is None:  # V shares K's pages
            v_pages = k_pages
        else:
            v_pages.view(heads, num_pages * page_size, v_pages.shape[-1]).index_copy_(
                1, slots, v.transpose(0, 1).to(v_pages.dtype)
            )
        tables, lens = per_token if per_token is not None else (meta.block_tables, meta.seq_lens)
        return kernel(q.contiguous(), k_pages, v_pages, tables, lens, float(scale), int(sliding_window or 0))

    return {
        "allocate_kv_cache": allocate_kv_cache,
        "prepare_attention": prepare_attention,
        "attention": attention,
        "copy_pages": reference["copy_pages"],
    }
