"""What the engine returns (vLLM's names)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from plinth.parsing import held_back


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
    #: what is new since this request's previous output (``AsyncLLM`` fills
    #: them): the fields above are cumulative, these are what a stream sends.
    #: ``delta_text`` never shows what may still become a stop string (it is
    #: held back until it cannot, then sent), so it is never taken back.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

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


class DeltaCursor:
    """What one consumer has been sent of one request: fills the ``delta_*``
    fields of each cumulative output it is given."""

    __slots__ = ("stops", "sent")

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = list(stops)
        self.sent: dict[int, tuple[int, int]] = {}  # choice index -> (text chars, tokens)

    def advance(self, out: RequestOutput) -> RequestOutput:
        for c in out.outputs:
            text_len, tokens = self.sent.get(c.index, (0, 0))
            visible = len(c.text) if c.finished or not self.stops else len(c.text) - held_back(c.text, self.stops)
            visible = max(visible, text_len)
            c.delta_text = c.text[text_len:visible]
            c.delta_token_ids = c.token_ids[tokens:]
            c.delta_logprobs = c.logprobs[tokens:] if c.logprobs is not None else None
            self.sent[c.index] = (visible, len(c.token_ids))
        return out


def coalesce(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """``newer`` with ``older``'s deltas in front: for a reader that fell
    behind and takes two outputs of one request at once."""
    before = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        o = before.get(c.index)
        if o is None:
            continue
        c.delta_text = o.delta_text + c.delta_text
        c.delta_token_ids = o.delta_token_ids + c.delta_token_ids
        if c.delta_logprobs is not None and o.delta_logprobs is not None:
            c.delta_logprobs = o.delta_logprobs + c.delta_logprobs
    return newer
