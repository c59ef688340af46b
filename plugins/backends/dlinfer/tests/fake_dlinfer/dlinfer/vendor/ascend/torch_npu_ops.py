"""The Ascend vendor's ops, as upstream dlinfer/vendor/ascend/torch_npu_ops.py
(and attention.py, moe.py) write them, with the torch_npu / ATB kernels
replaced by the torch stand-ins of ``kernels``. Line numbers are upstream's
(DeepLink-org/dlinfer a50184e3)."""
import math
from typing import Sequence

import torch
from torch import Tensor

from dlinfer.utils.registry import register_ops
from dlinfer.utils.type_annotation import MoECommType, MoeMetadata
from dlinfer.vendor import vendor_ops_registry

from . import (
    kernels,
    moe,  # noqa: E402,F401
)

# v0.2.7 torch_npu_ops.py:19-20 (the same in v0.2.8 and main): importing the vendor imports
# its attention module, which imports LMDeploy's graph runner (attention.py:4-8 ->
# framework/lmdeploy_ext/cudagraph/ascend_cudagraph.py:14-21): dlinfer-ascend cannot be
# imported without lmdeploy, though its runtime requirements do not name it
from .attention import decode_attention, decode_attention_mla  # noqa: E402,F401
from .utils import SocVersion, get_cpu_seq_len


def _not_modelled(name):
    def op(*args, **kwargs):
        raise NotImplementedError(f"the fake dlinfer does not model {name} (plinth does not call it)")

    op.__name__ = name
    return op


# registered upstream, not modelled here: plinth's backend never calls them
for _name in ("rms_norm_w8a8", "add_rms_norm_w8a8", "dynamic_quant", "linear_w8a8", "incre_flash_attention",
              "fused_attention", "weight_quant_matmul", "transdata"):
    register_ops(vendor_ops_registry)(_not_modelled(_name))


@register_ops(vendor_ops_registry)
def add_rms_norm(hidden_states: Tensor, residual: Tensor, weight: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    # :107-117, npu_add_rms_norm -> (normed, rstd, x + residual)
    added = hidden_states + residual
    return _rms(added, weight, epsilon), added


def _rms(x, weight, eps):
    # npu_rms_norm computes in float32 and returns x's dtype
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


@register_ops(vendor_ops_registry)
def apply_rotary_pos_emb(query: Tensor, key: Tensor, cos: Tensor | None, sin: Tensor | None) -> tuple[Tensor, Tensor]:
    # :120-167
    query = query.contiguous().unsqueeze(0)
    key = key.contiguous().unsqueeze(0)
    assert len(query.shape) == 4  # :130
    batch, seq_len, _, head_size = query.shape
    rotary_dim = cos.size(-1)
    cos = cos.reshape(batch, seq_len, 1, -1)
    sin = sin.reshape(batch, seq_len, 1, -1)
    if rotary_dim == head_size:
        return kernels.rotate_half_apply(query, key, cos, sin)
    elif rotary_dim < head_size:
        q_rot, q_pass = query[..., :rotary_dim].contiguous(), query[..., rotary_dim:]
        k_rot, k_pass = key[..., :rotary_dim].contiguous(), key[..., rotary_dim:]
        q_rot, k_rot = kernels.rotate_half_apply(q_rot, k_rot, cos, sin)
        return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)
    else:
        raise RuntimeError("apply_rotary_pos_emb does not " "support rotary_dim > head_size")  # :165-167


@register_ops(vendor_ops_registry)
def prefill_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    q_start_loc: Tensor,
    q_seq_len: Tensor,
    max_q_seq_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    attn_mask: Sequence[Tensor | None],
    softmax_scale: float | None,
    alibi_slopes: Sequence[float] | None,
    attn_output: Tensor | None,
) -> Tensor:
    # :170-241
    if alibi_slopes is not None:
        raise RuntimeError("paged_decode_attention does not " "support alibi_slopes yet")  # :185-188
    query = query.contiguous()
    key = key.contiguous()
    value = value.contiguous()
    attn_output = attn_output.contiguous()  # :193: attn_output must be given
    scale_value = softmax_scale if softmax_scale else 1.0 / math.sqrt(query.shape[-1])
    if not len(attn_mask):
        # :197-210, the vision towers' unmasked attention: not modelled
        raise NotImplementedError("the fake dlinfer does not model prefill_attention without a mask")
    mask = attn_mask[0]
    if SocVersion.is_Ascend910():
        kernels.flash_attention(
            query=query, key=key, value=value, mask=mask, seq_len=q_seq_len, scale_value=scale_value,
            num_heads=num_q_heads, num_kv_heads=num_kv_heads, out=attn_output,
        )
    else:
        raise ValueError(f"dlinfer doesn't support {SocVersion.device_name()} device currently.")
    return attn_output


@register_ops(vendor_ops_registry)
def fill_kv_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    kv_indices: Tensor,
    k_scales_zeros: Sequence[Tensor | None],
    v_scales_zeros: Sequence[Tensor | None],
    quant_bits: int,
) -> tuple[Tensor, Tensor]:
    # :311-351
    key = key.contiguous()
    value = value.contiguous()
    if quant_bits == 8:

        def quant_int8(x, x_scale, x_offset):
            return ((x / x_scale) - x_offset).round().clamp(-128, 127).to(torch.int8)

        key = quant_int8(key, k_scales_zeros[0], k_scales_zeros[1])
        value = quant_int8(value, v_scales_zeros[0], v_scales_zeros[1])
    is_mla = key.shape[-1] != value.shape[-1]
    if is_mla:
        assert len(key_cache.shape) == 4  # :339
        key_cache_reshaped = torch.flatten(key_cache, start_dim=0, end_dim=1)
        key_cache_reshaped[kv_indices.view(-1).long()] = key  # npu_scatter_nd_update_
    else:
        kernels.reshape_and_cache(key, value, key_cache, value_cache, kv_indices.to(torch.int32))
    return key_cache, value_cache


@register_ops(vendor_ops_registry)
def fill_contiguous_kvcache(key_cache: Tensor, value_cache: Tensor, key_state: Tensor, value_state: Tensor) -> tuple[Tensor, Tensor]:
    # :354-360
    return torch.cat([key_cache, key_state], dim=1), torch.cat([value_cache, value_state], dim=1)


@register_ops(vendor_ops_registry)
def get_cache_len(cache: Tensor):
    return cache.shape[1]  # :363-365


@register_ops(vendor_ops_registry)
def paged_decode_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor | None,
    block_size: int,
    q_seq_len: Tensor,
    kv_seq_len: Tensor,
    max_kv_seq_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    softmax_scale: float | None,
    alibi_slopes: Sequence[float] | None,
    attn_output: Tensor | None,
    kv_scales: Tensor | None,
    kv_zeros: Tensor | None,
    quant_bits: int | None,
) -> Tensor:
    # :368-424, then attention.py:11-85 (decode_attention, eager branch)
    if alibi_slopes is not None:
        raise RuntimeError("paged_decode_attention does not " "support alibi_slopes yet")
    if isinstance(block_table, torch.Tensor) and block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)
    query = query.contiguous()
    attn_output = attn_output.contiguous()  # :395: attn_output must be given
    scale_value = softmax_scale if softmax_scale else 1.0 / math.sqrt(query.shape[-1])
    if key_cache.shape[-1] != value_cache.shape[-1]:
        raise NotImplementedError("the fake dlinfer does not model decode_attention_mla (atb._npu_paged_attention_mla)")
    block_num = key_cache.size(0)
    key_cache = key_cache.view(block_num, block_size, -1)  # attention.py:66-67
    value_cache = value_cache.view(block_num, block_size, -1)
    attn_output, _ = kernels.fused_infer_attention_score(
        query=query, key=key_cache, value=value_cache, atten_mask=None, block_table=block_table,
        input_layout="TND", block_size=block_size, actual_seq_lengths=q_seq_len, actual_seq_lengths_kv=kv_seq_len,
        num_key_value_heads=num_kv_heads, num_heads=num_q_heads, scale=scale_value, sparse_mode=0,
    )
    return attn_output  # a new tensor: the attn_output argument is not written (attention.py:70)


@register_ops(vendor_ops_registry)
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
    softmax_scale: float | None,
    alibi_slopes: Sequence[float] | None,
    attn_output: Tensor | None,
    kv_scales: Tensor | None,
    kv_zeros: Tensor | None,
    quant_bits: int | None,
) -> Tensor:
    # :427-479
    if alibi_slopes is not None:
        raise RuntimeError("paged_decode_attention does not " "support alibi_slopes yet")
    scale_value = softmax_scale if softmax_scale else 1.0 / math.sqrt(query.shape[-1])
    query = query.contiguous()
    block_num = key_cache.size(0)
    key_cache = key_cache.view(block_num, block_size, -1)
    value_cache = value_cache.view(block_num, block_size, -1)
    attn_output, _ = kernels.fused_infer_attention_score(
        query=query, key=key_cache, value=value_cache, atten_mask=attn_mask[0], block_table=block_table,
        input_layout="TND", block_size=block_size, actual_seq_lengths=q_seq_len, actual_seq_lengths_kv=kv_seq_len,
        num_key_value_heads=num_kv_heads, num_heads=num_q_heads, scale=scale_value, sparse_mode=3,
    )
    return attn_output


@register_ops(vendor_ops_registry)
def rms_norm(hidden_states: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    return _rms(hidden_states.contiguous(), weight, epsilon)  # :482-485


@register_ops(vendor_ops_registry)
def silu_and_mul(input_tensor: Tensor, dim: int) -> Tensor:
    # :488-494; npu_swiglu(x, dim) = silu(first half) * second half along dim
    gate, up = input_tensor.chunk(2, dim)
    return torch.nn.functional.silu(gate) * up


@register_ops(vendor_ops_registry)
def moe_gating_topk_softmax(router_logits: Tensor, topk: int, moe_metadata: MoeMetadata) -> tuple[Tensor, Tensor]:
    # :497-531, the ep_size 1, router_n_groups -1 path: npu_moe_gating_top_k_softmax
    assert moe_metadata.ep_size == 1 and moe_metadata.router_n_groups <= 0, "the fake models one rank, no groups"
    weights, ids = torch.topk(router_logits.float().softmax(-1), topk, dim=-1)
    return weights.to(router_logits.dtype), ids.to(torch.int32)


@register_ops(vendor_ops_registry)
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
    # :627-709 with moe.py:353-407 (fused_moe_naive): one rank, no comm
    topk_ids = topk_ids.to(torch.int32)
    assert moe_metadata.ep_size <= 1 and moe_metadata.moe_comm_type not in (MoECommType.MC2, MoECommType.ALLTOALL), (
        "the fake models the naive (one rank) path only"
    )
    assert chunked_moe_layout is None, "the fake models <= 1024 experts (moe.py:245)"
    num_experts = gate_up_weights.size(0)
    assert topk_ids.shape[-1] == topk, (topk_ids.shape, topk)
    if renormalize:
        topk_weights.div_(topk_weights.sum(dim=-1, keepdim=True))  # in place, as moe.py:370-371
    per_pair = kernels.moe_init_routing_and_mlp(hidden_states, gate_up_weights, down_weights, topk_ids, num_experts)
    # npu_moe_token_unpermute: the k outputs of a token, weighted by probs, summed
    out = (per_pair.float() * topk_weights.float().unsqueeze(-1)).sum(1)
    return out.to(hidden_states.dtype)


@register_ops(vendor_ops_registry)
def linear(x: Tensor, weight: Tensor, bias: Tensor | None, all_reduce: bool | None, group: str | None) -> Tensor:
    # :712-743
    if all_reduce:
        raise NotImplementedError("the fake dlinfer does not model npu_mm_all_reduce_base (HCCL)")
    if len(weight.shape) == 4 and weight.shape[0] == 1 and weight.shape[1] * weight.shape[3] == x.shape[-1]:
        weight = weight.permute(0, 2, 1, 3)
        weight = weight.reshape(weight.shape[1], -1)
    return torch.nn.functional.linear(x, weight, bias)


_ = get_cpu_seq_len  # upstream imports it for the unmasked prefill path (not modelled)
