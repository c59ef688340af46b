"""The attention backend: a backend plugin's paged attention and the KV
layout it reads, apart from its table of compute ops (``OpTable``).

As vLLM's ``AttentionBackend`` (its kv cache shape, metadata builder and
``validate_configuration``), an ``AttentionBackend`` declares

* ``layout``: the order of one layer's page tensor's dimensions, from which
  its shape and the dimension that indexes pages follow (the engine saves,
  loads and copies whole pages through it; a latent cache is the same
  tensor with one head);
* ``build_plan``: its metadata builder, once per step and KV-cache group,
  from the engine's ``AttentionMetadata`` into a typed ``AttentionPlan`` of
  its own that every layer reads (``meta.plan``);
* ``page_sizes`` and ``dtypes``: what its kernels take;
* ``problems(ctx)``: why it declines a context (a model's sliding windows,
  soft caps or latent cache, a page size, a dtype, deterministic mode).

A backend names its attention backend in ``Backend.attention_backend``; one
that names none, or whose attention backend declines the context, runs the
reference backend's (logged with the reasons, as a declined op is).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, Sequence, TypeVar

from plinth.contract.base import SelectionContext

if TYPE_CHECKING:
    import torch

    from plinth.contract.backend import AttentionMetadata, OpTable

#: the dimensions of one layer's page tensor, by name
PAGE_DIMS = ("pages", "page_size", "heads", "dim")


@dataclass(frozen=True)
class KVCacheLayout:
    """The order of one layer's K (or V) page tensor's dimensions: a
    permutation of ``PAGE_DIMS`` (pages, token in the page, KV head, feature).
    A slot (page * page_size + offset) names one token's row."""

    dims: tuple[str, ...]

    def __post_init__(self) -> None:
        if sorted(self.dims) != sorted(PAGE_DIMS):
            raise ValueError(f"a KV layout orders {', '.join(PAGE_DIMS)}, each once: {self.dims}")

    def shape(self, *, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The page tensor's shape for these sizes."""
        sizes = {"pages": num_pages, "page_size": page_size, "heads": num_kv_heads, "dim": head_dim}
        return tuple(sizes[d] for d in self.dims)

    @property
    def page_dim(self) -> int:
        """The dimension that indexes pages (a page is one index of it)."""
        return self.dims.index("pages")

    def token_major(self, pages: "torch.Tensor") -> "torch.Tensor":
        """A view of a page tensor as [pages, page_size, heads, dim] (no copy)."""
        return pages.permute(*(self.dims.index(d) for d in PAGE_DIMS))


#: heads outermost: a batch's pages gathered along dim 1 are [Hkv, B, L, D]
#: (the torch reference, cpukernels, triton)
HEADS_FIRST = KVCacheLayout(("heads", "pages", "page_size", "dim"))
#: token rows of all heads together (Ascend's ATB reshape_and_cache: dlinfer)
PAGES_FIRST = KVCacheLayout(("pages", "page_size", "heads", "dim"))


@dataclass(frozen=True)
class PageSizes:
    """The page sizes an attention backend's kernels take: at least
    ``minimum``, a multiple of ``multiple_of``, a power of two where
    ``power_of_two`` (LMDeploy's rule for dlinfer: >= 16 and a power of 2)."""

    minimum: int = 1
    multiple_of: int = 1
    power_of_two: bool = False

    def problem(self, page_size: int) -> str | None:
        """Why ``page_size`` is not one of them (None: it is)."""
        ok = page_size >= self.minimum and page_size % self.multiple_of == 0
        if self.power_of_two:
            ok = ok and page_size & (page_size - 1) == 0
        return None if ok else f"page size {page_size} is not {self.describe()}"

    def describe(self) -> str:
        parts = [f"at least {self.minimum}"] if self.minimum > 1 else []
        if self.multiple_of > 1:
            parts.append(f"a multiple of {self.multiple_of}")
        if self.power_of_two:
            parts.append("a power of two")
        return " and ".join(parts) or "any size"


class AttentionPlan:
    """Base of what an attention backend's ``build_plan`` makes of one step's
    ``AttentionMetadata`` (vLLM's per-backend ``AttentionMetadata``): its own
    dataclass, built once per step and KV-cache group, read by every layer."""


PlanT = TypeVar("PlanT", bound=AttentionPlan)

class QKVAttention(Protocol):
    def __call__(self, qkv: "torch.Tensor", positions: "torch.Tensor", cos_sin: "torch.Tensor", is_neox: bool, kv_cache: Any, meta: "AttentionMetadata", *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None) -> "torch.Tensor":
        """A layer's attention block from its fused projection qkv [T, (Hq +
        2 Hkv) * D] (q heads, then k, then v): the ``rotary`` op on q and k,
        then ``forward``; returns [T, Hq * D], the same numbers as those two."""
        ...


class AttentionBackend(abc.ABC, Generic[PlanT]):
    """Paged attention over one KV layout. Built once per process at
    start-up with the context, the resolved compute ops (a fused block may
    call them) and the reference backend's attention backend (None in the
    reference itself)."""

    #: the layout of every page tensor it allocates and reads
    layout: ClassVar[KVCacheLayout] = HEADS_FIRST
    #: the page sizes its kernels take
    page_sizes: ClassVar[PageSizes] = PageSizes()
    #: the dtypes of the pages (the compute dtype) its kernels take
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    #: ``forward`` hands what its kernels do not cover to the reference's
    #: ``forward`` over its own pages: start-up then requires the reference's
    #: layout to be this one
    shares_reference_pages: ClassVar[bool] = False
    #: the type ``build_plan`` returns (``plan`` checks what it finds against it)
    plan_type: type[PlanT]

    def __init__(self, ctx: SelectionContext, ops: "OpTable | None" = None, reference: "AttentionBackend[Any] | None" = None) -> None:
        self.ctx = ctx
        self.ops = ops
        self.reference = reference

    @classmethod
    def problems(cls, ctx: SelectionContext) -> list[str]:
        """Why it declines ``ctx`` (empty: it takes it): its page size and
        dtype against ``page_sizes`` and ``dtypes``; a subclass adds its own
        (call this one too): the model's sliding windows, soft caps or latent
        cache, deterministic mode. Decided from the context alone, importing
        no vendor library (``platform plugins`` asks too)."""
        reasons: list[str] = []
        if ctx.page_size is not None:
            problem = cls.page_sizes.problem(ctx.page_size)
            if problem:
                reasons.append(f"{problem}, as its kernels need")
        if ctx.dtype is not None and str(ctx.dtype).removeprefix("torch.") not in cls.dtypes:
            reasons.append(f"dtype {str(ctx.dtype).removeprefix('torch.')} is not one of {', '.join(cls.dtypes)}")
        return reasons

    def allocate(self, *, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, v_head_dim: int, dtype: "torch.dtype", device: "torch.device") -> "tuple[torch.Tensor, torch.Tensor | None]":
        """One layer's K and V pages in ``layout``, zeroed (padded reads must
        never meet NaN garbage); V is None when ``v_head_dim`` is 0 (V shares
        K's pages, as in MLA). The engine only counts pages."""
        import torch

        shape = self.layout.shape(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        if not v_head_dim:
            return k, None
        v_shape = self.layout.shape(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=v_head_dim)
        return k, torch.zeros(v_shape, dtype=dtype, device=device)

    def copy_pages(self, kv_caches: Sequence[Any], src: "torch.Tensor", dst: "torch.Tensor") -> None:
        """Copy whole pages src[i] -> dst[i] (int64) in every layer's K and V
        (a fork, n > 1): an index copy along the layout's page dimension."""
        if len(src) == 0:
            return
        dim = self.layout.page_dim
        for cache in kv_caches:
            for pages in cache:
                if pages is not None:
                    s, d = src.to(device=pages.device), dst.to(device=pages.device)
                    pages.index_copy_(dim, d, pages.index_select(dim, s))

    @abc.abstractmethod
    def build_plan(self, meta: "AttentionMetadata") -> PlanT:
        """The metadata builder: this step's plan from the engine's metadata
        (host-side lengths, no device sync). The engine calls it once per
        step and KV-cache group and stores it in ``meta.plan``."""
        raise NotImplementedError

    def plan(self, meta: "AttentionMetadata") -> PlanT:
        """``meta``'s plan, built now when the engine has not (a test's
        direct call) or another backend built it."""
        plan = meta.plan
        if not isinstance(plan, self.plan_type):
            plan = self.build_plan(meta)
            meta.plan = plan
        return plan

    @abc.abstractmethod
    def forward(self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", kv_cache: Any, meta: "AttentionMetadata", *, scale: float, sliding_window: int | None = None, logit_cap: float | None = None) -> "torch.Tensor":
        """out [T, Hq, Dv]: writes k, v [T, Hkv, D] into ``kv_cache`` at
        ``meta.slot_mapping`` (slot = page * page_size + offset), then attends
        causally over each sequence's pages (the last ``sliding_window``
        positions where given; scores soft-capped at ``logit_cap``)."""
        raise NotImplementedError

    def qkv_fusion(self) -> QKVAttention | None:
        """Optional: a fused attention block (``QKVAttention``) a model calls
        when nothing comes between its projection and the rotation (no
        per-head q/k norms); None: models call ``rotary`` and ``forward``."""
        return None
