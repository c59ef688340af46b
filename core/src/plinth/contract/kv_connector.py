"""The kv_connector category (``--kv-connector``): an external KV-page store."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

from plinth.contract.base import PluginDescriptor, PluginImpl, SelectionContext

if TYPE_CHECKING:
    import torch



@dataclass(frozen=True)
class KVConnectorDescriptor(PluginDescriptor):
    """An external KV-cache store (``--kv-connector``). impl -> a ``KVConnector`` subclass."""

    category: ClassVar[str] = "kv_connector"


@dataclass(frozen=True)
class KVLayout:
    """What a KV connector stores, and whose it is.

    A stored value is one full page of one model's KV cache (every layer, K
    and V) in the backend's layout: ``value_bytes`` long (a header the core
    writes and checks, then ``page_bytes`` of payload). Keys are strings the
    core builds from ``fingerprint``, the tp rank and the page's chained hash,
    so equal keys mean equal prefixes of the same model in the same layout.

    model_id:    the model (architecture, sizes, checkpoint name)
    fingerprint: model_id plus the KV layout (page size, dtype, KV heads, head
                 dims, layers, the backend's page shape, tp rank and size);
                 a value written under another fingerprint is foreign: a miss
    """

    model_id: str
    fingerprint: str
    page_size: int
    page_bytes: int
    value_bytes: int
    dtype: str = ""
    num_kv_heads: int = 0
    tp_rank: int = 0
    tp_size: int = 1


class KVConnector(PluginImpl):
    """An external KV-page store shared across engine instances (vLLM's v1
    connector split: a scheduler side and a worker side).

    The plugin's methods are plain blocking calls; the core never makes them
    on the engine's step loop. It runs them on its own threads with a
    deadline and a circuit breaker (``kv_connector_config``: ``deadline_s``,
    ``breaker_failures``, ``breaker_reset_s``), so a slow or dead store costs
    a request at most the deadline, then recomputation. The core also writes
    and checks every value's header (key, layout fingerprint, length,
    checksum): a corrupt, truncated or foreign value is a miss, never loaded.
    What a failed or partial load means is the core's ``failure_policy``:
    ``recompute`` (those tokens are computed, counted and logged; health says
    degraded) or ``fail`` (the request ends with an error).

    Scheduler side (rank 0, at admission, for the prompt's pages the local
    prefix cache lacks):

    * ``lookup(keys) -> int``: how many leading keys the store holds.

    Worker side (every rank; pages are staged through CPU buffers the core
    owns, so a call that outlives its deadline never touches live pages):

    * ``load(keys, buffers) -> list[int]``: read the value of ``keys[i]`` into
      ``buffers[i]`` (a contiguous ``torch.uint8`` CPU tensor of
      ``layout.value_bytes``); per key the bytes read, or a number <= 0 for a
      miss or a failure. The core checks each value before it fills a page
      and uses the leading run of good ones.
    * ``save(keys, values) -> None``: store each value (uint8 CPU tensors,
      ``layout.value_bytes`` long) under its key; keys already stored may be
      skipped. Raise on failure.
    * ``register_buffer(tensor)``: once per worker thread, at start-up (or at
      that thread's first call when the store was down then), the staging
      area that thread's buffers and values are slices of, kept for its
      later calls (register it with a transfer engine that needs registered
      memory); a later call with another area replaces the old one.

    Both sides: ``health() -> (ok, why)`` (called off the step loop, also as
    the circuit breaker's probe: it may try to reconnect), ``close()``.
    Raise an exception for any failure; never return wrong bytes.

    A store with tiers may call ``report_tier("stored" | "removed", keys,
    medium)`` when values enter or leave one (``medium`` as vLLM names it:
    ``"CPU"``, ``"STORAGE"``, ...); with ``--kv-events-config`` the core
    publishes them as KV events carrying that medium (from any thread).
    """

    def __init__(self, ctx: SelectionContext, *, config: Mapping[str, Any], layout: KVLayout) -> None:
        self.ctx = ctx
        self.config = dict(config)
        self.layout = layout
        #: set by the core when KV events are on: (kind, keys, medium)
        self.tier_listener: Callable[[str, Sequence[str], str], None] | None = None

    def report_tier(self, kind: str, keys: Sequence[str], medium: str) -> None:
        """Values under ``keys`` were stored in (``"stored"``) or evicted from
        (``"removed"``) this store's tier ``medium``."""
        listener = getattr(self, "tier_listener", None)
        if listener is not None and keys:
            listener(kind, keys, medium)

    # scheduler side
    @abc.abstractmethod
    def lookup(self, keys: Sequence[str]) -> int:
        """How many of these keys, from the first, the store holds."""
        raise NotImplementedError

    # worker side
    @abc.abstractmethod
    def load(self, keys: Sequence[str], buffers: Sequence["torch.Tensor"]) -> Sequence[int]:
        """Read each key's value into its buffer; bytes read per key (<= 0: missing or failed)."""
        raise NotImplementedError

    @abc.abstractmethod
    def save(self, keys: Sequence[str], values: Sequence["torch.Tensor"]) -> None:
        """Store each value under its key (best effort; raise on failure)."""
        raise NotImplementedError

    def register_buffer(self, buffer: "torch.Tensor") -> None:
        """The CPU staging area the calls that follow on this thread use (each
        load buffer and save value lies in it). Called once per worker
        thread, at start-up, and kept; another area replaces the old one."""

    def health(self) -> tuple[bool, str]:
        """(reachable, why not). May block; the core calls it off the step loop."""
        return True, "ok"

    def close(self) -> None:
        pass
