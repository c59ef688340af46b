"""Incremental detokenization and stop strings.

Text is produced by decoding a short window of tokens and keeping only what
the newest token added, so a multi-byte UTF-8 character split across tokens
appears once it is complete (never as U+FFFD), and tokenizers that merge a
leading space into the next piece still space words correctly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plinth.engine.sequence import Sequence

if TYPE_CHECKING:
    from plinth.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


def detokenize_step(tokenizer: Tokenizer, seq: Sequence, *, final: bool = False) -> str:
    """Decode what the newest tokens of ``seq`` add to its text; advance its offsets."""
    ids = seq.token_ids
    skip = seq.params.skip_special_tokens
    prefix_text = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    full_text = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
    if len(full_text) > len(prefix_text) and (final or not full_text.endswith(REPLACEMENT)):
        delta = full_text[len(prefix_text) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)
        return delta
    return ""


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last ``new_len`` characters
    of ``text`` (a stop may straddle token boundaries): (start index, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        begin = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, begin)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best
