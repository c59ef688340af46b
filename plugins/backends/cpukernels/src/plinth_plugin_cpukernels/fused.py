"""The ``qkv_attention`` op: a decode step's whole attention block in one C++
call. From the fused q/k/v projection it rotates q and k, writes k and v into
the pages and attends, where the separate ops take a split, two rotary
kernels, two page writes, a layout copy and the attention kernel (each a
trip through the dispatcher and an OpenMP fork, ~30 times a step). Batches
with prefill chunks, and inputs the kernel does not cover, run this backend's
own ``rotary`` and ``attention``, so both paths give the same numbers. Short
multi-token queries (speculative scoring) take the kernel too, one row per
token, with the per-token tables ``prepare_attention`` made for them."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from plinth_plugin_cpukernels.attention import PER_TOKEN_STATE


def make_fused_ops(kernels: Any, table: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    import torch

    kernel = kernels.decode_qkv_attention
    rotary, attention = table["rotary"], table["attention"]
    dtypes = (torch.bfloat16, torch.float32)

    def qkv_attention(qkv, positions, cos_sin, is_neox, kv_cache, meta, *, num_heads, num_kv_heads, head_dim, scale, sliding_window=None):
        k_pages, v_pages = kv_cache
        per_token = meta.backend_state.get(PER_TOKEN_STATE)
        if (
            (meta.max_query_len == 1 or per_token is not None)
            and qkv.dtype in dtypes
            and qkv.stride(-1) == 1
            and v_pages is not None
            and k_pages.dtype == qkv.dtype
            and v_pages.dtype == qkv.dtype
            and v_pages.shape[-1] == head_dim
            and cos_sin.dtype == torch.float32
            and cos_sin.is_contiguous()
        ):
            tables, lens = per_token if per_token is not None else (meta.block_tables, meta.seq_lens)
            return kernel(
                qkv, positions, cos_sin, bool(is_neox), k_pages, v_pages, meta.slot_mapping, tables, lens,
                int(num_heads), float(scale), int(sliding_window or 0),
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
