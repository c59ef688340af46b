"""The paged KV block manager: a pool of pages of any size, with prefix caching.

A page holds ``page_size`` tokens' K/V for every layer. Pages are reference
counted so sequences can share them (a cached prefix, the prompt of n>1
samples). A full page is identified by a hash chained over its tokens and the
hashes of all earlier pages, so equal hashes mean equal prefixes. Pages whose
reference count drops to zero stay cached (and findable by hash) until they
are needed again, evicted least-recently-freed first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Any, Iterable, Sequence

from plinth.errors import PlinthError


class OutOfPages(PlinthError):
    """More pages were asked for than are free (the scheduler checks first)."""


def hash_page(parent: int, tokens: Sequence[int]) -> int:
    """The chained hash of one full page: stable across processes and hosts
    (a KV connector shares pages between instances by these hashes)."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_pages(tokens: Sequence[int], page_size: int, *, hash_seed: int = 0, start: Sequence[int] = ()) -> list[int]:
    """Hashes of every full page of ``tokens``, chained from ``hash_seed``
    (one per model: ``startup.hash_seed``); ``start`` holds hashes already
    known for the first pages (so growing sequences hash only new pages)."""
    hashes = list(start)
    parent = hashes[-1] if hashes else hash_seed
    for i in range(len(hashes), len(tokens) // page_size):
        parent = hash_page(parent, tokens[i * page_size : (i + 1) * page_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    """Pages ``0 .. num_pages-1``; the KV tensors themselves live in the model
    runner, indexed by these page numbers."""

    def __init__(self, num_pages: int, page_size: int, *, enable_caching: bool = True) -> None:
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.ref_count = [0] * num_pages
        self.page_hash: list[int | None] = [None] * num_pages
        self.cached: dict[int, int] = {}  # hash -> page
        # free pages in eviction order: front is taken first
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        #: the KV-event sink (``plinth.engine.kv_events.KVEventRecorder``), or None
        self.events: Any = None
        # prefix-cache statistics, in tokens
        self.queries = 0
        self.hits = 0

    @property
    def num_free(self) -> int:
        """Pages that can be allocated now (cached ones are evicted on demand)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def usage(self) -> float:
        return self.num_used / self.num_pages

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise OutOfPages(f"asked for {n} pages, {len(self.free)} free")
        pages = []
        evicted = []
        for _ in range(n):
            page, _ = self.free.popitem(last=False)
            h = self.page_hash[page]
            if h is not None:  # evict its cached content
                if self.cached.get(h) == page:
                    del self.cached[h]
                    evicted.append(h)
                self.page_hash[page] = None
            self.ref_count[page] = 1
            pages.append(page)
        if evicted and self.events is not None:
            self.events.removed(evicted)
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more holder for each page (a forked sequence)."""
        for p in pages:
            if self.ref_count[p] == 0:
                self.free.pop(p, None)
            self.ref_count[p] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one holder of each page. Freed pages holding a cached page
        stay findable; the tail of a sequence is freed first so it is evicted
        before the shared head."""
        for p in reversed(pages):
            self.ref_count[p] -= 1
            if self.ref_count[p] < 0:
                raise AssertionError(f"page {p} released more often than held")
            if self.ref_count[p] == 0:
                self.free[p] = None
                if self.page_hash[p] is None:
                    self.free.move_to_end(p, last=False)  # nothing cached: reuse first

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Take a reference on the cached pages for the longest prefix of
        ``hashes``; returns those pages (maybe none)."""
        pages: list[int] = []
        if not self.enable_caching:
            return pages
        for h in hashes:
            p = self.cached.get(h)
            if p is None:
                break
            pages.append(p)
        self.share(pages)
        return pages

    def count_hits(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queries += queried_tokens
        self.hits += hit_tokens

    def contains(self, h: int) -> bool:
        return h in self.cached

    def register(self, page: int, h: int) -> bool:
        """Mark ``page`` (now full and computed) as holding the page hashed
        ``h``; True when that hash entered the cache (it was not there)."""
        if not self.enable_caching or self.page_hash[page] is not None:
            return False
        if h in self.cached:
            return False
        self.cached[h] = page
        self.page_hash[page] = h
        return True

    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset_cache(self) -> None:
        """Forget every cached page that nobody holds."""
        dropped = []
        for h, p in list(self.cached.items()):
            if self.ref_count[p] == 0:
                del self.cached[h]
                self.page_hash[p] = None
                dropped.append(h)
        if self.events is not None and dropped:
            # vLLM reports a reset as AllBlocksCleared; pages still held stay cached here
            if self.cached:
                self.events.removed(dropped)
            else:
                self.events.cleared()
