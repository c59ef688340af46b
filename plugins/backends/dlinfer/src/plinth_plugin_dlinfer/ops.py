"""plinth's ops on ``dlinfer.ops``, called as LMDeploy's dlinfer backend calls
them (lmdeploy/pytorch/kernels/dlinfer/*.py and backends/dlinfer/attention.py)
with the per-step metadata its Ascend op backend builds
(backends/dlinfer/ascend/op_backend.py:154-272, ``update_step_context``).

KV layout: each layer's K and V pages are ``[num_pages, page_size,
num_kv_heads, head_dim]`` (op_backend.py:131-152, ``get_k_block_shape``), the
layout ATB's ``_npu_reshape_and_cache`` writes and
``npu_fused_infer_attention_score`` reads (viewed ``[pages, page_size, -1]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import dlinfer.ops as ext_ops
import torch
from dlinfer.utils.type_annotation import MoeMetadata
from plinth.api import AttentionMetadata, PluginError

from plinth_plugin_dlinfer.backend import page_size_problem

STATE_KEY = "dlinfer"
#: sparse_mode 3 (bottom-right causal) takes this fixed upper triangle (op_backend.py:266-268)
_CAUSAL_MASKS: dict[Any, torch.Tensor] = {}


@dataclass
class StepPlan:
    """One step's arguments for the attention kernels, built once per step.

    kind: "decode" (every sequence one token), "prefill_no_cache" (every
    sequence's context is this step's tokens) or "paged_prefill" (anything
    else: chunks after a cached prefix, mixed with decodes).
    q_seq_len: decode: 1..B (TND's cumulative ends); prefill_no_cache: per
    sequence; paged_prefill: cumulative (op_backend.py:230-237).
    """

    kind: str
    kv_start_indices: torch.Tensor  # [T] int32 slots, page * page_size + offset
    block_table: torch.Tensor  # [B, max_pages] int32
    q_start_loc: torch.Tensor
    q_seq_len: torch.Tensor  # CPU int32
    kv_seq_len: torch.Tensor  # CPU int32, per sequence
    max_q_seq_len: int
    max_kv_seq_len: int
    attn_mask: list[torch.Tensor]
    page_size: int


def _causal_mask(device: Any) -> torch.Tensor:
    if device not in _CAUSAL_MASKS:
        _CAUSAL_MASKS[device] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
    return _CAUSAL_MASKS[device]


def build_plan(meta: AttentionMetadata, cache_dtype: torch.dtype | None = None) -> StepPlan:
    """LMDeploy's update_step_context for one step, from plinth's metadata
    (host-side lengths; no device sync)."""
    q_lens, kv_lens = list(meta.query_lens_cpu), list(meta.seq_lens_cpu)
    device = meta.block_tables.device
    if meta.max_query_len == 1 and all(n == 1 for n in q_lens):
        kind = "decode"
        q_seq_len = torch.arange(1, len(q_lens) + 1, dtype=torch.int32)  # :230-233
    elif all(q == s for q, s in zip(q_lens, kv_lens)):
        kind = "prefill_no_cache"
        q_seq_len = torch.tensor(q_lens, dtype=torch.int32)
    else:
        kind = "paged_prefill"
        q_seq_len = torch.tensor(q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)  # :236-237
    mask: list[torch.Tensor] = []
    if kind == "prefill_no_cache":
        m = max(q_lens)
        dtype = cache_dtype or torch.float16
        mask = [torch.triu(torch.ones(m, m, dtype=dtype, device=device), diagonal=1)]  # :258-264 (max_q == max_kv)
    elif kind == "paged_prefill":
        mask = [_causal_mask(device)]
    # plinth's slot_mapping is the slot LMDeploy computes (:242-256): page * page_size + offset
    return StepPlan(
        kind=kind,
        kv_start_indices=meta.slot_mapping.to(torch.int32),
        block_table=meta.block_tables.to(torch.int32),
        q_start_loc=meta.query_start_loc[:-1],
        q_seq_len=q_seq_len,
        kv_seq_len=torch.tensor(kv_lens, dtype=torch.int32),
        max_q_seq_len=max(q_lens) if q_lens else 0,
        max_kv_seq_len=max(kv_lens) if kv_lens else 0,
        attn_mask=mask,
        page_size=meta.page_size,
    )


def allocate_kv_cache(*, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, v_head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    problem = page_size_problem(page_size)
    if problem:
        raise PluginError(f"backend dlinfer: {problem}")
    if v_head_dim != head_dim:
        raise PluginError(f"backend dlinfer: K head dim {head_dim} and V head dim {v_head_dim} differ (MLA): not implemented")
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def copy_pages(kv_caches: Sequence[Any], src: torch.Tensor, dst: torch.Tensor) -> None:
    if len(src) == 0:
        return
    for cache in kv_caches:
        for pages in cache:
            index_src = src.to(device=pages.device, dtype=torch.long)
            pages.index_copy_(0, dst.to(device=pages.device, dtype=torch.long), pages.index_select(0, index_src))


def prepare_attention(meta: AttentionMetadata) -> None:
    meta.backend_state[STATE_KEY] = build_plan(meta)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[Any, Any], meta: AttentionMetadata, *, scale: float, sliding_window: int | None = None, logit_cap: float | None = None) -> torch.Tensor:
    """As LMDeploy's DlinferAttentionImpl.forward (attention.py:63-152):
    fill the cache, then the kernel for the step's kind."""
    if sliding_window is not None or logit_cap is not None:
        raise PluginError("backend dlinfer: dlinfer's attention ops take no sliding window and no logit soft cap")
    plan = meta.backend_state.get(STATE_KEY)
    if plan is None:
        plan = meta.backend_state[STATE_KEY] = build_plan(meta)
    k_cache, v_cache = kv_cache
    if plan.kind == "prefill_no_cache" and plan.attn_mask[0].dtype != k_cache.dtype:
        plan.attn_mask = [plan.attn_mask[0].to(k_cache.dtype)]
    num_tokens, num_heads, _ = q.shape
    num_kv, v_dim = k.shape[1], v.shape[-1]
    ext_ops.fill_kv_cache(k, v, k_cache, v_cache, plan.kv_start_indices)
    out = q.new_empty(num_tokens, num_heads, v_dim)
    if plan.kind == "decode":
        return ext_ops.paged_decode_attention(
            q, k_cache, v_cache, plan.block_table, plan.page_size, plan.q_seq_len, plan.kv_seq_len, plan.max_kv_seq_len,
            num_heads, num_kv, head_size_v=v_dim, softmax_scale=scale, attn_output=out,
        )
    if plan.kind == "prefill_no_cache":
        return ext_ops.prefill_attention(
            q, k, v, k_cache, v_cache, plan.q_start_loc, plan.q_seq_len, plan.kv_seq_len, plan.max_q_seq_len,
            num_heads, num_kv, plan.attn_mask, softmax_scale=scale, attn_output=out,
        )
    return ext_ops.paged_prefill_attention(
        q, k, v, k_cache, v_cache, plan.block_table, plan.page_size, plan.q_start_loc, plan.q_seq_len, plan.kv_seq_len,
        None, plan.max_q_seq_len, plan.max_kv_seq_len, num_heads, num_kv, plan.attn_mask,
        head_size_v=v_dim, softmax_scale=scale, attn_output=out,
    )


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
        # ids of other ranks' experts (or padding) go to expert 0 with weight 0:
        # the kernel's routing takes only ids in [0, E)
        valid = (topk_ids >= 0) & (topk_ids < w13.shape[0])
        ids = torch.where(valid, topk_ids, torch.zeros_like(topk_ids))
        # in the activations' dtype, as LMDeploy hands them (the router logits' dtype)
        weights = torch.where(valid, topk_weights, torch.zeros_like(topk_weights)).to(x.dtype)
        return ext_ops.fused_moe(x, w13, w2, weights, ids, ids.shape[-1], False, one_rank)

    return {
        "allocate_kv_cache": allocate_kv_cache,
        "prepare_attention": prepare_attention,
        "attention": attention,
        "copy_pages": copy_pages,
        "rms_norm": rms_norm,
        "rotary": rotary,
        "pack_linear": pack_linear,
        "linear": linear,
        "silu_and_mul": silu_and_mul,
        "fused_moe": fused_moe,
    }
