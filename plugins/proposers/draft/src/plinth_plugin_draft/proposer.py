"""Draft-model proposals: a smaller model with the target's tokenizer
proposes k tokens greedily, one batched draft forward per token. The core
runs the draft (``ProposerContext.build_draft_runner``): the same model
plugins and ops as the target, its own page pool; its cache follows each
sequence by common prefix, so rejected proposals cost nothing to undo."""

from __future__ import annotations

from typing import Sequence

from plinth.api import ProposeItem, Proposer, SelectionContext


def tokenizer_difference(a, b) -> str | None:
    """Why two tokenizers do not give the same ids to the same text (None: they do)."""
    if a.vocab_size != b.vocab_size:
        return f"vocabulary sizes {a.vocab_size} (draft) and {b.vocab_size} (target)"
    va, vb = a.raw_vocab(), b.raw_vocab()
    if va != vb:
        i = next(i for i, (x, y) in enumerate(zip(va, vb)) if x != y)
        return f"token {i} is {va[i]!r} in the draft and {vb[i]!r} in the target"
    return None


class DraftProposer(Proposer):
    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        spec = ctx.speculative
        if spec is None:  # `platform plugins`: nothing to judge without a draft model
            return []
        if not spec.speculative_model:
            return ["--speculative-model PATH is required: the draft model (same tokenizer as the target)"]
        try:
            draft_tok = spec.load_tokenizer(spec.speculative_model)
        except Exception as exc:
            return [f"the draft model {spec.speculative_model} cannot load: {type(exc).__name__}: {exc}"]
        why = tokenizer_difference(draft_tok, spec.tokenizer)
        return [f"the tokenizers differ: {why}"] if why else []

    def __init__(self, ctx: SelectionContext) -> None:
        super().__init__(ctx)
        assert self.spec.speculative_model is not None, "check() requires --speculative-model"
        self.runner = self.spec.build_draft_runner(self.spec.speculative_model)
        self.vocab = self.spec.model.vocab_size  # propose only what the target can score

    def propose(self, items: Sequence[ProposeItem]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in items]
        active = [i for i, it in enumerate(items) if it.k > 0]
        base = {i: list(items[i].token_ids) for i in active}
        while active:
            logits = self.runner.forward([(items[i].key, base[i] + out[i]) for i in active])
            still = []
            for i, row in zip(active, logits):
                if row is None:  # the draft's pool is full: this one goes without
                    continue
                out[i].append(int(row[: self.vocab].argmax()))
                if len(out[i]) < items[i].k:
                    still.append(i)
            active = still
        return out

    def free(self, key: int) -> None:
        self.runner.free(key)
