"""Continuous batching with chunked prefill and preemption by recompute.

Every step has a token budget. Running sequences go first, decodes (one
token each) before prefill chunks, oldest first; then waiting sequences are
admitted in arrival order while the budget, ``max_num_seqs`` and free pages
allow. A prompt longer than what is left of the budget runs in chunks over
several steps. When a running sequence needs a page and none is free, the
newest running sequence that has not been scheduled this step is preempted:
its pages are released (full ones stay in the prefix cache) and it waits at
the front of the queue to be recomputed, which gives the same tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from plinth.engine.block_manager import BlockPool, hash_pages
from plinth.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    #: sequences that can never fit in the pool, finished with "length"
    evicted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        hash_seed: int = 0,
        external_lookup: Callable[[Sequence], int] | None = None,
    ) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.hash_seed = hash_seed
        #: a KV connector's lookup, tried after the local prefix cache
        self.external_lookup = external_lookup
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # pages kept free when admitting, so running sequences can grow
        self.watermark = max(1, pool.num_pages // 100)
        self.num_preemptions = 0

    # ---- queue -----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sequence, already holding its pages."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: Any = None) -> None:
        """End a sequence and release its pages."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        self.pool.release(seq.pages)
        seq.pages = []

    # ---- pages -------------------------------------------------------------

    def _pages_needed(self, seq: Sequence, n: int) -> int:
        return max(0, -(-(seq.num_computed + n) // self.page_size) - len(seq.pages))

    def _tokens_fitting(self, seq: Sequence, free_pages: int) -> int:
        """How many more tokens fit in the pages it holds plus free_pages."""
        return (len(seq.pages) + free_pages) * self.page_size - seq.num_computed

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq.pages)
        seq.pages = []
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _lookup_prefix(self, seq: Sequence) -> None:
        """Reuse cached pages for the longest known prefix of the sequence."""
        if not self.pool.enable_caching or seq.params.prompt_logprobs is not None:
            return
        ps = self.page_size
        seq.page_hashes = hash_pages(seq.token_ids, ps, seed=self.hash_seed, start=seq.page_hashes)
        # at least one token must run through the model to give logits
        usable = (seq.num_tokens - 1) // ps
        pages = self.pool.lookup(seq.page_hashes[:usable])
        seq.pages = pages
        seq.num_computed = len(pages) * ps
        if self.external_lookup is not None and len(pages) < usable:
            seq.num_computed += self.external_lookup(seq)
        first_admission = seq.num_output_tokens == 0
        if first_admission:
            self.pool.count_hits(seq.num_tokens, seq.num_computed)
            if seq.index == 0:
                seq.request.num_cached_tokens = seq.num_computed

    def _undo_lookup(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        seq.pages = []
        seq.num_computed = 0

    def _capacity_exceeded(self, seq: Sequence, n: int) -> bool:
        return -(-(seq.num_computed + n) // self.page_size) > self.pool.num_pages

    # ---- one step ------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()

        order = [s for s in self.running if s.remaining == 1] + [s for s in self.running if s.remaining > 1]
        for seq in order:
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.remaining, budget)
            if self._capacity_exceeded(seq, 1):
                self.finish(seq, "length")
                batch.evicted.append(seq)
                continue
            while self._pages_needed(seq, n) > self.pool.num_free:
                fit = self._tokens_fitting(seq, self.pool.num_free)
                if fit >= 1 and n > 1:  # a prefill chunk shrinks to what fits
                    n = min(n, fit)
                    continue
                victim = next(
                    (v for v in reversed(self.running) if v is not seq and v.seq_id not in scheduled), None
                )
                if victim is None:
                    break
                self._preempt(victim)
                batch.preempted.append(victim)
            need = self._pages_needed(seq, n)
            if need > self.pool.num_free:
                self._preempt(seq)
                batch.preempted.append(seq)
                continue
            seq.pages.extend(self.pool.allocate(need))
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            scheduled.add(seq.seq_id)
            budget -= n

        # admit new work only when nothing had to be preempted (no thrashing)
        while not batch.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.pages:
                self._lookup_prefix(seq)
            n = min(seq.remaining, budget)
            free = self.pool.num_free - (self.watermark if self.running else 0)
            if self._pages_needed(seq, n) > free:
                if self.running or self._tokens_fitting(seq, max(free, 0)) < 1:
                    self._undo_lookup(seq)
                    if not self.running and self._capacity_exceeded(seq, 1):
                        self.waiting.popleft()
                        self.finish(seq, "length")
                        batch.evicted.append(seq)
                        continue
                    break
                n = self._tokens_fitting(seq, free)  # alone: take a chunk that fits
            self.waiting.popleft()
            seq.pages.extend(self.pool.allocate(self._pages_needed(seq, n)))
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        return batch

    def mark_computed(self, batch: ScheduledBatch) -> None:
        """After the forward: the scheduled tokens' K/V are in their pages;
        full pages become findable in the prefix cache."""
        ps = self.page_size
        for seq, n in zip(batch.seqs, batch.num_tokens):
            before = seq.num_computed // ps
            seq.num_computed += n
            after = seq.num_computed // ps
            if after > before and self.pool.enable_caching:
                if len(seq.page_hashes) < after:
                    seq.page_hashes = hash_pages(
                        seq.token_ids[: after * ps], ps, seed=self.hash_seed, start=seq.page_hashes
                    )
                for j in range(before, after):
                    self.pool.register(seq.pages[j], seq.page_hashes[j])
