"""The one owner of KV pages.

Every page a sequence holds is handed out, shared, copied, cached and freed
here; the scheduler, the n>1 fork, preemption, the prefix cache and the KV
connector all go through this class, the way vLLM's ``KVCacheManager``
(``get_computed_blocks`` / ``allocate_slots`` / ``free``) hides blocks from
its scheduler. Nobody else edits a sequence's page list, its
``num_computed`` or its ``page_hashes``: the scheduler asks "can this
sequence run n more tokens?", reads the block tables it puts in the step's
batch, and after the forward calls ``commit``.

The cache is split into *groups* (``KVCacheGroup``): layers whose
``KVCacheSpec`` is equal share one block table per sequence and draw pages
from a pool of their own. A group whose spec forgets old tokens (a sliding
window) gives pages wholly before ``spec.first_needed`` back as the
sequence moves on; in its block table such a page reads ``null_page``, a page
never handed out that the attention masks anyway. Page ``j`` of a sequence
holds the same tokens in every group, so one chain of page hashes serves
all groups (vLLM's hybrid KV-cache manager does the same).

Admission (``get_computed_tokens``) takes the longest cached prefix every
group can reuse: a full-attention group needs every page of it, a sliding
group only the pages its window still reads (vLLM's hybrid rule). Then, for
the pages after it, the KV connector (when one is configured). A connector
lookup runs off the step loop; while it is in flight the answer is ``None``
("ask again later") and the scheduler moves on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from plinth.engine.block_manager import BlockPool, hash_pages

if TYPE_CHECKING:
    from plinth.api import KVCacheSpec
    from plinth.engine.sequence import Sequence as Seq

log = logging.getLogger("plinth.kv")


@dataclass
class KVCacheGroup:
    """Layers with one spec: their pages come from ``pool``."""

    spec: "KVCacheSpec | None"  # None: a full cache (a manager built from a bare pool)
    layers: tuple[int, ...]
    pool: BlockPool
    #: stands for a freed page in a forgetting group's block tables (held forever, never written)
    null_page: int | None = None

    def first_needed(self, num_computed: int) -> int:
        return 0 if self.spec is None else self.spec.first_needed(num_computed)

    @property
    def forgets(self) -> bool:
        return self.null_page is not None

    @property
    def usable_pages(self) -> int:
        return self.pool.num_pages - (self.null_page is not None)

    def watermark(self) -> int:
        return max(1, self.pool.num_pages // 100)


def forgets(spec: "KVCacheSpec | None") -> bool:
    """Whether a spec frees pages behind its sequences (overrides ``first_needed``)."""
    return spec is not None and spec.first_needed(1 << 40) > 0


def make_group(spec: "KVCacheSpec | None", layers: Sequence[int], num_pages: int, page_size: int, *, enable_caching: bool) -> KVCacheGroup:
    """A group over a fresh pool of ``num_pages`` usable pages (one more,
    the null page, for a group that forgets)."""
    extra = 1 if forgets(spec) else 0
    pool = BlockPool(num_pages + extra, page_size, enable_caching=enable_caching)
    null = pool.allocate(1)[0] if extra else None
    return KVCacheGroup(spec, tuple(layers), pool, null)


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool | Sequence[KVCacheGroup],
        *,
        hash_seed: int = 0,
        copy_pages: Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]]], None] | None = None,
    ) -> None:
        """``pool``: the groups, or one pool (one full-attention group over every layer)."""
        self.groups: list[KVCacheGroup] = [KVCacheGroup(None, (), pool)] if isinstance(pool, BlockPool) else list(pool)
        if not self.groups or len({g.pool.page_size for g in self.groups}) != 1:
            raise ValueError("the KV-cache groups need one page size")
        self.page_size = self.groups[0].pool.page_size
        self.hash_seed = hash_seed
        #: worker side: copy whole pages src[g][i] -> dst[g][i] in group g's layers (the model runner's)
        self.copy_pages = copy_pages
        #: the KV connector's engine side (``plinth.engine.kv_transfer.KVTransfer``), or None
        self.connector: Any = None
        self._tables: dict[int, list[list[int]]] = {}  # seq_id -> per group, its pages in order
        # admission statistics, in tokens
        self.local_hit_tokens = 0
        self.external_hit_tokens = 0

    # ---- what the scheduler may ask ------------------------------------------------

    @property
    def pool(self) -> BlockPool:
        """The first group's pool (the only one of a one-group model)."""
        return self.groups[0].pool

    @property
    def num_pages(self) -> int:
        """Pages one sequence can hold at once in the smallest group."""
        return min(g.usable_pages for g in self.groups)

    @property
    def token_capacity(self) -> int:
        """The longest sequence the pool can hold (groups that forget hold only a window of it)."""
        keep = [g.usable_pages for g in self.groups if not g.forgets]
        return min(keep) * self.page_size if keep else 1 << 62

    @property
    def num_free(self) -> int:
        return min(g.pool.num_free for g in self.groups)

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def block_table(self, seq: "Seq") -> list[list[int]]:
        """Per group, the pages of ``seq`` in order (a copy: read only)."""
        tables = self._tables.get(seq.seq_id)
        return [list(t) for t in tables] if tables else [[] for _ in self.groups]

    def num_pages_of(self, seq: "Seq") -> int:
        """Pages ``seq``'s block tables span (0: it holds none)."""
        tables = self._tables.get(seq.seq_id)
        return len(tables[0]) if tables else 0

    def _need(self, seq: "Seq", num_new_tokens: int) -> int:
        return max(0, -(-(seq.num_computed + num_new_tokens) // self.page_size) - self.num_pages_of(seq))

    def can_allocate(self, seq: "Seq", num_new_tokens: int, *, watermark: bool = False) -> bool:
        """Whether every group has the pages ``num_new_tokens`` more tokens need
        (keeping each group's watermark free when asked)."""
        need = self._need(seq, num_new_tokens)
        return all(need <= g.pool.num_free - (g.watermark() if watermark else 0) for g in self.groups)

    def tokens_fitting(self, seq: "Seq", *, watermark: bool = False) -> int:
        """How many more tokens fit in the pages it holds plus the free ones."""
        held = self.num_pages_of(seq)
        free = min(g.pool.num_free - (g.watermark() if watermark else 0) for g in self.groups)
        return (held + max(free, 0)) * self.page_size - seq.num_computed

    def exceeds_capacity(self, seq: "Seq", num_new_tokens: int) -> bool:
        """Whether ``seq`` would need more pages at once than a whole group's pool."""
        end = -(-(seq.num_computed + num_new_tokens) // self.page_size)
        return any(end - g.first_needed(seq.num_computed) // self.page_size > g.usable_pages for g in self.groups)

    def pages_held(self) -> int:
        """Pages referenced by anyone (0 when idle: nothing leaked)."""
        return sum(sum(1 for r in g.pool.ref_count if r > 0) - g.forgets for g in self.groups)

    def group_pages_held(self) -> list[int]:
        """Per group, the pages referenced by anyone."""
        return [sum(1 for r in g.pool.ref_count if r > 0) - g.forgets for g in self.groups]

    # ---- admission: the computed prefix ------------------------------------------------

    def _hash(self, seq: "Seq", num_tokens: int) -> list[int]:
        """The one place page hashes are set: ``seq``'s full pages up to
        ``num_tokens`` tokens (only new pages are hashed)."""
        if len(seq.page_hashes) < num_tokens // self.page_size:
            seq.page_hashes = hash_pages(seq.token_ids[:num_tokens], self.page_size, hash_seed=self.hash_seed, start=seq.page_hashes)
        return seq.page_hashes

    def _group_hit(self, g: KVCacheGroup, hashes: Sequence[int], limit: int) -> int:
        """The most pages ``k <= limit`` of a cached prefix ``g`` can reuse:
        every page it reads to run token ``k * page_size`` is cached."""
        ps = self.page_size
        if not g.pool.enable_caching:
            return 0
        cached = [g.pool.contains(h) for h in hashes[:limit]]
        if not g.forgets:
            return next((j for j, c in enumerate(cached) if not c), limit)
        for k in range(limit, 0, -1):
            lo = g.first_needed(k * ps) // ps
            run = 0
            for j in range(k - 1, lo - 1, -1):
                if not cached[j]:
                    break
                run += 1
            if run == k - lo:
                return k
        return 0

    def _take_prefix(self, g: KVCacheGroup, hashes: Sequence[int], k: int) -> list[int]:
        """References on the cached pages of a ``k``-page prefix for ``g``."""
        lo = g.first_needed(k * self.page_size) // self.page_size if k else 0
        pages = g.pool.lookup(hashes[lo:k])
        assert len(pages) == k - lo, "a prefix page vanished between the lookup and taking it"
        return [g.null_page] * lo + pages if lo else pages  # type: ignore[list-item]

    def get_computed_tokens(self, seq: "Seq") -> int | None:
        """Give a waiting sequence with no pages the longest prefix already
        computed somewhere: local prefix-cache pages (shared), then pages the
        KV connector holds (loaded into fresh pages). Sets ``seq.num_computed``
        and returns it; ``None`` while a connector lookup is in flight (nothing
        is held then: ask again later). At least one token is always left to
        compute, for its logits."""
        assert self.num_pages_of(seq) == 0, "admission lookup on a sequence that holds pages"
        seq.num_computed = 0
        if not self.enable_caching or seq.params.prompt_logprobs is not None:
            return 0
        ps = self.page_size
        hashes = self._hash(seq, seq.num_tokens)
        usable = (seq.num_tokens - 1) // ps
        k = usable
        while True:  # the longest prefix every group can reuse (a shorter one may not suit a window)
            best = min(self._group_hit(g, hashes, k) for g in self.groups)
            if best == k:
                break
            k = best
        tables = [self._take_prefix(g, hashes, k) for g in self.groups]
        external = 0
        if self.connector is not None and k < usable:
            try:
                got = self.connector.lookup(seq, k, hashes[k:usable])
            except Exception:
                self._release(tables)  # under the fail policy: the scheduler ends the request
                raise
            if got is None:  # in flight: hold nothing meanwhile
                self._release(tables)
                return None
            if got:
                external = self._load_external(seq, k, got, tables)
        self._tables[seq.seq_id] = tables
        seq.num_computed = (k + external) * ps
        self._forget_behind(seq)
        if seq.num_output_tokens == 0:  # first admission, not a preempted one coming back
            n_local, n_ext = k * ps, external * ps
            self.pool.count_hits(seq.num_tokens, n_local + n_ext)
            self.local_hit_tokens += n_local
            self.external_hit_tokens += n_ext
            if seq.index == 0:
                seq.request.num_cached_tokens = n_local + n_ext
                seq.request.num_external_cached_tokens = n_ext
        return seq.num_computed

    def _load_external(self, seq: "Seq", first: int, payloads: Sequence[Any], tables: list[list[int]]) -> int:
        """Fill fresh pages with what the connector fetched (pages ``first``,
        ``first + 1``, ... of ``seq``), register them in the local prefix
        cache and append them to ``tables``; returns how many pages."""
        n = min(len(payloads), *(g.pool.num_free for g in self.groups))
        if n == 0:
            return 0
        fresh = [g.pool.allocate(n) for g in self.groups]
        self.connector.write_pages(list(zip(*fresh)), payloads[:n])  # per page of seq: its page in each group
        hashes = seq.page_hashes[first : first + n]
        new: list[int] = []
        for gi, (g, pages, table) in enumerate(zip(self.groups, fresh, tables)):
            for j, (p, h) in enumerate(zip(pages, hashes), first):
                if g.pool.register(p, h) and gi == 0:
                    new.append(j)
            table.extend(pages)
        self._report_stored(seq, new)
        self.connector.remember(hashes)
        return n

    def undo_computed(self, seq: "Seq") -> None:
        """Admission refused after ``get_computed_tokens``: give the pages back
        (full ones stay cached)."""
        self.free(seq)

    # ---- pages for a step ----------------------------------------------------------------

    def allocate_slots(self, seq: "Seq", num_new_tokens: int, *, watermark: bool = False) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq``, keeping each
        group's watermark free when asked; False (and nothing changed) when
        there is no room."""
        if not self.can_allocate(seq, num_new_tokens, watermark=watermark):
            return False
        need = self._need(seq, num_new_tokens)
        tables = self._tables.setdefault(seq.seq_id, [[] for _ in self.groups])
        if need:
            for g, table in zip(self.groups, tables):
                table.extend(g.pool.allocate(need))
        return True

    def _release(self, tables: Sequence[Sequence[int]]) -> None:
        for g, table in zip(self.groups, tables):
            g.pool.release([p for p in table if p != g.null_page])

    def free(self, seq: "Seq") -> None:
        """Release every page ``seq`` holds (finish, abort, preemption); full
        computed pages stay findable in the prefix cache. ``seq`` starts
        over from nothing computed."""
        tables = self._tables.pop(seq.seq_id, None)
        if tables:
            self._release(tables)
        seq.num_computed = 0
        if self.connector is not None:
            self.connector.forget(seq)

    def rollback(self, seq: "Seq", num_tokens: int) -> int:
        """``seq`` keeps the K/V of its first ``num_tokens`` tokens only and
        the pages they use: speculative rollback, when trailing pages held
        only rejected proposals' K/V (in the target those pages lie past what
        was committed, so they were never registered: nothing rejected is
        cached). Returns the tokens kept: 0, with every page released, when a
        window group already gave back a page the kept tokens' next query
        reads (a draft model rolling back its own committed proposals)."""
        assert num_tokens <= seq.num_computed, "rollback past what was computed"
        tables = self._tables.get(seq.seq_id)
        if tables and any(
            g.forgets and g.null_page in table[g.first_needed(num_tokens) // self.page_size :]
            for g, table in zip(self.groups, tables)
        ):
            self.free(seq)
            return 0
        seq.num_computed = num_tokens
        keep = -(-num_tokens // self.page_size)
        if tables and len(tables[0]) > keep:
            for g, table in zip(self.groups, tables):
                g.pool.release([p for p in table[keep:] if p != g.null_page])
                del table[keep:]
        return num_tokens

    def fork(self, parent: "Seq", child: "Seq") -> bool:
        """``child`` continues from ``parent``'s computed tokens: it shares the
        full pages and gets a copy of the partial last page. False (nothing
        held) when no page is free for that copy."""
        ps = self.page_size
        full, partial = divmod(parent.num_computed, ps)
        if partial and any(g.pool.num_free < 1 for g in self.groups):
            return False
        if partial and self.copy_pages is None:
            raise RuntimeError("the KV-cache manager has no copy_pages to fork with")
        tables, src_pages, dst_pages = [], [], []
        for g, src in zip(self.groups, self._tables[parent.seq_id]):
            pages = src[:full]
            g.pool.share([p for p in pages if p != g.null_page])
            if partial:
                (page,) = g.pool.allocate(1)
                src_pages.append([src[full]])
                dst_pages.append([page])
                pages = pages + [page]
            tables.append(pages)
        if partial:
            self.copy_pages(src_pages, dst_pages)  # type: ignore[misc]
        self._tables[child.seq_id] = tables  # its page hashes come when it commits (same tokens, same hashes)
        child.num_computed = parent.num_computed
        return True

    def commit(self, seq: "Seq", num_new_tokens: int) -> list[tuple[list[int], int]]:
        """The one writer of ``seq.num_computed`` after admission: the K/V of
        ``num_new_tokens`` more tokens is in its pages. Registers the pages
        that became full in the prefix cache, hands them to the connector,
        and gives back pages a forgetting group reads no more. Returns the
        new full pages as (per-group pages, hash)."""
        ps = self.page_size
        before = seq.num_computed // ps
        seq.num_computed += num_new_tokens
        after = seq.num_computed // ps
        done: list[tuple[list[int], int]] = []
        if after > before and self.enable_caching:
            hashes = self._hash(seq, after * ps)
            tables = self._tables[seq.seq_id]
            new: list[int] = []
            for j in range(before, after):
                pages = [t[j] for t in tables]
                for gi, (g, p) in enumerate(zip(self.groups, pages)):
                    if p != g.null_page and g.pool.register(p, hashes[j]) and gi == 0:
                        new.append(j)
                done.append((pages, hashes[j]))
            self._report_stored(seq, new)
            if self.connector is not None:
                self.connector.pages_computed(done)
        self._forget_behind(seq)
        return done

    def _forget_behind(self, seq: "Seq") -> None:
        """Forgetting groups give back the pages no later query reads."""
        tables = self._tables.get(seq.seq_id)
        if not tables:
            return
        for g, table in zip(self.groups, tables):
            if not g.forgets:
                continue
            stop = min(g.first_needed(seq.num_computed) // self.page_size, len(table))
            gone = [p for p in table[:stop] if p != g.null_page]
            if gone:
                g.pool.release(gone)
                table[:stop] = [g.null_page] * stop  # type: ignore[list-item]

    def _report_stored(self, seq: "Seq", indices: list[int]) -> None:
        """KV events for ``seq``'s pages ``indices`` (ascending) that entered
        the prefix cache: one ``BlockStored`` per run of consecutive pages,
        its parent the page before the run (None for the first page). The
        events follow the first group's pool (one that keeps every token):
        a router asks which prefixes an instance holds, by the one hash chain
        every group shares."""
        events = self.pool.events
        if events is None or not indices:
            return
        ps = self.page_size
        runs: list[list[int]] = []
        for j in indices:
            if runs and runs[-1][-1] == j - 1:
                runs[-1].append(j)
            else:
                runs.append([j])
        for run in runs:
            first, last = run[0], run[-1]
            parent = seq.page_hashes[first - 1] if first else None
            events.stored(seq.page_hashes[first : last + 1], parent, seq.token_ids[first * ps : (last + 1) * ps])

    def end_step(self) -> None:
        """After a step's forward: hand the pages that became full to the
        connector, publish the step's KV events."""
        if self.connector is not None:
            self.connector.end_step()
        if self.pool.events is not None:
            self.pool.events.flush()

    def close(self) -> None:
        """Stop the KV-event publisher (the engine is shutting down)."""
        if self.pool.events is not None:
            self.pool.events.close()
            self.pool.events = None

    def reset_prefix_cache(self) -> None:
        for g in self.groups:
            g.pool.reset_cache()

    def usage(self) -> float:
        return max(g.pool.usage() for g in self.groups)

    def stats(self) -> dict[str, Any]:
        extra = self.connector.stats() if self.connector is not None else {}
        out = {
            **extra,
            "num_pages": self.pool.num_pages,
            "free_pages": self.pool.num_free,
            "page_size": self.page_size,
            "kv_usage": self.usage(),
            "prefix_cache_queries": self.pool.queries,
            "prefix_cache_hits": self.pool.hits,
            "prefix_cache_hit_rate": self.pool.hit_rate(),
            "prefix_cache_local_hit_tokens": self.local_hit_tokens,
            "prefix_cache_external_hit_tokens": self.external_hit_tokens,
        }
        if len(self.groups) > 1:
            out["kv_group_pages_held"] = self.group_pages_held()
        return out
