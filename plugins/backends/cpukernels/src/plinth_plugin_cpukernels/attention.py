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
batch-invariant form), whose KV layout (``HEADS_FIRST``: ``[Hkv, num_pages,
page_size, D]``) this backend declares too (``shares_reference_pages``:
start-up holds the two declarations to each other) and whose plan it takes.

Its fused block (``qkv_fusion``, the C++ ``paged_qkv_attention``): from the
fused q/k/v projection it rotates q and k, writes k and v into the pages and
attends, where the separate ops take a split, two rotary kernels, two page
writes, a layout copy and the attention kernel (each a trip through the
dispatcher and an OpenMP fork, ~30 times a step). Inputs the kernel does not
cover run the op table's ``rotary`` and this backend's ``forward``, so both
paths give the same numbers.
"""

from __future__ import annotations

from typing import Any

from plinth.api import (
    HEADS_FIRST,
    AttentionBackend,
    AttentionMetadata,
    AttentionPlan,
    OpTable,
    PluginError,
    QKVAttention,
    SelectionContext,
)


def kernel_takes(dtype: Any, head_dim: int, v_head_dim: int, page_dtype: Any) -> bool:
    """The inputs the kernel covers (the rest go to the reference): bfloat16 or
    float32 pages of the query's dtype, head sizes multiples of 8."""
    import torch

    return dtype in (torch.bfloat16, torch.float32) and page_dtype == dtype and head_dim % 8 == 0 and v_head_dim % 8 == 0


class CPUKernelsAttention(AttentionBackend[AttentionPlan]):
    """The C++ paged attention kernel over the reference's pages (on 2 MB
    pages), the reference's plan, the reference's forward for what the
    kernel does not cover."""

    layout = HEADS_FIRST
    dtypes = ("float32", "bfloat16")
    shares_reference_pages = True

    def __init__(self, ctx: SelectionContext, ops: OpTable | None = None, reference: AttentionBackend[Any] | None = None) -> None:
        from plinth_plugin_cpukernels.backend import accelerator_isa, amx_attention
        from plinth_plugin_cpukernels.kernels import load_kernels

        super().__init__(ctx, ops, reference)
        isa = accelerator_isa(ctx)
        if isa is None or reference is None or ops is None:
            raise PluginError("cpukernels' attention needs the accelerator (its kernels are built for its instruction sets), the op table and the reference attention")
        self.reference_attention: AttentionBackend[Any] = reference
        self.plan_type = reference.plan_type  # the kernel reads the metadata itself; the fallback reads this plan
        self.kernels = load_kernels(isa)
        self.kernels.set_amx_attention(amx_attention(isa))  # one path per process
        self.rotary = ops.rotary

    def build_plan(self, meta: AttentionMetadata) -> AttentionPlan:
        return self.reference_attention.build_plan(meta)

    def allocate(self, *, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, v_head_dim: int, dtype: Any, device: Any) -> Any:
        # zeroed on 2 MB pages: a decode batch's pages scatter over the pool
        on_pages = self.kernels.zeros_on_large_pages
        k = on_pages(list(self.layout.shape(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim)), dtype)
        if not v_head_dim:
            return k, None
        return k, on_pages(list(self.layout.shape(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=v_head_dim)), dtype)

    def forward(self, q: Any, k: Any, v: Any, kv_cache: Any, meta: AttentionMetadata, *, scale: float, sliding_window: int | None = None, logit_cap: float | None = None) -> Any:
        k_pages, v_pages = kv_cache
        v_dim = (v_pages if v_pages is not None else k_pages).shape[-1]
        if logit_cap is not None or not kernel_takes(q.dtype, q.shape[-1], v_dim, k_pages.dtype):
            return self.reference_attention.forward(q, k, v, kv_cache, meta, scale=scale, sliding_window=sliding_window, logit_cap=logit_cap)
        heads, num_pages, page_size, dim = k_pages.shape
        slots = meta.slot_mapping
        k_pages.view(heads, num_pages * page_size, dim).index_copy_(1, slots, k.transpose(0, 1).to(k_pages.dtype))
        if v_pages is None:  # V shares K's pages
            v_pages = k_pages
        else:
            v_pages.view(heads, num_pages * page_size, v_pages.shape[-1]).index_copy_(
                1, slots, v.transpose(0, 1).to(v_pages.dtype)
            )
        return self.kernels.paged_attention(
            q.contiguous(), k_pages, v_pages, meta.block_tables, meta.query_start_loc, meta.seq_lens, float(scale),
            int(sliding_window or 0),
        )

    def qkv_fusion(self) -> QKVAttention | None:
        return self.forward_qkv

    def forward_qkv(self, qkv: Any, positions: Any, cos_sin: Any, is_neox: bool, kv_cache: Any, meta: AttentionMetadata, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None) -> Any:
        import torch

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
            return self.kernels.paged_qkv_attention(
                qkv, positions, cos_sin, bool(is_neox), k_pages, v_pages, meta.slot_mapping, meta.block_tables,
                meta.query_start_loc, meta.seq_lens, int(num_heads), float(scale), int(sliding_window or 0),
            )
        num_tokens = qkv.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q, k = self.rotary(
            q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim), positions, cos_sin, is_neox
        )
        out = self.forward(q, k, v.view(num_tokens, num_kv_heads, head_dim), kv_cache, meta, scale=scale, sliding_window=sliding_window)
        return out.reshape(num_tokens, -1)
