"""What the engine returns (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability, and its rank among the vocabulary."""

    token_id: int
    logprob: float
    rank: int = 0
    decoded: str = ""


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and the top alternatives at one position."""

    token_id: int
    logprob: float
    top: list[Logprob] = field(default_factory=list)
    rank: int = 1  # 1 = the most likely token


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache or a KV connector
    num_external_cached_tokens: int = 0  # of those, loaded through the KV connector
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first_token, finished times (monotonic)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # first entry None: nothing precedes it
    error: str | None = None  # the request failed (e.g. its KV could not be loaded under the fail policy)
