"""dlinfer's paged attention as plinth's attention backend, called as
LMDeploy's dlinfer backend calls it (backends/dlinfer/attention.py) with the
per-step metadata its Ascend op backend builds
(backends/dlinfer/ascend/op_backend.py:154-272, ``update_step_context``).

KV layout: each layer's K and V pages are ``[num_pages, page_size,
num_kv_heads, head_dim]`` (``PAGES_FIRST``; op_backend.py:131-152,
``get_k_block_shape``), the layout ATB's ``_npu_reshape_and_cache`` writes and
``npu_fused_infer_attention_score`` reads (viewed ``[pages, page_size, -1]``).

This module imports no vendor library at import time (its declarations are
read when the backend is validated); ``dlinfer.ops`` is imported when the
backend is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plinth.api import (
    PAGES_FIRST,
    AttentionBackend,
    AttentionMetadata,
    AttentionPlan,
    ModelConfig,
    OpTable,
    PageSizes,
    SelectionContext,
)

if TYPE_CHECKING:
    import torch

#: dlinfer asserts nothing about the page size; its caller LMDeploy requires
#: of every vendor ``>= 16 and a power of 2`` (lmdeploy/messages.py:532-535)
PAGE_SIZES = PageSizes(minimum=16, power_of_two=True)
#: the dtypes Ascend's attention kernels (ATB reshape_and_cache, npu_fused_infer_attention_score) take
DTYPES = ("float16", "bfloat16")


def model_problems(model: ModelConfig | None) -> list[str]:
    """What in a model's attention dlinfer's kernels cannot do, as its loader
    describes it (``ModelConfig.sliding_window``: Mistral's plain
    ``sliding_window`` as much as Gemma's layer types)."""
    if model is None:
        return []
    reasons = []
    if model.sliding_window:
        reasons.append(
            f"{model.architecture} uses sliding-window attention (window {model.sliding_window}), which dlinfer's paged attention ops do not take"
        )
    if model.attn_logit_softcap:
        reasons.append(f"{model.architecture} soft-caps attention logits, which dlinfer's attention ops do not take")
    if model.v_head_dim is not None and model.v_head_dim != model.head_dim:
        reasons.append(f"{model.architecture} caches latent (MLA) K/V; this backend lays out only K and V of one head size")
    return reasons


@dataclass
class StepPlan(AttentionPlan):
    """One step's arguments for the attention kernels, built once per step.

    kind: "decode" (every sequence one token), "prefill_no_cache" (every
    sequence's context is this step's tokens) or "paged_prefill" (anything
    else: chunks after a cached prefix, mixed with decodes).
    q_seq_len: decode: 1..B (TND's cumulative ends); prefill_no_cache: per
    sequence; paged_prefill: cumulative (op_backend.py:230-237).
    """

    kind: str
    kv_start_indices: "torch.Tensor"  # [T] int32 slots, page * page_size + offset
    block_table: "torch.Tensor"  # [B, max_pages] int32
    q_start_loc: "torch.Tensor"
    q_seq_len: "torch.Tensor"  # CPU int32
    kv_seq_len: "torch.Tensor"  # CPU int32, per sequence
    max_q_seq_len: int
    max_kv_seq_len: int
    attn_mask: "list[torch.Tensor]"
    page_size: int


#: sparse_mode 3 (bottom-right causal) takes this fixed upper triangle (op_backend.py:266-268)
_CAUSAL_MASKS: dict[Any, Any] = {}


def _causal_mask(device: Any) -> "torch.Tensor":
    import torch

    if device not in _CAUSAL_MASKS:
        _CAUSAL_MASKS[device] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
    return _CAUSAL_MASKS[device]


def build_plan(meta: AttentionMetadata, cache_dtype: Any = None) -> StepPlan:
    """LMDeploy's update_step_context for one step, from plinth's metadata
    (host-side lengths; no device sync)."""
    import torch

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


class DlinferAttention(AttentionBackend[StepPlan]):
    """fill_kv_cache, then prefill_attention (no cached prefix in the step) /
    paged_prefill_attention / paged_decode_attention, over ``PAGES_FIRST``
    pages; page copies are index copies along the page dimension (dlinfer has
    no page copy)."""

    layout = PAGES_FIRST
    page_sizes = PAGE_SIZES
    dtypes = DTYPES
    plan_type = StepPlan

    def __init__(self, ctx: SelectionContext, ops: OpTable | None = None, reference: AttentionBackend[Any] | None = None) -> None:
        import dlinfer.ops as ext_ops

        super().__init__(ctx, ops, reference)
        self.ext_ops = ext_ops

    @classmethod
    def problems(cls, ctx: SelectionContext) -> list[str]:
        return super().problems(ctx) + model_problems(ctx.model)

    def build_plan(self, meta: AttentionMetadata) -> StepPlan:
        return build_plan(meta)

    def forward(self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", kv_cache: Any, meta: AttentionMetadata, *, scale: float, sliding_window: int | None = None, logit_cap: float | None = None) -> "torch.Tensor":
        """As LMDeploy's DlinferAttentionImpl.forward (attention.py:63-152):
        fill the cache, then the kernel for the step's kind."""
        from plinth.api import PluginError

        if sliding_window is not None or logit_cap is not None:  # problems() refuses such models first
            raise PluginError("backend dlinfer: dlinfer's attention ops take no sliding window and no logit soft cap")
        ext_ops = self.ext_ops
        plan = self.plan(meta)
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
