"""Per-request sampling options (vLLM's names), and their bounds.

``BOUNDS`` is the one statement of what each option may be: ``validate``
checks it, and the server's request models publish it in the OpenAPI
document (``plinth.server.protocol``), so what the document says is what is
refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypedDict, cast

from plinth.errors import RequestError

if TYPE_CHECKING:
    from plinth.engine.grammar import GrammarState

MAX_LOGPROBS = 20
#: samples per prompt (sample i is seeded with seed + i)
MAX_N = 128
#: the sampler computes in float32: larger numbers would become inf there
FLOAT32_MAX = 3.0e38
#: seeds: integers a JSON number holds exactly (a double's 53 bits; JSON Schema validators
#: compare numbers as doubles). Sample i of n takes seed + i, well inside torch's 64 bits.
SEED_MIN, SEED_MAX = -(2**53 - 1), 2**53 - 1
#: OpenAI's logit_bias range: -100 bans a token, 100 forces it
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class Bound:
    """A closed or open interval, and values it leaves out."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    #: values in the interval that are still refused (top_k 0)
    excluded: tuple[int, ...] = ()
    #: what the message says instead of the interval (top_k: "-1 (off) or >= 1")
    text: str = ""

    def holds(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            return False
        return v not in self.excluded

    def describe(self) -> str:
        if self.text:
            return self.text
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"

    def json_schema(self) -> dict[str, float | dict[str, int] | list[dict[str, int]]]:
        """The same bound as JSON Schema keywords (for the OpenAPI document)."""
        out: dict[str, float | dict[str, int] | list[dict[str, int]]] = {}
        if self.lo is not None:
            out["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        if self.hi is not None:
            out["exclusiveMaximum" if self.hi_open else "maximum"] = self.hi
        if len(self.excluded) == 1:
            out["not"] = {"const": self.excluded[0]}
        elif self.excluded:
            out["not"] = {"enum": list(self.excluded)}  # type: ignore[dict-item]
        return out


_PENALTY = Bound(-2.0, 2.0)
_LOGPROBS = Bound(0, MAX_LOGPROBS)

#: every numeric option's bound; a list option's bound holds for each item (a dict's: each value)
BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(1),
    "temperature": Bound(0.0, FLOAT32_MAX),
    "top_p": Bound(0.0, 1.0, lo_open=True),
    "top_k": Bound(-1, excluded=(0,), text="-1 (off) or >= 1"),
    "min_p": Bound(0.0, 1.0),
    "n": Bound(1, MAX_N),
    "seed": Bound(SEED_MIN, SEED_MAX, text="an integer in [-(2**53 - 1), 2**53 - 1]"),
    "stop_token_ids": Bound(0),
    "logprobs": _LOGPROBS,
    "prompt_logprobs": _LOGPROBS,
    "presence_penalty": _PENALTY,
    "frequency_penalty": _PENALTY,
    "repetition_penalty": Bound(0.0, FLOAT32_MAX, lo_open=True),
    "min_tokens": Bound(0),
    "logit_bias": Bound(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS),
}

_OPTIONAL = frozenset({"max_tokens", "seed", "logprobs", "prompt_logprobs", "logit_bias"})
_INTEGERS = frozenset({"max_tokens", "top_k", "n", "seed", "stop_token_ids", "logprobs", "prompt_logprobs", "min_tokens"})


class SamplingOptions(TypedDict, total=False):
    """The options a request may leave out, the sampler's defaults holding then."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float


def check_option(name: str, value: object) -> None:
    """One option against its bound (each item of a list, each value of a
    dict); RequestError naming it."""
    if value is None and name in _OPTIONAL:
        return
    items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else [value]
    integer, bound = name in _INTEGERS, BOUNDS[name]
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
            raise RequestError(f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}", param=name)
        if not bound.holds(v):
            what = f"{name} values" if isinstance(value, (dict, list)) else name
            raise RequestError(f"{what} must be {bound.describe()}, got {v!r}", param=name)


@dataclass
class SamplingParams:
    #: tokens to generate; None: as many as the context leaves (the engine resolves it)
    max_tokens: int | None = 16
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
    #: the request's structured-output grammar (compiled by the server), its state per request
    grammar: GrammarState | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Every option against ``BOUNDS`` (RequestError naming the option)."""
        for name in BOUNDS:
            check_option(name, getattr(self, name))
        if self.logit_bias and any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.logit_bias):
            raise RequestError(f"logit_bias keys must be token ids, got {sorted(map(repr, self.logit_bias))}", param="logit_bias")

    @classmethod
    def given(cls, **options: float | None) -> SamplingOptions:
        """``options`` without those left out (None), for ``SamplingParams(**...)``."""
        return cast(SamplingOptions, {k: v for k, v in options.items() if v is not None})

    @property
    def limit(self) -> int:
        """max_tokens, resolved: the engine sets it when it takes the request."""
        assert self.max_tokens is not None, "the engine resolves max_tokens when the request is added"
        return self.max_tokens

    @property
    def greedy(self) -> bool:
        # below 1e-5, dividing logits by the temperature overflows: it is greedy
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def clone(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)  # type: ignore[arg-type]
