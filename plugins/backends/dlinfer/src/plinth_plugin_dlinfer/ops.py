"""plinth's compute ops on ``dlinfer.ops``, called as LMDeploy's dlinfer
backend calls them (lmdeploy/pytorch/kernels/dlinfer/*.py). Paged attention
and the KV layout are this plugin's attention backend (``attention.py``)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import dlinfer.ops as ext_ops
import torch
from dlinfer.utils.type_annotation import MoeMetadata


def make_ops(ref: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """The op table; ``ref`` serves the cases dlinfer declines."""
    ref_rms, ref_rotary, ref_pack, ref_linear = ref["rms_norm"], ref["rotary"], ref["pack_linear"], ref["linear"]
    one_rank = MoeMetadata()  # ep_size 1: the naive path (no dispatch; plinth's a2a plugin moves tokens)

    def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None) -> Any:
        if weight is None:  # dlinfer's norms always scale
            return ref_rms(x, weight, eps, residual)
        if residual is not None:
            return ext_ops.add_rms_norm(x, residual, weight, eps)
        return ext_ops.rms_norm(x, weight, eps)

    def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool) -> Any:
        if not is_neox or q.dim() != 3:  # the vendor rotates halves of [T, H, D] heads only
            return ref_rotary(q, k, positions, cos_sin, is_neox)
        half = cos_sin.shape[1] // 2
        table = cos_sin.index_select(0, positions.reshape(-1))
        cos, sin = table[:, :half], table[:, half:]
        # LMDeploy's cos/sin: the angles repeated over both halves, in q's dtype (rotary_embedding.py:38-48)
        cos = torch.cat((cos, cos), dim=-1).to(q.dtype)
        sin = torch.cat((sin, sin), dim=-1).to(q.dtype)
        q_out, k_out = ext_ops.apply_rotary_pos_emb(q, k, cos, sin)
        return q_out.view(q.shape), k_out.view(k.shape)  # kernels/dlinfer/apply_rotary_pos_emb.py:19-27

    def pack_linear(weight: Any) -> Any:
        return weight if isinstance(weight, torch.Tensor) else ref_pack(weight)

    def linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return ext_ops.linear(x, weight, bias=bias)
        return ref_linear(x, weight, bias)

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return ext_ops.silu_and_mul(x)

    def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # the kernel's routing takes only ids in [0, E) (npu_moe_init_routing_v2 with
        # active_expert_range [0, E), moe.py fused_moe_naive) and computes every pair it is
        # given: ids of other ranks' experts (ep > 1) and a2a padding are left out, each
        # (token, expert) pair of this rank computed as one row of its own. Counting them
        # is one host sync per MoE layer (upstream's own ep path syncs there too: the
        # splits' .tolist() in moe.py fused_moe_all2all); with every id here (ep = 1) the
        # call is the kernel's as it is.
        valid = (topk_ids >= 0) & (topk_ids < w13.shape[0])
        tokens, slots = valid.nonzero(as_tuple=True)
        # in the activations' dtype, as LMDeploy hands them (the router logits' dtype)
        weights = topk_weights.to(x.dtype)
        if tokens.numel() == topk_ids.numel():
            return ext_ops.fused_moe(x, w13, w2, weights, topk_ids, topk_ids.shape[-1], False, one_rank)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if tokens.numel():
            ids, pair_weights = topk_ids[tokens, slots].view(-1, 1), weights[tokens, slots].view(-1, 1)
            rows = ext_ops.fused_moe(x.index_select(0, tokens), w13, w2, pair_weights, ids, 1, False, one_rank)
            out.index_add_(0, tokens, rows.float())
        return out.to(x.dtype)

    return {
        "rms_norm": rms_norm,
        "rotary": rotary,
        "pack_linear": pack_linear,
        "linear": linear,
        "silu_and_mul": silu_and_mul,
        "fused_moe": fused_moe,
    }
