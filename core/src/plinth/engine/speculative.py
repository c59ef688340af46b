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

Adaptive k: ``StepCostModel.plan`` decides, for the whole step, which
proposal positions are scored: those that raise expected tokens per second
given the measured cost of a step by tokens scored (one curve for every
batch size) and each sequence's acceptance, shrunk towards the recent
all-sequence rate (so a new sequence is judged by how proposals are
faring now). What a sequence offers is ``_SeqState``'s: k, a one-token
probe after a step whose proposals all failed, then pauses of 1, 2, 4 ...
32 steps between probes while they keep failing. The bound on a
hostile workload is in docs/architecture.md.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable
from typing import Sequence as Seq

import torch

from plinth.api import ProposeItem
from plinth.engine.grammar import FixedMask
from plinth.engine.kv_cache_manager import KVCacheManager
from plinth.engine.outputs import TokenLogprobs
from plinth.engine.sampler import (
    SampleRow,
    draw,
    filtered_probs,
    first_argmax,
    logprob_entries,
    process_logits,
    uniforms,
)
from plinth.engine.sampling_params import SamplingParams
from plinth.engine.scheduler import ScheduledBatch
from plinth.engine.sequence import Request, Sequence

log = logging.getLogger("plinth.speculative")

#: most steps a sequence whose proposals all fail waits before it tries again
MAX_PAUSE = 32
#: how fast a sequence's acceptance estimate forgets (per verified step)
ACCEPTANCE_DECAY = 0.75
#: weight, in positions, of the all-sequence acceptance in a sequence's estimate
ACCEPTANCE_PRIOR = 2.0
#: how fast the all-sequence acceptance forgets (per judged position): a
#: sampled batch after a greedy one must not inherit the greedy rate for long
PRIOR_DECAY = 0.9


@dataclass
class _SeqState:
    """One sequence's record: its acceptance and its back-off."""

    misses: int = 0  # steps in a row whose proposals all failed
    pause: int = 0  # steps left without proposals
    # decayed counts of proposal positions that passed / were judged (a
    # position is judged when every one before it passed)
    passed: float = 0.0
    judged: float = 0.0

    def acceptance(self, prior: float) -> float:
        """Probability that a proposal position passes given the ones before
        it did, shrunk towards ``prior`` while this sequence has little data."""
        return (self.passed + ACCEPTANCE_PRIOR * prior) / (self.judged + ACCEPTANCE_PRIOR)

    def offer(self, k_max: int) -> int:
        """Proposals to ask for this step: k_max, or a one-token probe after a
        miss (0 while paused)."""
        if self.pause:
            self.pause -= 1
            return 0
        return 1 if self.misses else k_max

    def update(self, accepted: int, proposed: int) -> None:
        self.passed = ACCEPTANCE_DECAY * self.passed + accepted
        self.judged = ACCEPTANCE_DECAY * self.judged + accepted + (accepted < proposed)
        if accepted:
            self.misses = 0
        else:
            # the first miss: probe with one token; then wait 1, 2, 4, ... up
            # to MAX_PAUSE steps between one-token probes
            self.misses += 1
            if self.misses > 1:
                self.pause = min(2 ** (self.misses - 2), MAX_PAUSE)


#: step times kept per number of tokens scored
COST_SAMPLES = 16
#: share of the decode steps' time that measuring may spend on proposals the
#: plan would not keep
EXPLORE_SHARE = 0.01
#: a size with fewer samples is measured whatever the budget (once is not
#: enough on a shared machine: one slow step would keep it off the plan)
MIN_SAMPLES = 3
#: per decode step, how much of the time and measuring counted so far is kept
#: (a horizon of ~100 steps: a long friendly run builds up no credit that a
#: hostile one could then spend at once)
EXPLORE_DECAY = 0.99


class StepCostModel:
    """What a decode step costs, measured on this machine while the engine
    runs, and which proposals that makes worth scoring.

    One curve for every batch size: a decode step's time is taken to depend
    on the tokens its forward scores, T = sequences + proposals (the GEMMs
    see T rows either way; attention and sampling are per row too). So
    plain steps of 5 sequences tell what 1 sequence with 4 proposals costs,
    and batch sizes that come and go as requests do all feed one curve
    instead of each waiting for its own measurements. t(T) is the fastest
    of the recent decode-only steps of T tokens (the lowest, not the
    median: on a shared machine contention only ever adds time); between
    measured sizes it is interpolated, beyond the largest extrapolated
    along the chord (never falling) from the largest measured size at most
    half as big (else the smallest; with one size measured, in proportion
    to T: the compute-bound guess, which keeps nothing). It is not forced
    to rise with T: a kernel that changes path at some row count can make
    more rows cheaper (SmolLM2's Q4_1 decode on one core: 46 ms for 8 rows,
    36 ms for 12), and a plan that believed otherwise would take positions
    past the kink for free. Nothing is assumed about the hardware: a weight-bound step
    measures a flat curve, a compute-bound one a steep one, a kernel that
    changes path at some row count a kink.

    Decision: position j of a sequence whose positions pass with probability
    a each passes with probability a^j (it needs all before it), and adds
    that many expected tokens. The step keeps the proposal positions, most
    likely first, that maximise expected tokens per second,
    (B + sum of kept a^j) / t(B + kept).

    Measuring: where the plan leaves positions out, a step may score one
    more (the likeliest left out) while what that position costs by the
    curve stays under EXPLORE_SHARE (1%) of the decode steps' time, both
    counted over the last ~100 steps (EXPLORE_DECAY). The curve's estimate,
    not the step's measured time: on a shared machine the measured time
    carries others' work, and a few slow steps must not stop measuring for
    long. A size with fewer than MIN_SAMPLES (3) samples is measured
    whatever the budget (a constant over the engine's life). That learns
    sizes above the curve, and the acceptance of sequences the plan would
    not try: without it a workload that turned friendly after a hostile
    phase would never be tried again. So where speculation never pays,
    measuring costs about 1% of the time. Steps that keep proposals
    measure their own size as they go."""

    def __init__(self, explore_share: float = EXPLORE_SHARE) -> None:
        self.samples: dict[int, deque] = {}  # tokens scored -> recent step seconds
        self.explore_share = explore_share
        self.total = 0.0  # seconds of decode-only steps observed (decayed)
        self.explored = 0.0  # seconds of positions scored only to measure (decayed)
        self._curve: list[tuple[int, float]] | None = None

    def observe(self, num_seqs: int, num_proposed: int, seconds: float) -> None:
        """A decode-only step of num_seqs sequences scored num_proposed proposals."""
        self.samples.setdefault(num_seqs + num_proposed, deque(maxlen=COST_SAMPLES)).append(seconds)
        self.total = EXPLORE_DECAY * self.total + seconds
        self.explored *= EXPLORE_DECAY
        self._curve = None

    def curve(self) -> list[tuple[int, float]]:
        """(tokens, seconds) of the measured sizes."""
        if self._curve is None:
            self._curve = [(n, min(self.samples[n])) for n in sorted(self.samples)]
        return self._curve

    def estimate(self, tokens: int) -> float | None:
        """t(tokens): seconds of a decode step scoring that many tokens, or
        None below the smallest size measured."""
        pts = self.curve()
        if not pts or tokens < pts[0][0]:
            return None
        return self._interpolate(pts, tokens)

    @staticmethod
    def _interpolate(pts: list[tuple[int, float]], tokens: int) -> float:
        """t(tokens) on the measured curve (tokens at least its smallest size)."""
        hi = bisect.bisect_left(pts, (tokens, 0.0))
        if hi < len(pts):
            n1, t1 = pts[hi]
            if n1 == tokens:
                return t1
            n0, t0 = pts[hi - 1]
            return t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)
        n1, t1 = pts[-1]
        if len(pts) == 1:
            return t1 * tokens / n1
        # the chord from the largest size at most half as big (else the smallest): one noisy neighbour does not set the slope
        n0, t0 = next((p for p in reversed(pts) if 2 * p[0] <= n1), pts[0])
        return t1 + max(0.0, t1 - t0) * (tokens - n1) / (n1 - n0)

    def plan(self, num_seqs: int, offers: Seq[tuple[float, int]]) -> list[int]:
        """offers: per sequence with proposals, (chance a position passes,
        proposals offered). Returns how many of each to score."""
        base = self.estimate(num_seqs)
        if base is None or base <= 0:
            return [0] * len(offers)  # a plain step measures this size first
        pts = self.curve()

        def cost(tokens: int) -> float:  # sizes from num_seqs up: on the curve
            return self._interpolate(pts, tokens)

        # every position of every offer, most likely to pass first
        positions = sorted(
            ((a**j, i) for i, (a, n) in enumerate(offers) for j in range(1, n + 1)), key=lambda p: -p[0]
        )
        best, best_rate, expected = 0, num_seqs / base, float(num_seqs)
        for kept, (p, _) in enumerate(positions, 1):
            expected += p
            rate = expected / cost(num_seqs + kept)
            if rate > best_rate:
                best, best_rate = kept, rate
        if best < len(positions) and (
            len(self.samples.get(num_seqs + best + 1, ())) < MIN_SAMPLES
            or self.explored < self.explore_share * self.total
        ):
            self.explored += cost(num_seqs + best + 1) - cost(num_seqs + best)
            best += 1  # measure (see the class docstring)
        keep = [0] * len(offers)
        for _, i in positions[:best]:
            keep[i] += 1
        return keep


@dataclass
class Verified:
    """What verification of one sequence gave: the tokens to append (the
    accepted proposals, then the target's own token) with their logprobs."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    accepted: int
    proposed: int


def _uniforms(generator: torch.Generator | None, n: int) -> torch.Tensor:
    """n acceptance uniforms of one sequence (its own generator when seeded)."""
    return torch.rand(n, dtype=torch.float64, generator=generator)


# ---- verification's steps (SpecDecoder.verify) ---------------------------------------------


def _verify_rows(
    items: Seq[tuple[Any, int]], vocab: int, dev: torch.device, make_row: Callable[[Any, Seq[int], Any], SampleRow]
) -> tuple[list[SampleRow], list[int], list[int], list[int]]:
    """The rows to process: per sequence, one per position (its last token,
    then each proposal), up to the first proposal its grammar refuses.
    Returns the rows, the logits row of each, each sequence's first row and
    its number of rows."""
    rows: list[SampleRow] = []
    at: list[int] = []
    starts: list[int] = []
    n_rows: list[int] = []
    for seq, first in items:
        spec = seq.spec_tokens
        k = len(spec)
        starts.append(len(rows))
        if seq.grammar is not None:
            # the grammar's state moves with each proposal: its mask per
            # position, on a fork, up to the first proposal it refuses (p(x) = 0 there)
            g = seq.grammar.fork()
            for i in range(k + 1):
                rows.append(make_row(seq, spec[:i], FixedMask.of(g, vocab, dev)))
                at.append(first + i)
                if i == k or not g.accept(spec[i]):
                    break
        else:
            rows.extend(make_row(seq, spec[:i], None) for i in range(k + 1))
            at.extend(range(first, first + k + 1))
        n_rows.append(len(rows) - starts[-1])
    return rows, at, starts, n_rows


def _accept(
    items: Seq[tuple[Any, int]], processed: torch.Tensor, targets: torch.Tensor, rows: list[SampleRow], starts: list[int], n_rows: list[int]
) -> tuple[list[int], torch.Tensor | None]:
    """How many proposals each sequence keeps: greedy ones while the
    proposal is the processed argmax, sampled ones with probability p(x)
    (the proposal is a point mass q). Returns those counts and, with any
    sampled sequence, the rows' filtered distributions (normalized).
    ``targets``: the argmax of each processed row."""
    dev = processed.device
    # the proposals judged per sequence (a grammar may refuse one early), padded to one width
    width = max(min(len(seq.spec_tokens), n) for (seq, _), n in zip(items, n_rows))
    spec_t = torch.zeros(len(items), max(width, 1), dtype=torch.long)
    judged = torch.zeros(len(items), max(width, 1), dtype=torch.bool)
    for j, ((seq, _), n) in enumerate(zip(items, n_rows)):
        m = min(len(seq.spec_tokens), n)
        spec_t[j, :m] = torch.tensor(seq.spec_tokens[:m], dtype=torch.long)
        judged[j, :m] = True
    spec_t, judged = spec_t.to(dev), judged.to(dev)
    pos = torch.tensor(starts, device=dev).unsqueeze(1) + torch.arange(spec_t.shape[1], device=dev)
    pos = torch.where(judged, pos, 0)

    greedy = torch.tensor([seq.params.greedy for seq, _ in items], device=dev).unsqueeze(1)
    passed = targets[pos] == spec_t  # greedy: the proposal is the processed argmax
    rand = [j for j, (seq, _) in enumerate(items) if not seq.params.greedy]
    probs = None
    if rand:
        rand_rows = [r for j in rand for r in range(starts[j], starts[j] + n_rows[j])]
        probs = torch.zeros(len(rows), processed.shape[-1], dtype=torch.float32, device=dev)
        filtered = filtered_probs(processed, rows, rand_rows)
        probs[torch.tensor(rand_rows, device=dev)] = filtered / filtered.sum(dim=-1, keepdim=True)
        u = torch.ones(spec_t.shape, dtype=torch.float64)
        for j in rand:  # as many as it judges: its stream must not depend on the batch
            m = min(len(items[j][0].spec_tokens), n_rows[j])
            u[j, :m] = _uniforms(items[j][0].generator, m)
        passed = torch.where(greedy, passed, u.to(dev) < probs[pos, spec_t])
    return (passed & judged).long().cumprod(dim=1).sum(dim=1).tolist(), probs


def _target_tokens(
    items: Seq[tuple[Any, int]], targets: list[int], probs: torch.Tensor | None, accepted: list[int], starts: list[int], n_rows: list[int]
) -> list[list[int]]:
    """Each sequence's tokens: the accepted proposals, then the target's
    own token: the correction at the first rejection, or the bonus after
    all k; none when the grammar refused what came last. A sampled
    correction draws from normalize(max(0, p - q)), q the rejected point mass."""
    out: list[list[int]] = []
    draws: list[tuple[int, int, int | None]] = []  # (sequence, row, proposal to remove)
    for j, (seq, _) in enumerate(items):
        a, spec = accepted[j], seq.spec_tokens
        out.append(spec[:a])
        if a == n_rows[j]:
            continue
        if seq.params.greedy:
            out[j].append(targets[starts[j] + a])
        else:
            draws.append((j, starts[j] + a, spec[a] if a < len(spec) else None))
    if draws:
        assert probs is not None  # a sampled sequence: _accept filtered its rows
        dev = probs.device
        final = probs[torch.tensor([r for _, r, _ in draws], device=dev)]
        removed = [(i, x) for i, (_, _, x) in enumerate(draws) if x is not None]
        if removed:
            ri, rx = zip(*removed)
            final[torch.tensor(ri, device=dev), torch.tensor(rx, device=dev)] = 0.0
        tokens = draw(final, uniforms([items[j][0].generator for j, _, _ in draws], dev)).tolist()
        for (j, _, _), t in zip(draws, tokens):
            out[j].append(t)
    return out


def _verified_logprobs(items: Seq[tuple[Any, int]], logits: torch.Tensor, out: list[list[int]]) -> list[list[TokenLogprobs | None]]:
    """The logprobs of each appended token, for sequences that asked, from the raw rows."""
    lp_of = [j for j, (seq, _) in enumerate(items) if seq.params.logprobs is not None and out[j]]
    lps: list[list[TokenLogprobs | None]] = [[None] * len(o) for o in out]
    if lp_of:
        lp_rows = [items[j][1] + i for j in lp_of for i in range(len(out[j]))]
        raw = torch.log_softmax(logits[torch.tensor(lp_rows, device=logits.device)], dim=-1)
        ids = torch.tensor([t for j in lp_of for t in out[j]], dtype=torch.long)
        entries = iter(logprob_entries(raw, ids, [items[j][0].params.logprobs for j in lp_of for _ in out[j]]))
        for j in lp_of:
            lps[j] = [next(entries) for _ in out[j]]
    return lps


class SpecDecoder:
    """The engine's side of speculative decoding: asks the proposer, verifies,
    adapts k per sequence and counts."""

    def __init__(
        self,
        proposer: Any,
        num_speculative_tokens: int,
        *,
        vocab_size: int,
        method: str = "",
        cost_model: StepCostModel | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.proposer = proposer
        #: batch-aware trimming of proposals (None: each sequence's adaptive k alone)
        self.cost_model = cost_model
        self.clock = clock
        self._step_start = 0.0
        self.num_decoding = 0  # decoding sequences at the last propose()
        self.num_trimmed = 0  # proposals the cost model did not score
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
        self.num_judged = 0  # proposal positions judged (accepted + first rejections)
        self._recent_passed = self._recent_judged = 0.0  # the same, decayed (acceptance())
        self.proposed_at = [0] * num_speculative_tokens  # per position: proposals scored
        self.accepted_at = [0] * num_speculative_tokens  # per position: proposals accepted

    # ---- before scheduling ------------------------------------------------------------

    def propose(self, running: Iterable[Any], live_ids: set[int], max_model_len: int) -> list[Any]:
        """Give each decoding sequence its proposals (``seq.spec_tokens``);
        drop the state of sequences no longer alive. Returns those given any."""
        for key in [k for k in self.states if k not in live_ids]:  # aborted, or ended elsewhere
            self.release(key)
        self._step_start = self.clock()
        items: list[ProposeItem] = []
        seqs = []
        decoding = 0
        for seq in running:
            if seq.remaining != 1 or seq.pending_fork:
                continue  # prefilling (or recomputing after preemption): nothing to speculate on
            decoding += 1
            st = self.states.get(seq.seq_id)
            if st is None:
                st = self.states[seq.seq_id] = _SeqState()
            p = seq.params
            # never past max_tokens or the context: those proposals could only be wasted
            k = min(st.offer(self.k), p.limit - seq.num_output_tokens - 1, max_model_len - seq.num_tokens - 1)
            if k < 1:
                continue
            hidden = self.hidden.get(seq.seq_id) if self.wants_hidden else None
            items.append(ProposeItem(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, k, hidden))
            seqs.append(seq)
        self.num_decoding = decoding
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
        if given and self.cost_model is not None:
            prior = self.acceptance()
            keep = self.cost_model.plan(decoding, [(self.states[s.seq_id].acceptance(prior), len(s.spec_tokens)) for s in given])
            for seq, n in zip(given, keep):
                self.num_trimmed += len(seq.spec_tokens) - n
                seq.spec_tokens = seq.spec_tokens[:n]
            given = [s for s in given if s.spec_tokens]
        return given

    def acceptance(self) -> float:
        """All sequences' recent chance that a judged proposal position
        passes (counts decayed per position; one pass and one failure
        assumed before any data)."""
        return (self._recent_passed + 1) / (self._recent_judged + 2)

    @staticmethod
    def decode_shape(batch: ScheduledBatch) -> tuple[int, int] | None:
        """(sequences, proposals scored) of a decode-only batch, taken before
        its forward; None when a prefill chunk is in it (another cost)."""
        proposed = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if n != 1 + len(seq.spec_tokens):
                return None
            proposed += n - 1
        return len(batch.seqs), proposed

    def step_done(self, shape: tuple[int, int] | None) -> None:
        """After a step's forward and sampling: a decode-only step's time,
        from propose() on, feeds the cost model."""
        if self.cost_model is not None and shape is not None and shape[0] == self.num_decoding:
            self.cost_model.observe(shape[0], shape[1], self.clock() - self._step_start)

    def release(self, key: int) -> None:
        """A sequence ended: the proposer drops what it keeps for it."""
        if self.states.pop(key, None) is not None:
            self.hidden.pop(key, None)
            self.proposer.free(key)

    # ---- after the forward -------------------------------------------------------------

    def verify(self, items: Seq[tuple[Any, int]], logits: torch.Tensor, make_row: Callable[[Any, Seq[int], Any], SampleRow]) -> list[Verified]:
        """Every sequence of the step at once. items: (sequence, first row):
        logits[first : first + 1 + k] are the target's rows for its last
        token and its k proposals. ``make_row(seq, extra_output, grammar)``
        is the engine's SampleRow for ``seq`` as if ``extra_output`` had
        been appended, masked by ``grammar``.

        One pass of the sampler's processors over all rows, one gather of
        the proposals' probabilities, one batched draw of the tokens the
        target adds; acceptance is a cumulative product over positions."""
        logits = logits.float()
        rows, at, starts, n_rows = _verify_rows(items, logits.shape[-1], logits.device, make_row)
        processed = process_logits(logits[torch.tensor(at, device=logits.device)], rows)
        targets = first_argmax(processed)
        accepted, probs = _accept(items, processed, targets, rows, starts, n_rows)
        out = _target_tokens(items, targets.tolist(), probs, accepted, starts, n_rows)
        lps = _verified_logprobs(items, logits, out)
        verified = []
        for j, (seq, _) in enumerate(items):
            k = len(seq.spec_tokens)
            a = min(accepted[j], k)
            self._count(seq, a, k)
            verified.append(Verified(out[j], lps[j], a, k))
        return verified

    def _count(self, seq: Any, accepted: int, proposed: int) -> None:
        self.num_verified += 1
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.num_emitted += accepted + 1
        judged = accepted + (accepted < proposed)
        self.num_judged += judged
        forget = PRIOR_DECAY**judged
        self._recent_passed = forget * self._recent_passed + accepted
        self._recent_judged = forget * self._recent_judged + judged
        for i in range(proposed):
            self.proposed_at[i] += 1
            if i < accepted:
                self.accepted_at[i] += 1
        st = self.states.get(seq.seq_id)
        if st is not None:
            st.update(accepted, proposed)

    def stats(self) -> dict[str, Any]:
        return {
            "spec_method": self.method,
            "spec_num_speculative_tokens": self.k,
            "spec_proposed_tokens": self.num_proposed,
            "spec_accepted_tokens": self.num_accepted,
            "spec_rejected_tokens": self.num_proposed - self.num_accepted,
            "spec_verified_steps": self.num_verified,
            # proposals the step cost model left unscored (batch too compute-bound for them)
            "spec_trimmed_tokens": self.num_trimmed,
            "spec_acceptance_rate": self.num_accepted / self.num_proposed if self.num_proposed else 0.0,
            # tokens a verified step appends per target forward (1 = no gain)
            "spec_mean_accepted_length": self.num_emitted / self.num_verified if self.num_verified else 0.0,
            "spec_acceptance_rate_per_position": [
                a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)
            ],
        }


# ---- a draft model run by the core for a proposer ------------------------------------------


class DraftModelRunner:
    """A smaller model with its own page pool, KV-cache manager and model
    runner (``plinth.api.DraftRunner``); start-up builds it with the same
    code that builds the target."""

    def __init__(self, runner: Any, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        # its runner's pools have no prefix cache: a draft page is cheap to recompute,
        # and rollback must never leave a registered page holding another branch's K/V
        self.kv = KVCacheManager(runner.kv_groups, copy_pages=runner.copy_pages)
        self.seqs: dict[int, Sequence] = {}  # by the target sequence's id

    def forward(self, items: Seq[tuple[int, Seq[int]]]) -> list[torch.Tensor | None]:
        batch = ScheduledBatch()
        slots: list[int] = []  # index into items of each batch entry
        for idx, (key, tokens) in enumerate(items):
            ds = self.seqs.get(key)
            if ds is None:
                # the draft's own sequence: pages and computed tokens, nothing sampled from it
                ds = self.seqs[key] = Sequence(Request(f"draft-{key}", None, [], SamplingParams(max_tokens=1)), 0, [])
            tokens = list(tokens)
            keep = min(ds.num_computed, len(tokens) - 1)  # at least the last token runs, for its logits
            if ds.token_ids[:keep] != tokens[:keep]:
                keep = next(i for i, (x, y) in enumerate(zip(ds.token_ids, tokens)) if x != y)
            keep = self.kv.rollback(ds, keep)  # rejected proposals' K/V: their trailing pages go back
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
            self.kv.commit(ds, n)
            out[idx] = row
        return out

    def free(self, key: int) -> None:
        ds = self.seqs.pop(key, None)
        if ds is not None:
            self.kv.free(ds)
