"""What the engine needs of a structured-output grammar (one per sequence).

The server compiles grammars (``plinth.server.structured``); the engine only
masks logits, advances the matcher with each sampled token, and ends the
sequence when the grammar is complete.
"""

from __future__ import annotations

from typing import Protocol

import torch


class GrammarState(Protocol):
    def mask_logits(self, logits: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids next to -inf, in place (1-D)."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar rejects it."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar has reached an accepting end."""
        ...

    def fork(self) -> "GrammarState":
        """An independent copy at the same position (for n > 1 samples)."""
        ...
