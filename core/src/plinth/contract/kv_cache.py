"""What a layer keeps in the KV cache, as the model describes it.

A model says, per layer, which ``KVCacheSpec`` it caches (or ``None``: no
cache). Layers with equal specs form one *group*: they share block tables
and page numbers, and the KV-cache manager hands out each group's pages from
a pool of its own. Core never derives a page's bytes from heads and head
sizes: it asks the spec. A plugin may subclass ``KVCacheSpec`` (a latent MLA
cache lives in its model plugin), as vLLM's ``KVCacheSpec`` subclasses do.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVCacheSpec(ABC):
    """One layer's paged cache. Frozen: equal specs are one group."""

    @abstractmethod
    def page_bytes(self, page_size: int, dtype: "torch.dtype") -> int:
        """Bytes one page of ``page_size`` tokens takes in one layer."""

    @abstractmethod
    def allocation(self) -> dict[str, int]:
        """The per-token shape the attention backend's ``allocate`` takes:
        ``num_kv_heads``, ``head_dim`` and ``v_head_dim`` (0: V shares K's
        pages, one tensor per layer, as a latent cache does)."""

    def first_needed(self, num_computed: int) -> int:
        """The earliest token position the next query (at ``num_computed``)
        or any later one reads. Pages wholly before it are never read again
        and go back to the pool; 0 (everything) unless the layer forgets."""
        return 0


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Per-head K and V for every token."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None  # None: head_dim; 0: V shares K's pages

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError(f"{type(self).__name__} needs at least one KV head of at least one dim: {self}")
        if self.v_head_dim is None:  # equal specs compare equal however V's width was said
            object.__setattr__(self, "v_head_dim", self.head_dim)

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def page_bytes(self, page_size: int, dtype: "torch.dtype") -> int:
        return page_size * self.num_kv_heads * (self.head_dim + self.v_dim) * dtype.itemsize

    def allocation(self) -> dict[str, int]:
        return {"num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "v_head_dim": self.v_dim}


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Per-head K and V; the layer attends only to the last ``window``
    positions (a query at p reads keys p - window + 1 .. p), so older pages
    are freed as decoding moves on."""

    window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"a sliding window must be at least 1 token, got {self.window}")

    def first_needed(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1)
