"""Incremental detokenization on the default model's byte-level BPE: what a
stream sends, with the final flush, equals decoding the whole output at once,
wherever generation stops (mid-character included)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from plinth.engine.detokenizer import REPLACEMENT, detokenize_step


@pytest.fixture(scope="module")
def tokenizer():
    from plinth.engine.model_source import default_model_path
    from plinth.errors import ConfigError
    from plinth.tokenizer import Tokenizer

    try:
        path = default_model_path()
    except ConfigError as exc:
        pytest.skip(str(exc))
    return Tokenizer.from_gguf(path)


def _streamed(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> tuple[str, list[str]]:
    """The text a stream sends token by token, then the final flush; and the deltas."""
    n = len(prompt_ids)
    seq = SimpleNamespace(
        token_ids=list(prompt_ids), params=SimpleNamespace(skip_special_tokens=True), prefix_offset=max(n - 6, 0), read_offset=n
    )
    deltas = []
    for token in output_ids:
        seq.token_ids.append(token)
        deltas.append(detokenize_step(tokenizer, seq))
    deltas.append(detokenize_step(tokenizer, seq, final=True))
    return "".join(deltas), deltas


def test_stream_equals_whole_decode_at_every_stop(tokenizer):
    pieces = ["日", "本", "語", "😀", "é", " ", "a", "ü", "🎉", "\n", "Ω", "中文", " 😀", "word", "<|im_end|>"]
    rng = random.Random(0)
    prompt = tokenizer.encode("Hello")
    split_characters = 0
    for _ in range(120):
        ids = tokenizer.encode("".join(rng.choice(pieces) for _ in range(rng.randint(1, 10))))
        for stop in range(1, len(ids) + 1):
            whole = tokenizer.decode(ids[:stop], skip_special_tokens=True)
            text, deltas = _streamed(tokenizer, prompt, ids[:stop])
            assert text == whole, (ids[:stop], deltas)
            # a character split across tokens is never sent half-made before the end
            assert all(REPLACEMENT not in d for d in deltas[:-1]), deltas
            split_characters += whole.endswith(REPLACEMENT)
    # the cases the final flush exists for did occur
    assert split_characters > 10
