"""Proposer conformance: a speculative-decoding proposer built as the engine
builds it (with a ``ProposerContext``), against a fake draft runner and a
fake tokenizer as strict as the engine's, on sequences that grow, roll back
and end."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from plinth.testing._report import Report
from plinth.testing.registration import discover_all

VOCAB = 64


class FakeTokenizer:
    """What a proposer may ask of the target's tokenizer."""

    vocab_size = VOCAB

    def raw_vocab(self) -> list[str]:
        return [f"t{i}" for i in range(VOCAB)]

    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"t{i}" for i in ids)


class FakeDraftRunner:
    """A ``DraftRunner`` whose model predicts ``(last token + 1) % vocab``;
    it checks what the engine's runner would refuse (keys it was never
    asked about being freed twice is fine; empty token lists are not)."""

    vocab_size = VOCAB

    def __init__(self) -> None:
        self.cached: dict[int, list[int]] = {}
        self.problems: list[str] = []

    def forward(self, items: Sequence[tuple[int, Sequence[int]]]) -> list[Any]:
        import torch

        out = []
        for key, tokens in items:
            if not tokens or not all(isinstance(t, int) and 0 <= t < VOCAB for t in tokens):
                self.problems.append(f"draft forward of key {key} with tokens {list(tokens)[:8]}...")
            self.cached[key] = list(tokens)
            logits = torch.full((VOCAB,), -10.0)
            logits[(tokens[-1] + 1) % VOCAB if tokens else 0] = 10.0
            out.append(logits)
        return out

    def free(self, key: int) -> None:
        self.cached.pop(key, None)


def check_proposer(name: str, *, k: int = 4, options: dict[str, Any] | None = None, speculative_model: str | None = "fake-draft") -> Report:
    """The proposer registered as ``name``: ``check`` answers with reasons
    (without a context too); built with a ``ProposerContext`` whose draft
    runner and tokenizers are fakes, ``propose`` returns per item at most
    ``item.k`` ints in the vocabulary (none for k = 0), in order, for
    growing, rolled-back and repeated sequences; ``free`` of a live or an
    unknown key is fine; the proposer's draft calls are well formed."""
    from plinth.api import ModelConfig, ProposeItem, ProposerContext, SelectionContext

    report = Report(f"proposer {name}")
    cls = discover_all().get("proposer", name).load()
    bare = cls.check(SelectionContext(options=dict(options or {})))
    report.expect(isinstance(bare, list) and all(isinstance(r, str) for r in bare), "check() without a context returns reasons", repr(bare))
    runner = FakeDraftRunner()
    tokenizer = FakeTokenizer()
    cfg = ModelConfig("FakeForCausalLM", VOCAB, 16, 1, 2, 1, 8, 512)
    spec = ProposerContext(
        num_speculative_tokens=k, speculative_model=speculative_model, model=cfg, tokenizer=tokenizer,
        load_tokenizer=lambda path: tokenizer, build_draft_runner=lambda path: runner,
    )
    ctx = SelectionContext(options=dict(options or {}), speculative=spec)
    reasons = cls.check(ctx)
    if reasons:
        report.problem(f"check() refuses a complete context: {'; '.join(reasons)}")
        return report.raise_for_problems()
    proposer = cls(ctx)
    rand = random.Random(0)
    seqs = {key: [rand.randrange(VOCAB) for _ in range(6 + key)] * 2 for key in range(4)}  # repeats: n-grams find them
    for step in range(6):
        items = [ProposeItem(key=key, token_ids=list(toks), num_prompt_tokens=6, k=(0 if key == 3 else k)) for key, toks in seqs.items()]
        out = proposer.propose(items)
        if not report.expect(isinstance(out, list) and len(out) == len(items), f"step {step}: one proposal list per item", repr(out)):
            break
        for item, got in zip(items, out):
            ok = isinstance(got, list) and len(got) <= item.k and all(isinstance(t, int) and 0 <= t < VOCAB for t in got)
            report.expect(ok, f"step {step}, key {item.key}: at most k={item.k} ids in the vocabulary", repr(got))
        for key, toks in seqs.items():
            if step == 3 and key == 1:
                del toks[-3:]  # rolled back: rejected proposals
            else:
                toks.append(rand.randrange(VOCAB))
    proposer.free(0)
    proposer.free(12345)  # a key the proposer never saw
    report.ok("free() of a live and of an unknown key")
    again = proposer.propose([ProposeItem(key=0, token_ids=seqs[0], num_prompt_tokens=6, k=k)])
    report.expect(len(again) == 1 and len(again[0]) <= k, "a freed key can come back", repr(again))
    report.expect(not runner.problems, "its draft-runner calls are well formed", "; ".join(runner.problems[:3]))
    return report.raise_for_problems()
