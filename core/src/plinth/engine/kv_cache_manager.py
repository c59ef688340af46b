"""The one owner of KV pages.

Every page a sequence holds is handed out, shared, copied, cached and freed
here; the scheduler, the n>1 fork, preemption, the prefix cache and the KV
connector all go through this class, the way vLLM's ``KVCacheManager``
(``get_computed_blocks`` / ``allocate_slots`` / ``free``) hides blocks from
its scheduler. Nobody else edits a sequence's page list: the scheduler asks
"can this sequence run n more tokens?" and reads the block tables it puts in
the step's batch.

Admission (``get_computed_tokens``) takes the longest cached prefix: first
the local prefix cache, then, for the pages after it, the KV connector (when
one is configured). A connector lookup runs off the step loop; while it is in
flight the answer is ``None`` ("ask again later") and the scheduler moves on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

from plinth.engine.block_manager import BlockPool, hash_pages

if TYPE_CHECKING:
    from plinth.engine.sequence import Sequence as Seq

log = logging.getLogger("plinth.kv")


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        *,
        hash_seed: int = 0,
        copy_pages: Callable[[Sequence[int], Sequence[int]], None] | None = None,
    ) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.hash_seed = hash_seed
        #: worker side: copy whole pages src[i] -> dst[i] (the model runner's)
        self.copy_pages = copy_pages
        #: the KV connector's engine side (``plinth.engine.kv_transfer.KVTransfer``), or None
        self.connector: Any = None
        self._pages: dict[int, list[int]] = {}  # seq_id -> pages, in order
        # admission statistics, in tokens
        self.local_hit_tokens = 0
        self.external_hit_tokens = 0

    # ---- what the scheduler may ask ------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def block_table(self, seq: "Seq") -> list[int]:
        """The pages of ``seq`` in order (a copy: read only)."""
        return list(self._pages.get(seq.seq_id, ()))

    def num_pages_of(self, seq: "Seq") -> int:
        return len(self._pages.get(seq.seq_id, ()))

    def pages_needed(self, seq: "Seq", num_new_tokens: int) -> int:
        """New pages ``seq`` needs to run ``num_new_tokens`` more tokens."""
        return max(0, -(-(seq.num_computed + num_new_tokens) // self.page_size) - self.num_pages_of(seq))

    def tokens_fitting(self, seq: "Seq", free_pages: int) -> int:
        """How many more tokens fit in the pages it holds plus ``free_pages``."""
        return (self.num_pages_of(seq) + free_pages) * self.page_size - seq.num_computed

    def exceeds_capacity(self, seq: "Seq", num_new_tokens: int) -> bool:
        """Whether ``seq`` would need more pages than the whole pool."""
        return -(-(seq.num_computed + num_new_tokens) // self.page_size) > self.pool.num_pages

    def pages_held(self) -> int:
        """Pages referenced by anyone (0 when idle: nothing leaked)."""
        return sum(1 for r in self.pool.ref_count if r > 0)

    # ---- admission: the computed prefix ------------------------------------------------

    def get_computed_tokens(self, seq: "Seq") -> int | None:
        """Give a waiting sequence with no pages the longest prefix already
        computed somewhere: local prefix-cache pages (shared), then pages the
        KV connector holds (loaded into fresh pages). Sets ``seq.num_computed``
        and returns it; ``None`` while a connector lookup is in flight (nothing
        is held then: ask again later). At least one token is always left to
        compute, for its logits."""
        assert self.num_pages_of(seq) == 0, "admission lookup on a sequence that holds pages"
        seq.num_computed = 0
        if not self.pool.enable_caching or seq.params.prompt_logprobs is not None:
            return 0
        ps = self.page_size
        seq.page_hashes = hash_pages(seq.token_ids, ps, seed=self.hash_seed, start=seq.page_hashes)
        usable = (seq.num_tokens - 1) // ps
        local = self.pool.lookup(seq.page_hashes[:usable])
        external: list[int] = []
        if self.connector is not None and len(local) < usable:
            try:
                got = self.connector.lookup(seq, len(local), seq.page_hashes[len(local) : usable])
            except Exception:
                self.pool.release(local)  # under the fail policy: the scheduler ends the request
                raise
            if got is None:  # in flight: hold nothing meanwhile
                self.pool.release(local)
                return None
            if got:
                external = self._load_external(seq, len(local), got)
        pages = local + external
        self._pages[seq.seq_id] = pages
        seq.num_computed = len(pages) * ps
        if seq.num_output_tokens == 0:  # first admission, not a preempted one coming back
            n_local, n_ext = len(local) * ps, len(external) * ps
            self.pool.count_hits(seq.num_tokens, n_local + n_ext)
            self.local_hit_tokens += n_local
            self.external_hit_tokens += n_ext
            if seq.index == 0:
                seq.request.num_cached_tokens = n_local + n_ext
                seq.request.num_external_cached_tokens = n_ext
        return seq.num_computed

    def _load_external(self, seq: "Seq", first: int, payloads: Sequence[Any]) -> list[int]:
        """Fresh pages filled with what the connector fetched (pages ``first``,
        ``first + 1``, ... of ``seq``), registered in the local prefix cache."""
        n = min(len(payloads), self.pool.num_free)
        if n == 0:
            return []
        pages = self.pool.allocate(n)
        self.connector.write_pages(pages, payloads[:n])
        hashes = seq.page_hashes[first : first + n]
        new = [j for j, (p, h) in enumerate(zip(pages, hashes), first) if self.pool.register(p, h)]
        self._report_stored(seq, new)
        self.connector.remember(hashes)
        return pages

    def undo_computed(self, seq: "Seq") -> None:
        """Admission refused after ``get_computed_tokens``: give the pages back
        (full ones stay cached)."""
        self.free(seq)
        seq.num_computed = 0

    # ---- pages for a step ----------------------------------------------------------------

    def allocate_slots(self, seq: "Seq", num_new_tokens: int, *, reserve: int = 0) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq``, keeping
        ``reserve`` pages free; False (and nothing changed) when there is no room."""
        need = self.pages_needed(seq, num_new_tokens)
        if need > self.pool.num_free - reserve:
            return False
        if need:
            self._pages.setdefault(seq.seq_id, []).extend(self.pool.allocate(need))
        else:
            self._pages.setdefault(seq.seq_id, [])
        return True

    def free(self, seq: "Seq") -> None:
        """Release every page ``seq`` holds (finish, abort, preemption); full
        computed pages stay findable in the prefix cache."""
        pages = self._pages.pop(seq.seq_id, None)
        if pages:
            self.pool.release(pages)
        if self.connector is not None:
            self.connector.forget(seq)

    def truncate(self, seq: "Seq", num_tokens: int) -> None:
        """Keep only the pages ``seq``'s first ``num_tokens`` tokens use and
        release the rest: speculative rollback, when trailing pages held only
        rejected proposals' K/V. Those pages lie past ``seq.num_computed``, so
        ``cache_computed`` never registered them: nothing rejected is cached."""
        pages = self._pages.get(seq.seq_id)
        keep = -(-num_tokens // self.page_size)
        if pages and len(pages) > keep:
            self.pool.release(pages[keep:])
            del pages[keep:]

    def fork(self, parent: "Seq", child: "Seq") -> bool:
        """``child`` continues from ``parent``'s computed tokens: it shares the
        full pages and gets a copy of the partial last page. False (nothing
        held) when no page is free for that copy."""
        ps = self.page_size
        full, partial = divmod(parent.num_computed, ps)
        if partial and self.pool.num_free < 1:
            return False
        src = self._pages[parent.seq_id]
        pages = src[:full]
        self.pool.share(pages)
        if partial:
            (page,) = self.pool.allocate(1)
            if self.copy_pages is None:
                raise RuntimeError("the KV-cache manager has no copy_pages to fork with")
            self.copy_pages([src[full]], [page])
            pages = pages + [page]
        self._pages[child.seq_id] = pages
        child.page_hashes = list(parent.page_hashes)
        child.num_computed = parent.num_computed
        return True

    def cache_computed(self, seq: "Seq", num_computed: int) -> list[tuple[int, int]]:
        """``seq``'s tokens up to ``num_computed`` now have their K/V in its
        pages: register the pages that became full in the prefix cache.
        Returns those (page, hash) pairs."""
        ps = self.page_size
        before, after = seq.num_computed // ps, num_computed // ps
        if after <= before or not self.pool.enable_caching:
            return []
        if len(seq.page_hashes) < after:
            seq.page_hashes = hash_pages(seq.token_ids[: after * ps], ps, seed=self.hash_seed, start=seq.page_hashes)
        pages = self._pages[seq.seq_id]
        done = []
        new = []
        for j in range(before, after):
            if self.pool.register(pages[j], seq.page_hashes[j]):
                new.append(j)
            done.append((pages[j], seq.page_hashes[j]))
        self._report_stored(seq, new)
        if self.connector is not None:
            self.connector.pages_computed(done)
        return done

    def _report_stored(self, seq: "Seq", indices: list[int]) -> None:
        """KV events for ``seq``'s pages ``indices`` (ascending) that entered
        the prefix cache: one ``BlockStored`` per run of consecutive pages,
        its parent the page before the run (None for the first page)."""
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
        self.pool.reset_cache()

    def usage(self) -> float:
        return self.pool.usage()

    def stats(self) -> dict[str, Any]:
        extra = self.connector.stats() if self.connector is not None else {}
        return {
            **extra,
            "num_pages": self.pool.num_pages,
            "free_pages": self.pool.num_free,
            "page_size": self.page_size,
            "kv_usage": self.pool.usage(),
            "prefix_cache_queries": self.pool.queries,
            "prefix_cache_hits": self.pool.hits,
            "prefix_cache_hit_rate": self.pool.hit_rate(),
            "prefix_cache_local_hit_tokens": self.local_hit_tokens,
            "prefix_cache_external_hit_tokens": self.external_hit_tokens,
        }
