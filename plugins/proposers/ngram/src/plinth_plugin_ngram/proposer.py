"""Prompt lookup (Saxena 2023, vLLM's ``ngram`` method): the last n tokens
of a sequence are looked up earlier in the same sequence (prompt and
output), longest n first, most recent occurrence first; what followed that
occurrence is proposed. Repetitive work (rewriting, summarising, editing
code, quoting the prompt) is full of such copies."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from plinth.api import ProposeItem, Proposer, SelectionContext

DEFAULT_MIN_N = 2  # a single token matches by chance too often to be worth a guess
DEFAULT_MAX_N = 4


def _options(ctx: SelectionContext) -> tuple[Any, Any]:
    opts = ctx.options or {}
    lo = opts.get("ngram_min_n")
    hi = opts.get("ngram_max_n")
    return (DEFAULT_MIN_N if lo is None else lo), (DEFAULT_MAX_N if hi is None else hi)


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens following the most recent earlier occurrence of the
    longest suffix of ``tokens`` (n in [min_n, max_n]) found earlier in it."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        # windows starting at 0 .. size - n - 1: every occurrence but the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            # copy on from there; a match close to the end keeps copying what it
            # just proposed, which continues a repeating pattern
            seq = tokens.tolist()
            out: list[int] = []
            for j in range(k):
                i = start + j
                out.append(int(seq[i]) if i < size else out[i - size])
            return out
    return []


class NgramIndex:
    """One sequence's n-grams (n in [min_n, max_n]), each mapped to where its
    most recent occurrence starts, grown as the sequence grows: a step's
    lookup is a few dict probes, not a scan of the sequence (propose_ngram
    gives the same answers; it is the definition, this is the fast path)."""

    __slots__ = ("tokens", "min_n", "max_n", "starts", "indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.tokens: list[int] = []
        self.min_n, self.max_n = min_n, max_n
        self.starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # n-grams ending before this index are in ``starts``

    def follows(self, token_ids: Sequence[int]) -> bool:
        """Whether token_ids extends what was indexed (else rebuild)."""
        n = len(self.tokens)
        return n <= len(token_ids) and (n == 0 or self.tokens[-1] == token_ids[n - 1])

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        toks = self.tokens
        toks.extend(token_ids[len(toks) :])
        size = len(toks)
        # index every n-gram that ends before the last token (the suffix
        # itself must not match itself); later occurrences overwrite earlier
        for end in range(self.indexed, size - 1):
            for n, table in self.starts.items():
                if end + 1 >= n:
                    table[tuple(toks[end + 1 - n : end + 1])] = end + 1 - n
        self.indexed = max(self.indexed, size - 1)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            hit = self.starts[n].get(tuple(toks[size - n :]))
            if hit is not None:
                start = hit + n
                out: list[int] = []
                for j in range(k):
                    i = start + j
                    out.append(toks[i] if i < size else out[i - size])
                return out
        return []


class NgramProposer(Proposer):
    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        lo, hi = _options(ctx)
        reasons = []
        if not isinstance(lo, int) or lo < 1:
            reasons.append(f"--ngram-min-n must be an integer >= 1, got {lo!r}")
        if not isinstance(hi, int) or (isinstance(lo, int) and hi < lo):
            reasons.append(f"--ngram-max-n must be an integer >= --ngram-min-n ({lo!r}), got {hi!r}")
        return reasons

    def __init__(self, ctx: SelectionContext) -> None:
        super().__init__(ctx)
        self.min_n, self.max_n = _options(ctx)
        self._indexes: dict[int, NgramIndex] = {}

    def _index(self, item: ProposeItem) -> NgramIndex:
        idx = self._indexes.get(item.key)
        if idx is None or not idx.follows(item.token_ids):  # new, or not a continuation (rolled back)
            idx = self._indexes[item.key] = NgramIndex(self.min_n, self.max_n)
        return idx

    def propose(self, items: Sequence[ProposeItem]) -> list[list[int]]:
        return [self._index(it).propose(it.token_ids, it.k) for it in items]

    def free(self, key: int) -> None:
        self._indexes.pop(key, None)
