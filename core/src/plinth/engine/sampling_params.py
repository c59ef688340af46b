"""Per-request sampling options (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from plinth.errors import RequestError

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: OpenAI's logit_bias: token id -> added to its logit before sampling (-100 bans, 100 forces)
    logit_bias: dict[int, float] | None = None
    #: structured output: {"type": "json_schema", "schema": {...}} | {"type": "json_object"} |
    #: {"type": "regex", "pattern": ...} | {"type": "structural_tag", ...}; compiled by the server
    guided: dict[str, Any] | None = None
    #: a plinth.engine.grammar.GrammarState, compiled from ``guided`` by the server
    grammar: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(msg: str, param: str) -> RequestError:
            return RequestError(msg, param=param)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise bad(f"top_k must be -1 (off) or >= 1, got {self.top_k}", "top_k")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.n < 1:
            raise bad(f"n must be at least 1, got {self.n}", "n")
        if self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}", "repetition_penalty")
        if not -2 <= self.presence_penalty <= 2:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise bad(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}", name)
        if self.min_tokens < 0:
            raise bad("min_tokens must be >= 0", "min_tokens")
        # torch generators take 64 bits; sample i of n is seeded with seed + i
        if self.seed is not None and not -(2**63) <= self.seed <= 2**63 - self.n:
            raise bad(f"seed must be a 64-bit integer, got {self.seed}", "seed")

    @property
    def greedy(self) -> bool:
        # below 1e-5, dividing logits by the temperature overflows: it is greedy
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def clone(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)
