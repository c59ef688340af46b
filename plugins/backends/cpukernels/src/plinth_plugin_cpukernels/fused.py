"""The ``qkv_attention`` op: a step's whole attention block in one C++
call. From the fused q/k/v projection it rotates q and k, writes k and v into
the pages and attends, where the separate ops take a split, two rotary
kernels, two page writes, a layout copy and the attention kernel (each a
trip through the dispatcher and an OpenMP fork, ~30 times a step). Inputs
the kernel does not cover run this backend's own ``rotary`` and
``attention``, so both paths give the same numbers: a model's K/V and
outputs always come from the same instructions, whatever the step holds."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from plinth_plugin_cpukernels.attention import kernel_takes


def make_fused_ops(kernels: Any, table: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    import torch

    kernel = kernels.paged_qkv_attention
    rotary, attention = table["rotary"], table["attention"]

    def qkv_attention(qkv, positions, cos_sin, is_neox, kv_cache, meta, *, num_heads, num_kv_heads, head_dim, scale, sliding_window=None):
        k_pages, v_pages = kv_cache
        if (
            kernel_takes(qkv.dtype, head_dim, head_dim, k_pages.dtype)
            and qkv.stride(-1) == 1
            and v_pages is not None
            and v_pages.dtype == qkv.dtype
            and v_pages.shape[-1] == head_dim
            and cos_sin.dtype == torch.float32
            and cos_sin.is_contiguous()
        ):
            return kernel(
                qkv, positions, cos_sin, bool(is_neox), k_pages, v_pages, meta.slot_mapping, meta.block_tables,
                meta.query_start_loc, meta.seq_lens, int(num_heads), float(scale), int(sliding_window or 0),
            )
        num_tokens = qkv.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q, k = rotary(
            q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim), positions, cos_sin, is_neox
        )
        out = attention(q, k, v.view(num_tokens, num_kv_heads, head_dim), kv_cache, meta, scale=scale, sliding_window=sliding_window)
        return out.reshape(num_tokens, -1)

    return {"qkv_attention": qkv_attention}
