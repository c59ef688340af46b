"""Requests and the sequences that carry them through the engine."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plinth.engine.outputs import TokenLogprobs
from plinth.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from plinth.engine.grammar import GrammarState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass
class Request:
    """One user request: a prompt and ``params.n`` samples of it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list["Sequence"] = field(default_factory=list)
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens not computed: local prefix cache + KV connector
    num_external_cached_tokens: int = 0  # of those, loaded through the KV connector
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return bool(self.seqs) and len(self.seqs) == self.params.n and all(s.finished for s in self.seqs)


class Sequence:
    """One stream of tokens: the prompt, then what was sampled after it."""

    __slots__ = (
        "seq_id", "request", "index", "token_ids", "num_prompt_tokens", "num_computed",
        "page_hashes", "status", "generator", "text", "prefix_offset", "read_offset", "logprobs",
        "cumulative_logprob", "finish_reason", "stop_reason", "grammar", "pending_fork", "num_emitted",
        "token_counts", "spec_tokens",
    )

    def __init__(self, request: Request, index: int, token_ids: list[int], *, generator: torch.Generator | None = None) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed = 0  # tokens whose K/V is in its pages (the KV-cache manager holds them)
        self.page_hashes: list[int] = []  # chained hashes of its full pages, as far as known
        self.status = SeqStatus.WAITING
        self.generator = generator  # torch.Generator when the request has a seed
        self.text = ""
        self.prefix_offset = max(self.num_prompt_tokens - 6, 0)
        self.read_offset = self.num_prompt_tokens
        self.logprobs: list[TokenLogprobs] | None = [] if request.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.grammar: GrammarState | None = None
        #: a sequence of an n>1 request whose prompt is being prefilled: at its
        #: first sample it forks into the n sequences
        self.pending_fork = False
        self.num_emitted = 0
        self.token_counts: dict[int, int] | None = None
        #: speculative decoding: proposals to score after the last token this
        #: step (not part of token_ids until the target accepts them)
        self.spec_tokens: list[int] = []

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before it can sample."""
        return len(self.token_ids) - self.num_computed

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request.request_id}#{self.index}, tokens={self.num_tokens}, "
            f"computed={self.num_computed}, {self.status.value})"
        )
