"""Sampling: penalties, grammar mask, temperature, top-k / top-p / min-p,
per-request seeds, and logprobs of the raw distribution."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from plinth.engine.outputs import Logprob, TokenLogprobs
from plinth.engine.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """What the sampler needs of one row of logits."""

    params: SamplingParams
    prompt_ids: Seq[int]
    output_ids: Seq[int]
    generator: torch.Generator | None
    grammar: object | None = None
    #: token ids that must not end the sequence yet (min_tokens)
    banned: Seq[int] = ()


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow], idx: list[int]) -> None:
    vocab = logits.shape[-1]
    for i in idx:
        p = rows[i].params
        out = torch.tensor([t for t in rows[i].output_ids if t < vocab], dtype=torch.long)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in (*rows[i].prompt_ids, *rows[i].output_ids) if t < vocab}), dtype=torch.long)
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out.numel() and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(out, minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _apply_grammar(logits: torch.Tensor, rows: list[SampleRow], idx: list[int]) -> None:
    for i in idx:
        rows[i].grammar.mask_logits(logits[i])  # in place, on the row view


def filtered_probs(logits: torch.Tensor, rows: list[SampleRow], idx: list[int]) -> torch.Tensor:
    """The sampling distribution of rows idx of processed logits:
    temperature, then top-k, top-p and min-p (what a random draw samples from)."""
    sub = logits[idx]
    temps = torch.tensor([rows[i].params.temperature for i in idx], dtype=sub.dtype).unsqueeze(1)
    sub = sub / temps
    top_ks = [rows[i].params.top_k for i in idx]
    vocab = sub.shape[-1]
    if any(k > 0 for k in top_ks):
        k_max = min(max(k if k > 0 else vocab for k in top_ks), vocab)
        if k_max < vocab:
            kth = torch.topk(sub, k_max, dim=-1).values
            ks = torch.tensor([min(k, vocab) if k > 0 else k_max for k in top_ks]) - 1
            thresh = kth.gather(1, ks.unsqueeze(1))
            unlimited = torch.tensor([k <= 0 for k in top_ks]).unsqueeze(1)
            sub = torch.where((sub < thresh) & ~unlimited, torch.full_like(sub, float("-inf")), sub)
    probs = torch.softmax(sub, dim=-1)
    top_ps = [rows[i].params.top_p for i in idx]
    if any(p < 1.0 for p in top_ps):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        tp = torch.tensor(top_ps, dtype=probs.dtype).unsqueeze(1)
        drop_sorted = (cum - sorted_p) > tp  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    min_ps = [rows[i].params.min_p for i in idx]
    if any(m > 0 for m in min_ps):
        mp = torch.tensor(min_ps, dtype=probs.dtype).unsqueeze(1)
        probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def draw(probs: torch.Tensor, rows: list[SampleRow], idx: list[int]) -> torch.Tensor:
    """One draw per row of probs (unnormalized is fine), row j for rows[idx[j]]."""
    # inverse CDF: one uniform per row against prefix sums accumulated in
    # float64 (exact enough for the tail of a 150k vocabulary). An exponential
    # race (argmax p / E) needs a noise value per token: 1.1 ms a row of 49k
    # on one thread, 20x this. Per-row generators keep a seeded request
    # independent of its batch neighbours.
    n = probs.shape[0]
    u = torch.empty(n, dtype=torch.float64)
    unseeded = [j for j, i in enumerate(idx) if rows[i].generator is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for j, i in enumerate(idx):
        g = rows[i].generator
        if g is not None:
            u[j] = torch.rand(1, dtype=torch.float64, generator=g)[0]
    cdf = probs.cumsum(-1, dtype=torch.float64)
    # right=True: cdf[t - 1] <= target < cdf[t], so a zero-probability token is never drawn
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _filter_and_sample(logits: torch.Tensor, rows: list[SampleRow], idx: list[int]) -> torch.Tensor:
    """Random sampling for rows idx; returns their token ids."""
    return draw(filtered_probs(logits, rows, idx), rows, idx)


def _logprob_entries(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """The chosen tokens' logprobs, ranks, and top-k alternatives."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    top_v, top_i = (logprobs.topk(k, dim=-1) if k > 0 else (None, None))
    out = []
    for r in range(logprobs.shape[0]):
        top = []
        if k > 0:
            top = [Logprob(int(t), float(v), rank=j + 1) for j, (t, v) in enumerate(zip(top_i[r].tolist(), top_v[r].tolist()))]
        out.append(TokenLogprobs(int(token_ids[r]), float(chosen[r]), top, rank=int(ranks[r])))
    return out


def process_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Penalties, logit_bias, min_tokens bans and grammar masks applied (a
    copy when anything applies): what greedy takes the argmax of and what
    temperature and the filters work on."""
    n = len(rows)
    pen = [i for i in range(n) if rows[i].params.needs_penalties]
    gram = [i for i in range(n) if rows[i].grammar is not None]
    banned = [i for i in range(n) if rows[i].banned]
    biased = [i for i in range(n) if rows[i].params.logit_bias]
    raw = logits
    if pen or gram or banned or biased:
        logits = logits.clone()
    if pen:
        _apply_penalties(logits, rows, pen)
    for i in biased:  # before the grammar: a bias never lets through what it forbids
        bias = rows[i].params.logit_bias
        ids = [t for t in bias if t < logits.shape[-1]]
        logits[i, ids] += torch.tensor([bias[t] for t in ids], dtype=logits.dtype)
    for i in banned:
        logits[i, [t for t in rows[i].banned if t < logits.shape[-1]]] = float("-inf")
    if gram:
        _apply_grammar(logits, rows, gram)
    if banned or gram:
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


class Sampler:
    """Turns one step's logits [rows, vocab] (float32) into tokens."""

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
        logits = logits.float()
        n = len(rows)
        want_lp = [i for i in range(n) if rows[i].params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None

        logits = process_logits(logits, rows)
        tokens = logits.argmax(dim=-1)
        rand = [i for i in range(n) if not rows[i].params.greedy]
        if rand:
            tokens[rand] = _filter_and_sample(logits, rows, rand)
        token_list = tokens.tolist()

        logprobs: list[TokenLogprobs | None] = [None] * n
        if want_lp:
            k = max(rows[i].params.logprobs or 0 for i in want_lp)
            entries = _logprob_entries(raw_logprobs, tokens[want_lp], k)
            for i, e in zip(want_lp, entries):
                e.top = e.top[: rows[i].params.logprobs]
                logprobs[i] = e
        return token_list, logprobs


def prompt_logprobs(logits: torch.Tensor, next_ids: Seq[int], k: int) -> list[TokenLogprobs]:
    """Logprobs of each prompt token given the ones before it."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return _logprob_entries(lp, torch.tensor(list(next_ids), dtype=torch.long), k)
