"""Sampling: penalties, grammar mask, temperature, top-k / top-p / min-p,
per-request seeds, and logprobs of the raw distribution.

Every processor works on the whole batch as tensors on the logits' device;
Python loops only gather each row's parameters (token ids, biases, seeds)
into tensors. What crosses to the host is the sampled ids and the requested
logprobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch

from plinth.engine.grammar import LogitsMask
from plinth.engine.outputs import Logprob, TokenLogprobs
from plinth.engine.sampling_params import SamplingParams

#: bins of top-p's log-probability histogram: 2048 over 12 decades, so
#: top-p sorts only the tokens within a factor ~1.04 of its cut
TOP_P_BINS = 2048


@dataclass
class SampleRow:
    """What the sampler needs of one row of logits."""

    params: SamplingParams
    prompt_ids: Seq[int]
    output_ids: Seq[int]
    generator: torch.Generator | None
    #: the grammar (its mask at this position)
    grammar: LogitsMask | None = None
    #: token ids that must not end the sequence yet (min_tokens)
    banned: Seq[int] = ()


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def uniforms(generators: Seq[torch.Generator | None], device: torch.device | str = "cpu") -> torch.Tensor:
    """One float64 uniform per row: a seeded row from its own generator (so
    its draws never depend on its batch neighbours), the rest in one call."""
    n = len(generators)
    u = torch.empty(n, dtype=torch.float64)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = torch.rand(1, dtype=torch.float64, generator=g)[0]
    return u.to(device)


def _padded_ids(lists: list[Seq[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Token id lists as one [rows, longest] tensor; padding and ids outside
    the vocabulary point at column ``vocab`` (a scratch column)."""
    width = max(1, max(len(x) for x in lists))
    out = torch.full((len(lists), width), vocab, dtype=torch.long)
    for r, ids in enumerate(lists):
        if len(ids):
            out[r, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    return out.clamp_(0, vocab).to(device)


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow], idx: list[int]) -> None:
    """Repetition (over prompt and output), frequency and presence (over the
    output) penalties of rows idx, in place, as [rows, vocab] tensors."""
    vocab, dev = logits.shape[-1], logits.device
    rep = [i for i in idx if rows[i].params.repetition_penalty != 1.0]
    if rep:
        ids = _padded_ids([[*rows[i].prompt_ids, *rows[i].output_ids] for i in rep], vocab, dev)
        seen = torch.zeros(len(rep), vocab + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)[:, :vocab]
        r = torch.tensor([rows[i].params.repetition_penalty for i in rep], dtype=logits.dtype, device=dev).unsqueeze(1)
        at = torch.tensor(rep, device=dev)
        sub = logits[at]
        logits[at] = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    fp = [i for i in idx if rows[i].output_ids and (rows[i].params.frequency_penalty or rows[i].params.presence_penalty)]
    if fp:
        ids = _padded_ids([rows[i].output_ids for i in fp], vocab, dev)
        counts = torch.zeros(len(fp), vocab + 1, dtype=logits.dtype, device=dev)
        counts = counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))[:, :vocab]
        f = torch.tensor([rows[i].params.frequency_penalty for i in fp], dtype=logits.dtype, device=dev).unsqueeze(1)
        p = torch.tensor([rows[i].params.presence_penalty for i in fp], dtype=logits.dtype, device=dev).unsqueeze(1)
        at = torch.tensor(fp, device=dev)
        logits[at] -= f * counts + p * (counts > 0).to(logits.dtype)


def _scatter_rows(logits: torch.Tensor, entries: list[tuple[int, int, float]], accumulate: bool) -> None:
    """logits[row, token] += value (or = value), for (row, token, value) entries."""
    r, t, v = zip(*entries)
    dev = logits.device
    index = (torch.tensor(r, device=dev), torch.tensor(t, device=dev))
    logits.index_put_(index, torch.tensor(v, dtype=logits.dtype, device=dev), accumulate=accumulate)


def _top_k_mask(sub: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Rows with top_k > 0 keep the logits at least their k-th largest (ties
    at the k-th all stay); the others are left whole."""
    vocab = sub.shape[-1]
    limited = [j for j, k in enumerate(top_ks) if 0 < k < vocab]
    if not limited:
        return sub
    at = torch.tensor(limited, device=sub.device)
    part = sub[at]
    ks = torch.tensor([top_ks[j] for j in limited], device=sub.device)
    kth = part.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
    sub[at] = part.masked_fill(part < kth, float("-inf"))
    return sub


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the least probability top-p keeps: a token stays when the
    mass of the tokens before it in descending order is <= top_p (the
    smallest set of the most likely tokens whose mass reaches top_p). Ties
    at the cut all stay, so no sort order of equal values matters.

    No row is sorted whole: a histogram of log-probabilities weighted by
    probability (TOP_P_BINS bins over 12 decades below the row's largest)
    finds the bin where the mass from the top first exceeds top_p. Tokens
    in bins above it stay, those below go; only the tokens of that bin (and
    its neighbours, against rounding) are sorted, their prefix sums starting
    from the mass of the bins above."""
    n = probs.shape[0]
    logp = probs.log()
    scale = TOP_P_BINS / (12 * math.log(10))
    # bin 0 holds the largest; TOP_P_BINS everything below 1e-12 of it (and zeros)
    bins = ((logp.amax(dim=-1, keepdim=True) - logp) * scale).clamp_(max=TOP_P_BINS).long()
    hist = torch.zeros(n, TOP_P_BINS + 1, dtype=probs.dtype, device=probs.device).scatter_add_(1, bins, probs)
    through = hist.cumsum(-1)  # through[j]: mass of bins 0..j
    cut = torch.searchsorted(through, top_p, right=True).clamp_(max=TOP_P_BINS)  # first bin past top_p
    first = (cut - 1).clamp_(min=0)
    above = torch.where(first > 0, through.gather(1, (first - 1).clamp(min=0)), torch.zeros_like(top_p))
    band = (bins >= first) & (bins <= cut + 1)
    width = int(band.sum(-1).max())
    # the band's tokens packed to the left of each row (the others all land in a scratch column)
    at = torch.where(band, band.cumsum(-1) - 1, width)
    packed = torch.zeros(n, width + 1, dtype=probs.dtype, device=probs.device).scatter_(1, at, probs)
    sorted_p = packed[:, :width].sort(dim=-1, descending=True).values
    keep = (above + sorted_p.cumsum(-1) - sorted_p) <= top_p
    return torch.where(keep, sorted_p, torch.full_like(sorted_p, float("inf"))).amin(dim=-1, keepdim=True)


def filtered_probs(logits: torch.Tensor, rows: list[SampleRow], idx: list[int]) -> torch.Tensor:
    """The sampling distribution of rows idx of processed logits:
    temperature, then top-k, top-p and min-p (what a random draw samples from)."""
    dev = logits.device
    sub = logits[torch.tensor(idx, device=dev)]
    temps = torch.tensor([rows[i].params.temperature for i in idx], dtype=sub.dtype, device=dev).unsqueeze(1)
    sub = _top_k_mask(sub / temps, [rows[i].params.top_k for i in idx])
    probs = torch.softmax(sub, dim=-1)
    top_ps = [rows[i].params.top_p for i in idx]
    cut = [j for j, p in enumerate(top_ps) if p < 1.0]
    if cut:
        at = torch.tensor(cut, device=dev)
        part = probs[at]
        tp = torch.tensor([top_ps[j] for j in cut], dtype=probs.dtype, device=dev).unsqueeze(1)
        probs[at] = part.masked_fill(part < _top_p_threshold(part, tp), 0.0)
    min_ps = [rows[i].params.min_p for i in idx]
    if any(m > 0 for m in min_ps):
        mp = torch.tensor(min_ps, dtype=probs.dtype, device=dev).unsqueeze(1)
        probs = probs.masked_fill(probs < mp * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


#: first_argmax's chunk: rows are searched by chunks of this many tokens
ARGMAX_CHUNK = 1024


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor, the same indices (the first of a
    row's largest values; a NaN counts as the largest, as in argmax).

    Why: torch's CPU argmax carries an index per lane through a whole
    vocabulary row, 1.1 ms for 16 rows of 49k float32 on 2 cores (Intel
    Xeon with AMX), a twentieth of a decode step; the chunks' maxima (amax,
    a plain vectorized reduction), the argmax of those few, then the argmax
    inside each row's winning chunk take 0.17 ms."""
    n, vocab = x.shape
    chunks = vocab // ARGMAX_CHUNK
    if chunks < 2:
        return x.argmax(dim=-1)
    main = x[:, : chunks * ARGMAX_CHUNK].reshape(n, chunks, ARGMAX_CHUNK)
    best = main.amax(dim=-1).argmax(dim=-1)  # the first chunk holding the row's max (or its first NaN)
    rows = torch.arange(n, device=x.device)
    idx = best * ARGMAX_CHUNK + main[rows, best].argmax(dim=-1)
    if chunks * ARGMAX_CHUNK < vocab:  # the tail wins where it holds a larger value, or the first NaN
        tail = x[:, chunks * ARGMAX_CHUNK :].argmax(dim=-1) + chunks * ARGMAX_CHUNK
        a, b = x[rows, idx], x[rows, tail]
        idx = torch.where((b > a) | (b.isnan() & ~a.isnan()), tail, idx)
    return idx


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of probs (unnormalized is fine), row j by the
    float64 uniform u[j] (``uniforms``: each seeded row from its own generator)."""
    # inverse CDF: one uniform per row against prefix sums accumulated in
    # float64 (exact enough for the tail of a 150k vocabulary). An exponential
    # race (argmax p / E) needs a noise value per token: 1.1 ms a row of 49k
    # on one thread, 20x this.
    cdf = probs.cumsum(-1, dtype=torch.float64)
    # right=True: cdf[t - 1] <= target < cdf[t], so a zero-probability token is never drawn
    target = (u.to(probs.device) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def logprob_entries(logprobs: torch.Tensor, token_ids: torch.Tensor, ks: Seq[int]) -> list[TokenLogprobs]:
    """Row r: the chosen token's logprob and rank, and the top ks[r]
    alternatives. One transfer to the host for the whole batch."""
    token_ids = token_ids.to(logprobs.device)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    k = max(ks, default=0)
    top_v, top_i = logprobs.topk(k, dim=-1) if k > 0 else (chosen[:, :0], token_ids[:, None][:, :0])
    ids, lp, rk, tv, ti = (x.tolist() for x in (token_ids, chosen.squeeze(1), ranks, top_v, top_i))
    return [
        TokenLogprobs(ids[r], lp[r], [Logprob(t, v, rank=j + 1) for j, (t, v) in enumerate(zip(ti[r][: ks[r]], tv[r][: ks[r]]))], rank=rk[r])
        for r in range(len(ids))
    ]


def process_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Penalties, logit_bias, min_tokens bans and grammar masks applied (a
    copy when anything applies): what greedy takes the argmax of and what
    temperature and the filters work on."""
    n = len(rows)
    vocab = logits.shape[-1]
    pen = [i for i in range(n) if rows[i].params.needs_penalties]
    gram = [i for i in range(n) if rows[i].grammar is not None]
    # before the grammar: a bias never lets through what it forbids
    bias = [(i, t, float(b)) for i in range(n) if rows[i].params.logit_bias for t, b in rows[i].params.logit_bias.items() if 0 <= t < vocab]
    ban = [(i, t, float("-inf")) for i in range(n) for t in rows[i].banned if 0 <= t < vocab]
    raw = logits
    if pen or gram or ban or bias:
        logits = logits.clone()
    if pen:
        _apply_penalties(logits, rows, pen)
    if bias:
        _scatter_rows(logits, bias, accumulate=True)
    if ban:
        _scatter_rows(logits, ban, accumulate=False)
    for i in gram:  # the grammar's own mask, in place on the row view
        rows[i].grammar.mask_logits(logits[i])
    if ban or gram:
        # a row with nothing left: the grammar beats min_tokens; with no
        # grammar-allowed token at all, fall back to the model's own choice
        dead = (~torch.isfinite(logits).any(dim=-1)).nonzero().flatten().tolist()
        for i in dead:
            logits[i] = raw[i]
            if rows[i].grammar is not None:
                rows[i].grammar.mask_logits(logits[i])
            if not torch.isfinite(logits[i]).any():
                logits[i] = raw[i]
    return logits


def random_rows(rows: Seq[SampleRow]) -> list[int]:
    """The rows that draw (not greedy): each takes one uniform."""
    return [i for i, r in enumerate(rows) if not r.params.greedy]


class Sampler:
    """Turns one step's logits [rows, vocab] into tokens, on their device."""

    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRow], u: torch.Tensor | None = None
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``u``: the uniforms of ``random_rows(rows)``, drawn already (a
        dp group's rank samples with the ones rank 0 drew from the
        requests' generators); None: drawn here."""
        logits = logits.float()
        n = len(rows)
        want_lp = [i for i in range(n) if rows[i].params.logprobs is not None]
        lp_at = torch.tensor(want_lp, device=logits.device)
        raw_logprobs = torch.log_softmax(logits[lp_at], dim=-1) if want_lp else None

        logits = process_logits(logits, rows)
        tokens = first_argmax(logits)
        rand = random_rows(rows)
        if rand:
            at = torch.tensor(rand, device=logits.device)
            if u is None:
                u = uniforms([rows[i].generator for i in rand], logits.device)
            tokens[at] = draw(filtered_probs(logits, rows, rand), u)

        logprobs: list[TokenLogprobs | None] = [None] * n
        if raw_logprobs is not None:
            entries = logprob_entries(raw_logprobs, tokens[lp_at], [rows[i].params.logprobs or 0 for i in want_lp])
            for i, e in zip(want_lp, entries):
                logprobs[i] = e
        return tokens.tolist(), logprobs


@dataclass
class SampleJob:
    """What one step takes from its logits rows: the rows to sample (forks
    expanded: ``at[j]`` is row j's logits row) and the prompt logprobs to
    score (first logits row, the next prompt ids, top k). A rank that holds
    the logits runs it (``run``) and sends back only the result."""

    rows: list[SampleRow]
    at: list[int]
    prompt: list[tuple[int, list[int], int]] = field(default_factory=list)
    #: the uniforms of ``random_rows(rows)`` when drawn before (rank 0 for a dp group's rank)
    u: torch.Tensor | None = None

    def run(self, logits: torch.Tensor, sampler: "Sampler") -> "SampleResult":
        prompt = [prompt_logprobs(logits[first : first + len(nxt)], nxt, k) for first, nxt, k in self.prompt]
        if not self.rows:
            return SampleResult([], [], prompt)
        picked = logits if self.at == list(range(logits.shape[0])) else logits[torch.tensor(self.at, device=logits.device)]
        tokens, logprobs = sampler(picked, self.rows, self.u)
        return SampleResult(tokens, logprobs, prompt)


@dataclass
class SampleResult:
    """A SampleJob's answer: what crosses from the logits' device (and rank) to the host."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[list[TokenLogprobs]]


def prompt_logprobs(logits: torch.Tensor, next_ids: Seq[int], k: int) -> list[TokenLogprobs]:
    """Logprobs of each prompt token given the ones before it."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return logprob_entries(lp, torch.tensor(list(next_ids), dtype=torch.long), [k] * len(next_ids))
