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
        # token ids per sequence as an array, grown as the sequence grows
        self._arrays: dict[int, np.ndarray] = {}

    def _array(self, item: ProposeItem) -> np.ndarray:
        arr = self._arrays.get(item.key)
        size = len(item.token_ids)
        if arr is None or len(arr) > size or (len(arr) and arr[-1] != item.token_ids[len(arr) - 1]):
            arr = np.asarray(item.token_ids, dtype=np.int64)
        elif len(arr) < size:
            arr = np.concatenate([arr, np.asarray(item.token_ids[len(arr) :], dtype=np.int64)])
        self._arrays[item.key] = arr
        return arr

    def propose(self, items: Sequence[ProposeItem]) -> list[list[int]]:
        return [propose_ngram(self._array(it), it.k, self.min_n, self.max_n) for it in items]

    def free(self, key: int) -> None:
        self._arrays.pop(key, None)
