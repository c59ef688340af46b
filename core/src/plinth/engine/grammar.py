"""What the engine needs of a structured-output grammar (one per sequence).

The server compiles grammars (``plinth.server.structured``); the engine only
masks logits, advances the matcher with each sampled token, and ends the
sequence when the grammar is complete.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LogitsMask(Protocol):
    """What the sampler needs of a grammar: its mask at the current position."""

    def mask_logits(self, logits: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids next to -inf, in place (1-D)."""
        ...


class GrammarState(LogitsMask, Protocol):

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar rejects it."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar has reached an accepting end."""
        ...

    def fork(self) -> "GrammarState":
        """An independent copy at the same position (for n > 1 samples)."""
        ...


class FixedMask:
    """A grammar's mask at one position, taken before the grammar moves on:
    speculative verification processes the rows of all positions together,
    and a rank sampling a dp group's rows gets the mask, not the grammar."""

    def __init__(self, forbidden: torch.Tensor) -> None:
        self.forbidden = forbidden  # bool [vocab]

    @classmethod
    def of(cls, grammar: LogitsMask, vocab: int, device: torch.device | str = "cpu") -> "FixedMask":
        probe = torch.zeros(vocab, device=device)
        grammar.mask_logits(probe)
        return cls(torch.isinf(probe))

    def mask_logits(self, logits: torch.Tensor) -> None:
        logits.masked_fill_(self.forbidden.to(logits.device), float("-inf"))
