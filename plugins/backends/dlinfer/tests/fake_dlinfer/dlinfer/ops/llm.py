"""The public ops, as upstream dlinfer/ops/llm.py defines them: the same
names, argument names and order, and defaults. Upstream writes the defaults in
``@register_custom_op(..., default_value={...})``, which (eager mode) sets them
on the function (dlinfer/graph/custom_op.py:60 and :111-145); here they are
written in the signatures. Each op forwards to the vendor's implementation
with the arguments upstream forwards (some are dropped on the way, as there).
"""
from typing import Sequence

import torch
from torch import Tensor

from dlinfer.utils.type_annotation import MoeMetadata
from dlinfer.vendor import vendor_ops_registry

__all__ = [
    "add_rms_norm",
    "apply_rotary_pos_emb",
    "prefill_attention",
    "incre_flash_attention",
    "fill_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "silu_and_mul",
    "moe_gating_topk_softmax",
    "fused_attention",
    "fill_contiguous_kvcache",
    "get_cache_len",
    "weight_quant_matmul",
    "fused_moe",
    "linear",
    "dynamic_quant",
    "linear_w8a8",
    "rms_norm_w8a8",
    "add_rms_norm_w8a8",
    "transdata",
]


# llm.py:41-62
def add_rms_norm(hidden_states: Tensor, residual: Tensor, weight: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    return vendor_ops_registry["add_rms_norm"](hidden_states, residual, weight, epsilon)


# llm.py:65-94
def apply_rotary_pos_emb(query: Tensor, key: Tensor, cos: Tensor | None, sin: Tensor | None) -> tuple[Tensor, Tensor]:
    return vendor_ops_registry["apply_rotary_pos_emb"](query, key, cos, sin)


# llm.py:97-160 (default_value at :100-104; key_cache, value_cache, kv_seq_len are not forwarded)
def prefill_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    q_start_loc: Tensor,
    q_seq_len: Tensor,
    kv_seq_len: Tensor,
    max_q_seq_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    attn_mask: Sequence[Tensor | None],
    softmax_scale: float | None = None,
    alibi_slopes: Sequence[float] | None = None,
    attn_output: Tensor | None = None,
) -> Tensor:
    return vendor_ops_registry["prefill_attention"](
        query, key, value, q_start_loc, q_seq_len, max_q_seq_len, num_q_heads, num_kv_heads,
        attn_mask, softmax_scale, alibi_slopes, attn_output,
    )


# llm.py:163-199
def incre_flash_attention(query: Tensor, key: Tensor, value: Tensor, num_heads: int, input_layout: str, softmax_scale: float | None = None) -> Tensor:
    return vendor_ops_registry["incre_flash_attention"](query, key, value, num_heads, input_layout, softmax_scale)


# llm.py:202-248 (default_value at :205-209)
def fill_kv_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    kv_indices: Tensor,
    k_scales_zeros: Sequence[Tensor | None] = tuple(),
    v_scales_zeros: Sequence[Tensor | None] = tuple(),
    quant_bits: int = 0,
) -> tuple[Tensor, Tensor]:
    return vendor_ops_registry["fill_kv_cache"](key, value, key_cache, value_cache, kv_indices, k_scales_zeros, v_scales_zeros, quant_bits)


# llm.py:251-327 (default_value at :254-262; head_size_v is not forwarded)
def paged_decode_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    block_size: int,
    q_seq_len: Tensor,
    kv_seq_len: Tensor,
    max_kv_seq_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size_v: int | None = 0,
    softmax_scale: float | None = None,
    alibi_slopes: Sequence[float] | None = None,
    attn_output: Tensor | None = None,
    kv_scales: Tensor | None = None,
    kv_zeros: Tensor | None = None,
    quant_bits: int | None = 0,
) -> Tensor:
    return vendor_ops_registry["paged_decode_attention"](
        query, key_cache, value_cache, block_table, block_size, q_seq_len, kv_seq_len, max_kv_seq_len,
        num_q_heads, num_kv_heads, softmax_scale, alibi_slopes, attn_output, kv_scales, kv_zeros, quant_bits,
    )


# llm.py:330-422 (default_value at :333-341; head_size_v is not forwarded)
def paged_prefill_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    block_size: int,
    q_start_loc: Tensor,
    q_seq_len: Tensor,
    kv_seq_len: Tensor,
    cu_seq_lens_kv: Tensor,
    max_q_seq_len: int,
    max_kv_seq_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    attn_mask: Sequence[Tensor | None],
    head_size_v: int | None = 0,
    softmax_scale: float | None = None,
    alibi_slopes: Sequence[float] | None = None,
    attn_output: Tensor | None = None,
    kv_scales: Tensor = None,
    kv_zeros: Tensor = None,
    quant_bits: int = 0,
) -> Tensor:
    return vendor_ops_registry["paged_prefill_attention"](
        query, key, value, key_cache, value_cache, block_table, block_size, q_start_loc, q_seq_len, kv_seq_len,
        cu_seq_lens_kv, max_q_seq_len, max_kv_seq_len, num_q_heads, num_kv_heads, attn_mask, softmax_scale,
        alibi_slopes, attn_output, kv_scales, kv_zeros, quant_bits,
    )


# llm.py:425-442
def rms_norm(hidden_states: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    return vendor_ops_registry["rms_norm"](hidden_states, weight, epsilon)


# llm.py:454-474 (default_value dim=-1 at :456)
def silu_and_mul(input_tensor: Tensor, dim: int = -1) -> Tensor:
    return vendor_ops_registry["silu_and_mul"](input_tensor, dim)


# llm.py:496-518
def moe_gating_topk_softmax(router_logits: Tensor, topk: int, moe_metadata: MoeMetadata) -> tuple[Tensor, Tensor]:
    return vendor_ops_registry["moe_gating_topk_softmax"](router_logits, topk, moe_metadata)


# llm.py:523-543
def fused_attention(query_states: Tensor, key_states: Tensor, value_states: Tensor, mask: Sequence[Tensor | None]) -> Tensor:
    return vendor_ops_registry["fused_attention"](query_states, key_states, value_states, mask)


# llm.py:546-566
def fill_contiguous_kvcache(key_cache: Tensor, value_cache: Tensor, key_state: Tensor, value_state: Tensor) -> tuple[Tensor, Tensor]:
    return vendor_ops_registry["fill_contiguous_kvcache"](key_cache, value_cache, key_state, value_state)


# llm.py:569-579
def get_cache_len(cache: Tensor) -> int:
    return vendor_ops_registry["get_cache_len"](cache)


# llm.py:582-608 (upstream's all_reduce default is the type ``bool`` itself, kept)
def weight_quant_matmul(
    x1: Tensor,
    x2: Tensor,
    scale: Tensor,
    offset: Tensor | None = None,
    bias: Tensor | None = None,
    all_reduce: bool | None = bool,
    group_size: int | None = 0,
) -> Tensor:
    return vendor_ops_registry["weight_quant_matmul"](x1, x2, scale, offset, bias, all_reduce, group_size)


# llm.py:617-659
def fused_moe(
    hidden_states: Tensor,
    gate_up_weights: Tensor,
    down_weights: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    topk: int,
    renormalize: bool,
    moe_metadata: MoeMetadata,
    chunked_moe_layout=None,
) -> Tensor:
    fused_moe_impl = vendor_ops_registry["fused_moe"]
    args = (hidden_states, gate_up_weights, down_weights, topk_weights, topk_ids, topk, renormalize, moe_metadata)
    if chunked_moe_layout is None:
        return fused_moe_impl(*args)
    return fused_moe_impl(*args, chunked_moe_layout)


# llm.py:681-705 (default_value at :684)
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, all_reduce: bool | None = False, group: str | None = "") -> Tensor:
    return vendor_ops_registry["linear"](x, weight, bias, all_reduce, group)


# llm.py:714-740 (default_value at :717)
def dynamic_quant(x: Tensor, quant_dtype: torch.dtype, quant_granularity: str = None):
    return vendor_ops_registry["dynamic_quant"](x, quant_dtype, quant_granularity)


# llm.py:756-787 (default_value at :759)
def linear_w8a8(a: Tensor, b: Tensor, rms_scale, linear_scale, out_dtype: torch.dtype, quant_dtype: torch.dtype, bias: Tensor = None) -> Tensor:
    return vendor_ops_registry["linear_w8a8"](a, b, rms_scale, linear_scale, out_dtype, quant_dtype, bias)


# llm.py:801-827
def rms_norm_w8a8(hidden_states: Tensor, weight: Tensor, epsilon: float, quant_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return vendor_ops_registry["rms_norm_w8a8"](hidden_states, weight, epsilon, quant_dtype)


# llm.py:844-874
def add_rms_norm_w8a8(hidden_states: Tensor, residual: Tensor, weight: Tensor, epsilon: float, quant_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    return vendor_ops_registry["add_rms_norm_w8a8"](hidden_states, residual, weight, epsilon, quant_dtype)


# llm.py:895-916 (default_value at :899)
def transdata(hidden_states: Tensor, transdata_type: int = 2) -> Tensor:
    return vendor_ops_registry["transdata"](hidden_states, transdata_type)
