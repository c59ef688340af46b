"""Paged attention as a C++ kernel, built at first use.

Decoding is memory-bound on reading the context's K and V. Plain torch ops
must gather each sequence's pages into a padded batch and then read it again
in the matmuls; the kernel reads every K and V row once, straight from the
pages, with no padding (about 4x faster per layer in bfloat16 at 32 sequences
of 100-768 tokens here). It takes any step whose queries are short (decodes,
and a decode scoring speculative proposals: 1 + k tokens, each row over its
own causal prefix), so a speculative step costs the kernel's per-token price.

The kernel is batch-invariant (csrc/cpu_ops.cpp, ``paged_attention_impl``):
each row's result is fixed by its own query, position and keys. It takes
every step, prefill chunks included (tiles of query rows sharing each K/V
block's loads), so a row gives the same bits as a decode, a verification
row, a row of any chunk, after a prefix-cache hit, at any page size, in
both modes (``--deterministic`` needs nothing more here). It also beats the
reference's SDPA on prefill (``bench/deterministic_attention.py``, SmolLM2's
heads, bf16, loaded 2-core AMD EPYC: 0.52x the time at 128 tokens, 0.53x at
512, 0.80x at 2048, 0.74x at 4096; float32 0.21x at 128, 0.98x at 2048),
which long chunks took before. The soft-capped path, dtypes other than
bfloat16/float32 and head sizes that are no multiple of 8 go to the
reference backend's attention (in deterministic mode its own
batch-invariant form), whose KV layout (``[Hkv, num_pages, page_size,
D]``) this kernel shares: ``allocate`` checks that it still is.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from plinth.api import PluginError


def kernel_takes(dtype: Any, head_dim: int, v_head_dim: int, page_dtype: Any) -> bool:
    """The inputs the kernel covers (the rest go to the reference): bfloat16 or
    float32 pages of the query's dtype, head sizes multiples of 8."""
    import torch

    return dtype in (torch.bfloat16, torch.float32) and page_dtype == dtype and head_dim % 8 == 0 and v_head_dim % 8 == 0


def make_attention_ops(kernels: Any, reference: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    kernel = kernels.paged_attention
    ref_attention = reference["attention"]
    ref_allocate = reference["allocate_kv_cache"]
    ref_prepare = reference["prepare_attention"]
    import torch

    def allocate_kv_cache(num_pages, page_size, num_kv_heads, head_dim, v_head_dim, dtype, device):
        # the reference's layout (asked on the meta device: shapes, no memory),
        # zeroed on 2 MB pages: a decode batch's pages scatter over the pool
        k, v = ref_allocate(
            num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
            v_head_dim=v_head_dim, dtype=dtype, device=torch.device("meta"),
        )
        if tuple(k.shape) != (num_kv_heads, num_pages, page_size, head_dim):
            raise PluginError(
                f"cpukernels reads the reference KV layout [Hkv, pages, page_size, D]; "
                f"the reference backend now allocates {tuple(k.shape)}"
            )
        on_pages = kernels.zeros_on_large_pages
        return on_pages(list(k.shape), dtype), (on_pages(list(v.shape), dtype) if v is not None else None)

    def attention(q, k, v, kv_cache, meta, *, scale, sliding_window=None, logit_cap=None):
        k_pages, v_pages = kv_cache
        v_dim = (v_pages if v_pages is not None else k_pages).shape[-1]
        if logit_cap is not None or not kernel_takes(q.dtype, q.shape[-1], v_dim, k_pages.dtype):
            return ref_attention(q, k, v, kv_cache, meta, scale=scale, sliding_window=sliding_window, logit_cap=logit_cap)
        heads, num_pages, page_size, dim = k_pages.shape
        slots = meta.slot_mapping
        k_pages.view(heads, num_pages * page_size, dim).index_copy_(1, slots, k.transpose(0, 1).to(k_pages.dtype))
        if v_pages is None:  # V shares K's pages
            v_pages = k_pages
        else:
            v_pages.view(heads, num_pages * page_size, v_pages.shape[-1]).index_copy_(
                1, slots, v.transpose(0, 1).to(v_pages.dtype)
            )
        return kernel(
            q.contiguous(), k_pages, v_pages, meta.block_tables, meta.query_start_loc, meta.seq_lens, float(scale),
            int(sliding_window or 0),
        )

    return {
        "allocate_kv_cache": allocate_kv_cache,
        "prepare_attention": ref_prepare,
        "attention": attention,
        "copy_pages": reference["copy_pages"],
    }
