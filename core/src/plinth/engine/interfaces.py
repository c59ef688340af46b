"""The two engine interfaces, as vLLM v1 splits them.

``EngineCore``: what steps requests, driven by one thread. ``LLMEngine`` (one
scheduler over an ``Executor``: this process, or tp ranks) and
``DataParallelEngine`` (one ``LLMEngine`` per dp group) are both one.

``EngineClient``: what the HTTP server and user code talk to: requests in,
streams of outputs back, from any event loop. ``AsyncLLM`` is the one
implementation (an ``EngineCore`` on its own thread). The server uses only
these methods.

Both are context managers; ``close()`` is bounded and idempotent: it stops
accepting work, flushes (or, past the bound, cancels) pending KV saves, stops
every thread the engine started and ends the worker ranks.

This module imports nothing else of the engine: every engine module may
import it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from plinth.errors import PlinthError

if TYPE_CHECKING:  # the engine's two data modules, which import nothing of the engine
    from plinth.contract.model import ModelConfig
    from plinth.engine.outputs import RequestOutput
    from plinth.engine.sampling_params import SamplingParams
    from plinth.tokenizer import Tokenizer

#: how long close() waits for pending KV saves and threads, by default
CLOSE_TIMEOUT_S = 10.0


class EngineOverloaded(PlinthError):
    """Too many requests are waiting; retry later (HTTP 503 with Retry-After)."""


class EngineDraining(PlinthError):
    """The engine is shutting down and takes no new request (HTTP 503; the
    message says why)."""


class EngineError(PlinthError):
    """The engine failed while running this request (HTTP 500); the engine
    itself keeps serving others."""


class DeadRankError(PlinthError):
    """A rank died, hung or failed: the engine cannot step again."""

    fatal = True


class EngineCore(ABC):
    """Requests in, one scheduled step at a time, outputs out. One thread
    drives it; nothing in it is shared with other threads."""

    tokenizer: Tokenizer
    model_config: ModelConfig
    max_model_len: int
    #: what start-up chose (``startup.Components``: the ``ResolvedConfig``, the plugins, the step plan)
    components: Any

    @abstractmethod
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``RequestError`` for what this engine cannot run."""

    @abstractmethod
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *, prompt: str | None = None) -> object:
        """Queue a request (validated first)."""

    @abstractmethod
    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now (finish reason ``abort``); its final output, or
        None when it is not running."""

    @abstractmethod
    def unfinished_request_ids(self) -> list[str]:
        """The requests added and not yet finished."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether a step has anything to do (or a failure to report)."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of every request that moved."""

    @abstractmethod
    def num_waiting(self) -> int:
        """Requests queued and not yet scheduled."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters and gauges (``running``, ``waiting``, pages, tokens, ...)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What start-up chose (plugins, model, pool), for /version and logs."""

    @abstractmethod
    def kv_transfer(self) -> KVTransferView | None:
        """The KV connector's engine side (``KVTransfer``), or None."""

    @abstractmethod
    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop accepting work, flush pending KV saves (cancel what is left
        after ``timeout``), stop every thread, end the ranks."""

    def __enter__(self) -> "EngineCore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVTransferView(Protocol):
    """What the server reads of the KV connector's engine side (``KVTransfer``)."""

    role: str
    deadline_s: float

    def health(self) -> tuple[bool, str]: ...

    def wait_saves(self, timeout: float | None = None) -> bool: ...


class EngineClient(Protocol):
    """What the server talks to. Safe to call from an event loop. A Protocol:
    the server needs these methods, not a base class (``AsyncLLM`` is the
    implementation; test doubles need only match them)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def max_model_len(self) -> int: ...

    def new_request_id(self, prefix: str = "req") -> str: ...

    def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None, prompt: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request until it finishes. Raises ``RequestError``,
        ``EngineOverloaded`` or ``EngineDraining`` before the first output;
        leaving the iteration early aborts the request."""
        ...

    def abort(self, request_id: str) -> None: ...

    def num_pending(self) -> int:
        """Requests waiting (queued in the engine or on their way to it)."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def describe(self) -> dict[str, Any]:
        """What start-up chose (``EngineCore.describe``), and ``max_model_len``."""
        ...

    def health(self) -> tuple[bool, str]:
        """(whether the engine loop runs, why not)."""
        ...

    def accepting(self) -> tuple[bool, str]:
        """(whether new requests are taken, why not: draining, failed)."""
        ...

    def kv_transfer(self) -> KVTransferView | None:
        """The KV connector's engine side, or None (health, the save barrier)."""
        ...

    def drain(self, timeout: float, reason: str = "the server is shutting down") -> int:
        """Refuse new requests (``EngineDraining(reason)``), let running ones
        finish for up to ``timeout`` seconds, then abort the rest (their
        streams end with finish reason ``abort``). Blocking; returns how many
        were aborted."""
        ...

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None: ...
