"""The numpyops paged attention: the KV page layout it reads, the plan it
builds once per step from the engine's metadata, and the attention itself.
Imported when the backend is chosen (or asked for its attention backend):
import your kernels inside the methods, not at the top."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plinth.api import HEADS_FIRST, AttentionBackend, AttentionMetadata, AttentionPlan, PageSizes, SelectionContext

if TYPE_CHECKING:
    import torch


@dataclass
class NumpyopsPlan(AttentionPlan):
    """What `build_plan` makes of one step's metadata for your kernels
    (int32 block tables, cumulative query lengths, ...): built once per step,
    read by every layer as `meta.plan`."""

    num_tokens: int


class NumpyopsAttention(AttentionBackend[NumpyopsPlan]):
    #: the order of a page tensor's dimensions (HEADS_FIRST: [heads, pages, page_size, dim]; or PAGES_FIRST)
    layout = HEADS_FIRST
    #: the page sizes your kernels take (PageSizes(minimum=16, power_of_two=True), ...)
    page_sizes = PageSizes()
    #: the page (compute) dtypes they take
    dtypes = ("float32", "bfloat16")
    plan_type = NumpyopsPlan

    @classmethod
    def problems(cls, ctx: SelectionContext) -> list[str]:
        """Why it declines `ctx`: the page size and dtype (the base checks
        those), plus what your kernels lack (ctx.model.sliding_window,
        attn_logit_softcap, deterministic mode ...)."""
        return super().problems(ctx)

    def build_plan(self, meta: AttentionMetadata) -> NumpyopsPlan:
        """This step's plan, from the host-side lengths (meta.query_lens_cpu,
        meta.seq_lens_cpu) and the device tensors (block_tables, slot_mapping,
        query_start_loc, seq_lens, positions); no device sync."""
        raise NotImplementedError("NumpyopsAttention.build_plan(): not implemented yet (a NumpyopsPlan from meta)")

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, meta: AttentionMetadata, *,
        scale: float, sliding_window: int | None = None, logit_cap: float | None = None,
    ) -> torch.Tensor:
        """out [T, Hq, Dv]: write k, v [T, Hkv, D] into kv_cache (this layer's
        (k_pages, v_pages), laid out as `layout`) at meta.slot_mapping, then
        attend causally over each sequence's pages (self.plan(meta) is the step's plan)."""
        raise NotImplementedError("NumpyopsAttention.forward(): not implemented yet (write k and v, attend over the pages)")
