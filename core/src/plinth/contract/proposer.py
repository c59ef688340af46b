"""The proposer category (``--speculative-method``): speculative-decoding
proposers and the draft model runner the core builds for them."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol, Sequence

from plinth.contract.base import PluginDescriptor, PluginImpl, SelectionContext

if TYPE_CHECKING:
    import torch

    from plinth.contract.model import ModelConfig



@dataclass(frozen=True)
class ProposerDescriptor(PluginDescriptor):
    """A speculative-decoding proposer (``--speculative-method``).
    impl -> a ``Proposer`` subclass. Never chosen by ``auto``: speculation is
    off unless a method is named."""

    category: ClassVar[str] = "proposer"


@dataclass
class ProposeItem:
    """One sequence asking for proposals in this step.

    key:       stable id of the sequence while it lives (``Proposer.free(key)``
               follows when it ends)
    token_ids: its tokens so far, prompt then output (read only)
    num_prompt_tokens: where the output starts in ``token_ids``
    k:         the most tokens to propose (the engine's adaptive budget for
               this sequence); proposing fewer, or none, is always fine
    hidden:    the target model's last hidden state for this sequence (the
               row that produced its newest token), given only to a proposer
               whose class sets ``wants_hidden`` (a model's own MTP or EAGLE
               heads); None otherwise
    """

    key: int
    token_ids: Sequence[int]
    num_prompt_tokens: int
    k: int
    hidden: "torch.Tensor | None" = None


class DraftRunner(Protocol):
    """A second, smaller model the core runs for a proposer: loaded by the
    same start-up code (its model plugin, the chosen backend's ops) with its
    own KV-cache manager, page pool and model runner."""

    vocab_size: int

    def forward(self, items: Sequence[tuple[int, Sequence[int]]]) -> "list[torch.Tensor | None]":
        """For each (key, token_ids): make the draft's cache of ``key`` hold
        ``token_ids`` (its cached prefix is kept as far as it agrees with
        ``token_ids``: rollback is by common prefix; only the rest is
        computed, all items in one forward) and return the logits [vocab]
        (float32, CPU) that follow the last token; None where the draft's
        page pool had no room (that key's cache is dropped)."""
        ...

    def free(self, key: int) -> None:
        """Drop the draft cache of a sequence that ended."""
        ...


@dataclass
class ProposerContext:
    """What the engine hands a proposer (``SelectionContext.speculative``).

    num_speculative_tokens: k, the most tokens proposed per sequence and step
    speculative_model:      ``--speculative-model`` (a folder or .gguf), if given
    model:                  the target model's config; tokenizer: its tokenizer
    load_tokenizer(path):   the tokenizer of another model (through its model plugin)
    build_draft_runner(path): a ``DraftRunner`` for another model; raises
                            ``PluginError`` when it cannot load
    """

    num_speculative_tokens: int
    speculative_model: str | None
    model: "ModelConfig"
    tokenizer: Any
    load_tokenizer: Callable[[str], Any]
    build_draft_runner: Callable[[str], DraftRunner]


class Proposer(PluginImpl):
    """Proposes the next tokens of sequences; the engine verifies them.

    The target model scores the k proposals of a sequence in one forward
    and keeps the longest prefix it would have produced itself (exactly for
    greedy requests, by rejection sampling for sampled ones), so a proposer
    only changes speed, never output. Proposals are treated as greedy picks
    (a point mass), which is what keeps the rejection rule exact: a proposer
    that samples must not be used with this contract.

    ``check(ctx)`` sees ``ctx.speculative`` (a ``ProposerContext``) at
    start-up and ``None`` in ``platform plugins``; reasons name what is wrong
    ("--speculative-model is required", "the tokenizers differ: ...").
    """

    #: ask the engine for the target's last hidden states (``ProposeItem.hidden``)
    wants_hidden: ClassVar[bool] = False

    def __init__(self, ctx: SelectionContext) -> None:
        self.ctx = ctx
        assert ctx.speculative is not None, "a proposer is built with a ProposerContext"
        self.spec: ProposerContext = ctx.speculative

    @abc.abstractmethod
    def propose(self, items: Sequence[ProposeItem]) -> list[list[int]]:
        """Per item, up to ``item.k`` token ids to follow ``item.token_ids``.
        Called once per engine step, before scheduling, on the engine thread."""
        raise NotImplementedError

    def free(self, key: int) -> None:
        """The sequence ``key`` ended (or was preempted): drop its state."""
        ...
