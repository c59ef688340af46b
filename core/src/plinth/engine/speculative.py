"""Speculative decoding: proposals before a step, verification after it.

A proposer plugin (``--speculative-method``) suggests up to k tokens for a
decoding sequence; the step then runs the sequence's last token plus those k
(``Sequence.spec_tokens``) through the target model in one forward, and
``SpecDecoder.verify`` keeps the longest prefix the target would have
produced itself, followed by one token of the target's own (the correction at
the first rejection, or a bonus token when all k pass):

* greedy requests: a proposal passes while it equals the argmax of the fully
  processed logits (penalties, logit_bias, min_tokens bans, grammar mask), so
  the output is the output without speculation;
* sampled requests: the rejection rule of Leviathan et al. / Chen et al.
  (2023): accept x with probability min(1, p(x) / q(x)), else draw from
  normalize(max(0, p - q)). Proposals are greedy picks, a point mass q, so
  this is "accept with probability p(x), else draw from p with x removed",
  and the output distribution is exactly that of plain sampling. p is the
  distribution the sampler would draw from (temperature, top-k/p, min-p
  after every logit processor), so a proposal the grammar forbids has
  p(x) = 0 and is cut there.

Each position's processing sees the proposals before it as already
generated (penalty counts, the grammar advanced on a fork), which is what
the sequence would have seen had they been sampled one by one.

Adaptive k: a sequence whose proposals keep failing proposes fewer (see
``_SeqState.update``); the bound on the wasted work is in docs/architecture.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable
from typing import Sequence as Seq

import torch

from plinth.engine.block_manager import BlockPool
from plinth.engine.kv_cache_manager import KVCacheManager
from plinth.engine.outputs import TokenLogprobs
from plinth.engine.sampler import SampleRow, _logprob_entries, filtered_probs, process_logits, race
from plinth.engine.scheduler import ScheduledBatch
from plinth.hookspecs import ProposeItem

log = logging.getLogger("plinth.speculative")

#: most steps a sequence whose proposals all fail waits before it tries again
MAX_PAUSE = 32


@dataclass
class _SeqState:
    """Adaptive proposal length of one sequence."""

    k: int
    pause: int = 0  # steps left without proposals
    backoff: int = 1  # the next pause, doubled after each complete miss

    def update(self, accepted: int, proposed: int, k_max: int) -> None:
        if accepted == 0:
            # halve; at zero, stop for a while and then probe with one token,
            # waiting twice as long after each miss (up to MAX_PAUSE steps)
            self.k //= 2
            if self.k == 0:
                self.k, self.pause = 1, self.backoff
                self.backoff = min(2 * self.backoff, MAX_PAUSE)
        else:
            self.backoff = 1
            self.k = min(k_max, self.k + 1) if accepted == proposed else min(k_max, accepted + 1)


@dataclass
class Verified:
    """What verification of one sequence gave: the tokens to append (the
    accepted proposals, then the target's own token) with their logprobs."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    accepted: int
    proposed: int


class SpecDecoder:
    """The engine's side of speculative decoding: asks the proposer, verifies,
    adapts k per sequence and counts."""

    def __init__(self, proposer: Any, num_speculative_tokens: int, *, vocab_size: int, method: str = "") -> None:
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.k = num_speculative_tokens
        self.method = method
        self.wants_hidden = bool(getattr(proposer, "wants_hidden", False))
        self.states: dict[int, _SeqState] = {}
        #: the target's hidden state behind each sequence's newest token (wants_hidden only)
        self.hidden: dict[int, torch.Tensor] = {}
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verified = 0  # sequence-steps that carried proposals
        self.num_emitted = 0  # tokens those steps appended (accepted + the target's own)
        self.proposed_at = [0] * num_speculative_tokens  # per position: proposals scored
        self.accepted_at = [0] * num_speculative_tokens  # per position: proposals accepted

    # ---- before scheduling ------------------------------------------------------------

    def propose(self, running: Iterable[Any], live_ids: set[int], max_model_len: int) -> list[Any]:
        """Give each decoding sequence its proposals (``seq.spec_tokens``);
        drop the state of sequences no longer alive. Returns those given any."""
        for key in [k for k in self.states if k not in live_ids]:  # aborted, or ended elsewhere
            self.release(key)
        items: list[ProposeItem] = []
        seqs = []
        for seq in running:
            if seq.remaining != 1 or seq.pending_fork:
                continue  # prefilling (or recomputing after preemption): nothing to speculate on
            st = self.states.get(seq.seq_id)
            if st is None:
                st = self.states[seq.seq_id] = _SeqState(self.k)
            if st.pause:
                st.pause -= 1
                continue
            p = seq.params
            # never past max_tokens or the context: those proposals could only be wasted
            k = min(st.k, p.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens - 1)
            if k < 1:
                continue
            hidden = self.hidden.get(seq.seq_id) if self.wants_hidden else None
            items.append(ProposeItem(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, k, hidden))
            seqs.append(seq)
        if not items:
            return []
        proposals = self.proposer.propose(items)
        if len(proposals) != len(items):
            raise RuntimeError(f"proposer {self.method}: {len(proposals)} answers for {len(items)} sequences")
        given = []
        for seq, item, toks in zip(seqs, items, proposals):
            toks = [int(t) for t in list(toks)[: item.k]]
            bad = next((j for j, t in enumerate(toks) if not 0 <= t < self.vocab_size), None)
            if bad is not None:  # a token the target cannot score ends the proposal there
                toks = toks[:bad]
            if toks:
                seq.spec_tokens = toks
                given.append(seq)
        return given

    def release(self, key: int) -> None:
        """A sequence ended: the proposer drops what it keeps for it."""
        if self.states.pop(key, None) is not None:
            self.hidden.pop(key, None)
            self.proposer.free(key)

    # ---- after the forward -------------------------------------------------------------

    def verify(self, seq: Any, logits: torch.Tensor, make_row: Callable[[Any, Seq[int], Any], SampleRow]) -> Verified:
        """logits [1 + k, vocab]: the target's rows for the sequence's last
        token and its k proposals. ``make_row(seq, extra_output, grammar)``
        is the engine's SampleRow for ``seq`` as if ``extra_output`` had been
        appended, masked by ``grammar``."""
        spec = seq.spec_tokens
        k = len(spec)
        logits = logits.float()
        n_rows = k + 1
        if seq.grammar is not None:
            # the grammar's state moves with each proposal: one row at a time,
            # on a fork, up to the first proposal it refuses (p(x) = 0 there)
            g = seq.grammar.fork()
            rows, parts = [], []
            for i in range(n_rows):
                row = make_row(seq, spec[:i], g)
                parts.append(process_logits(logits[i : i + 1], [row]))
                rows.append(row)
                if i == k or not g.accept(spec[i]):
                    break
            processed = torch.cat(parts)
            n_rows = len(rows)
            # the mask is already applied; the rows must not touch the fork again
            rows = [SampleRow(r.params, r.prompt_ids, r.output_ids, r.generator, None, r.banned) for r in rows]
        else:
            rows = [make_row(seq, spec[:i], None) for i in range(n_rows)]
            processed = process_logits(logits, rows)

        params = seq.params
        out: list[int] = []
        if params.greedy:
            target = processed.argmax(dim=-1).tolist()
            a = 0
            while a < min(k, n_rows) and spec[a] == target[a]:
                a += 1
            # a < n_rows: the target's own token follows (the correction, or the
            # bonus after all k); otherwise the grammar refused what came last
            out = spec[:a] + ([target[a]] if a < n_rows else [])
        else:
            probs = filtered_probs(processed, rows, list(range(n_rows)))
            probs = probs / probs.sum(dim=-1, keepdim=True)
            g = seq.generator
            a = 0
            while a < n_rows:
                if a == k:  # every proposal passed: the bonus token, drawn from p
                    out.append(int(race(probs[a : a + 1], rows, [a])[0]))
                    break
                x = spec[a]
                u = float(torch.rand(1, generator=g)) if g is not None else float(torch.rand(1))
                if u < float(probs[a, x]):
                    out.append(x)
                    a += 1
                    if a == n_rows:  # the grammar refused the next proposal: a correction follows next step
                        break
                    continue
                residual = probs[a : a + 1].clone()
                residual[0, x] = 0.0  # normalize(max(0, p - q)) for a point mass q at x
                out.append(int(race(residual, rows, [a])[0]))
                break
        accepted = min(a, k)
        lps: list[TokenLogprobs | None] = [None] * len(out)
        if params.logprobs is not None and out:
            raw = torch.log_softmax(logits[: len(out)], dim=-1)
            lps = list(_logprob_entries(raw, torch.tensor(out, dtype=torch.long), params.logprobs))
        self._count(seq, accepted, k)
        return Verified(out, lps, accepted, k)

    def _count(self, seq: Any, accepted: int, proposed: int) -> None:
        self.num_verified += 1
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.num_emitted += accepted + 1
        for i in range(proposed):
            self.proposed_at[i] += 1
            if i < accepted:
                self.accepted_at[i] += 1
        st = self.states.get(seq.seq_id)
        if st is not None:
            st.update(accepted, proposed, self.k)

    def stats(self) -> dict[str, Any]:
        return {
            "spec_method": self.method,
            "spec_num_speculative_tokens": self.k,
            "spec_proposed_tokens": self.num_proposed,
            "spec_accepted_tokens": self.num_accepted,
            "spec_rejected_tokens": self.num_proposed - self.num_accepted,
            "spec_verified_steps": self.num_verified,
            "spec_acceptance_rate": self.num_accepted / self.num_proposed if self.num_proposed else 0.0,
            # tokens a verified step appends per target forward (1 = no gain)
            "spec_mean_accepted_length": self.num_emitted / self.num_verified if self.num_verified else 0.0,
            "spec_acceptance_rate_per_position": [
                a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)
            ],
        }


# ---- a draft model run by the core for a proposer ------------------------------------------


class _DraftSeq:
    """What the KV-cache manager and model runner read of a sequence."""

    __slots__ = ("seq_id", "token_ids", "num_computed", "page_hashes", "spec_tokens")

    def __init__(self, key: int) -> None:
        self.seq_id = key
        self.token_ids: list[int] = []
        self.num_computed = 0
        self.page_hashes: list[int] = []
        self.spec_tokens: list[int] = []


class DraftModelRunner:
    """A smaller model with its own page pool, KV-cache manager and model
    runner (``plinth.api.DraftRunner``); start-up builds it with the same
    code that builds the target."""

    def __init__(self, runner: Any, num_pages: int, page_size: int, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        # no prefix cache: a draft page is cheap to recompute, and rollback
        # must never leave a registered page holding another branch's K/V
        self.kv = KVCacheManager(BlockPool(num_pages, page_size, enable_caching=False), copy_pages=runner.copy_pages)
        self.seqs: dict[int, _DraftSeq] = {}

    def forward(self, items: Seq[tuple[int, Seq[int]]]) -> list[torch.Tensor | None]:
        batch = ScheduledBatch()
        slots: list[int] = []  # index into items of each batch entry
        for idx, (key, tokens) in enumerate(items):
            ds = self.seqs.get(key)
            if ds is None:
                ds = self.seqs[key] = _DraftSeq(key)
            tokens = list(tokens)
            keep = min(ds.num_computed, len(tokens) - 1)  # at least the last token runs, for its logits
            if ds.token_ids[:keep] != tokens[:keep]:
                keep = next(i for i, (x, y) in enumerate(zip(ds.token_ids, tokens)) if x != y)
            ds.num_computed = keep
            self.kv.truncate(ds, keep)  # rejected proposals' K/V: their trailing pages go back
            ds.token_ids = tokens
            n = len(tokens) - keep
            if not self.kv.allocate_slots(ds, n):
                self.free(key)  # no room: this sequence gets no draft this step
                continue
            batch.seqs.append(ds)
            batch.num_tokens.append(n)
            slots.append(idx)
        out: list[torch.Tensor | None] = [None] * len(items)
        if not batch.seqs:
            return out
        batch.block_tables = [self.kv.block_table(s) for s in batch.seqs]
        rows, offset = [], 0
        for n in batch.num_tokens:
            offset += n
            rows.append(offset - 1)
        logits = self.runner.execute(batch, rows)
        for ds, n, idx, row in zip(batch.seqs, batch.num_tokens, slots, logits):
            ds.num_computed += n
            out[idx] = row
        return out

    def free(self, key: int) -> None:
        ds = self.seqs.pop(key, None)
        if ds is not None:
            self.kv.free(ds)
