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
from typing import Any

from plinth.engine.kv_cache_manager import KVCacheManager
from plinth.engine.kv_transfer import KVTransferError
from plinth.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    #: each scheduled sequence's pages in each KV-cache group, in order (from the KV-cache manager)
    block_tables: list[list[list[int]]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    #: sequences that can never fit in the pool, finished with "length"
    evicted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    """Decides which sequences run how many tokens each step. It never
    touches pages itself: it asks the KV-cache manager."""

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue -----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sequence, already holding its pages."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

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
        self.kv.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)  # it recomputes from nothing (or from the prefix cache)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- one step ------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        # admit new work only when nothing had to be preempted (no thrashing)
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        batch.block_tables = [self.kv.block_table(s) for s in batch.seqs]
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        """Running sequences first (decodes, then prefill chunks), preempting
        the latest ones for pages; returns the token budget left."""
        kv = self.kv
        scheduled: set[int] = set()
        order = [s for s in self.running if s.remaining == 1] + [s for s in self.running if s.remaining > 1]
        for seq in order:
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.remaining + len(seq.spec_tokens), budget)  # a decode scores its proposals too
            if kv.exceeds_capacity(seq, 1):
                self.finish(seq, "length")
                batch.evicted.append(seq)
                continue
            while not kv.can_allocate(seq, n):
                fit = kv.tokens_fitting(seq)
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
            if not kv.allocate_slots(seq, n):
                self._preempt(seq)
                batch.preempted.append(seq)
                continue
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            scheduled.add(seq.seq_id)
            budget -= n
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """Waiting sequences in order while the budget, max_num_seqs and the
        pool allow (after their prefix-cache and KV-connector lookups)."""
        kv = self.kv
        deferred: list[Sequence] = []  # KV-connector lookups still in flight
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if kv.num_pages_of(seq) == 0:
                try:
                    computed = kv.get_computed_tokens(seq)
                except KVTransferError as exc:  # the fail policy: the request ends with the error
                    self.waiting.popleft()
                    seq.request.error = str(exc)
                    self.finish(seq, "error")
                    batch.evicted.append(seq)
                    continue
                if computed is None:
                    deferred.append(self.waiting.popleft())  # a KV-connector lookup in flight: ask again next step
                    continue
            n = min(seq.remaining, budget)
            watermark = bool(self.running)  # pages kept free when admitting, so running sequences can grow
            if not kv.allocate_slots(seq, n, watermark=watermark):
                if self.running or kv.tokens_fitting(seq, watermark=watermark) < 1:
                    kv.undo_computed(seq)
                    if not self.running and kv.exceeds_capacity(seq, 1):
                        self.waiting.popleft()
                        self.finish(seq, "length")
                        batch.evicted.append(seq)
                        continue
                    break
                n = kv.tokens_fitting(seq, watermark=watermark)  # alone: take a chunk that fits
                kv.allocate_slots(seq, n, watermark=watermark)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))

    def mark_computed(self, batch: ScheduledBatch) -> None:
        """After the forward: the scheduled tokens' K/V are in their pages;
        full pages become findable in the prefix cache."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            self.kv.commit(seq, n)
        self.kv.end_step()
