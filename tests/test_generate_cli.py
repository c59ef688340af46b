"""`platform generate` on the default model (SmolLM2-135M-Instruct, GGUF),
and incremental detokenization of multi-byte text with its real tokenizer."""

import os
import subprocess
import sys

import pytest
from plinth.engine.detokenizer import detokenize_step
from plinth.engine.model_source import default_model_path
from plinth.engine.sampling_params import SamplingParams
from plinth.engine.sequence import Request, Sequence
from plinth.tokenizer import Tokenizer

PLATFORM = os.path.join(os.path.dirname(sys.executable), "platform")


@pytest.mark.slow
def test_platform_generate_default_model_says_paris():
    proc = subprocess.run(
        [PLATFORM, "generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    assert proc.stdout.startswith("The capital of France is")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return Tokenizer.from_gguf(default_model_path())


@pytest.mark.parametrize(
    "text",
    [
        "naïve café — 東京で寿司を食べた 🍣🎉 and Ελληνικά",
        "emoji run: 👩‍👩‍👧‍👦👍🏽🇫🇷 end",
        "  spaces\n\ttabs and 1234567 digits ✓",
    ],
)
def test_incremental_detokenization_is_exact_for_multibyte_text(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    prompt = tok.encode("Say:", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    req = Request("r", None, prompt, SamplingParams())
    seq = Sequence(req, 0, list(prompt))
    pieces = []
    for t in ids:  # one token at a time, as the engine appends them
        seq.token_ids.append(t)
        piece = detokenize_step(tok, seq)
        assert "\ufffd" not in piece  # never half a character
        pieces.append(piece)
    pieces.append(detokenize_step(tok, seq, final=True))
    assert "".join(pieces) == tok.decode(ids)
    # several emoji are split across tokens: some steps must have held text back
    assert any(p == "" for p in pieces[:-1]) or len(ids) == len(text)
