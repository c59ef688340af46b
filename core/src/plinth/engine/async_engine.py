"""The engine behind the server: ``LLMEngine`` on its own thread, with asyncio
streams per request.

The engine thread owns the engine: requests and aborts reach it through an
inbox it drains before each step, and each step's outputs go back to the
event loop with ``call_soon_threadsafe``. Torch releases the GIL inside ops,
so the event loop keeps serving while a step runs.

Each output carries its deltas (``CompletionOutput.delta_text``,
``delta_token_ids``, ``delta_logprobs``: what is new since the request's
previous output, stop-string prefixes held back), computed on the engine
thread; a reader that falls behind gets the outputs it missed folded into one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from plinth.engine.engine import LLMEngine
from plinth.engine.outputs import DeltaCursor, RequestOutput, coalesce
from plinth.engine.sampling_params import SamplingParams
from plinth.errors import PlinthError

log = logging.getLogger("plinth.engine")


class EngineOverloaded(PlinthError):
    """Too many requests are waiting; retry later (HTTP 503 with Retry-After)."""


class EngineError(PlinthError):
    """The engine failed while running this request (HTTP 500); the engine
    itself keeps serving others."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLM:
    """``engine`` is an ``LLMEngine`` or a function that builds one. Give the
    function: it then runs on the engine thread, so the model is loaded and
    stepped by the same thread. (libgomp keeps one OpenMP team per thread that
    runs torch ops; loading on one thread and stepping on another leaves two
    teams on the cores, and every op then sleeps and wakes instead of
    spinning: measured 1.7x slower decode on 2 cores.)"""

    def __init__(
        self, engine: LLMEngine | Callable[[], LLMEngine], *, max_waiting_requests: int = 4096
    ) -> None:
        self.max_waiting_requests = max_waiting_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._cursors: dict[str, DeltaCursor] = {}  # engine thread only
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self._factory = engine if callable(engine) and not isinstance(engine, LLMEngine) else None
        self.engine: LLMEngine = None if self._factory else engine  # type: ignore[assignment]
        self._started = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="plinth-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._startup_error is not None:
            raise self._startup_error

    @classmethod
    def from_config(cls, config: Any, registry: Any = None) -> "AsyncLLM":
        return cls(
            lambda: LLMEngine.from_config(config, registry), max_waiting_requests=config.max_waiting_requests
        )

    # ---- what the server uses ---------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def num_pending(self) -> int:
        return self.engine.scheduler.num_waiting + self._inbox.qsize()

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs of one request until it finishes: cumulative, with
        the deltas since the previous one.

        Raises RequestError (bad input) before the first output, and
        EngineOverloaded when the queue is full. Leaving the iteration early
        (a client that disconnected) aborts the request and frees its pages.
        """
        self.engine.validate(list(prompt_token_ids), params)
        if self._stop:
            fatal = getattr(self, "_fatal", None)
            raise EngineError(f"the engine failed: {fatal}" if fatal else "the engine is shutting down")
        if self.num_pending() >= self.max_waiting_requests:
            raise EngineOverloaded(f"{self.num_pending()} requests are already waiting; retry later")
        request_id = request_id or self.new_request_id()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._inbox.put(("add", request_id, list(prompt_token_ids), params, prompt))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                # a slow reader takes what queued up at once, deltas joined
                while not isinstance(item, BaseException) and not item.finished and not stream.queue.empty():
                    newer = stream.queue.get_nowait()
                    item = newer if isinstance(newer, BaseException) else coalesce(item, newer)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        s["waiting"] += self._inbox.qsize()
        return s

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        close = getattr(self.engine, "close", None)  # a distributed engine stops its ranks
        if close is not None:
            close()

    # ---- the engine thread ------------------------------------------------------------

    def _deliver(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:  # its event loop is closed
                self._streams.pop(request_id, None)

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, rid, ids, params, prompt = msg
                if rid not in self._streams:
                    continue  # its client left before it started
                try:
                    self.engine.add_request(rid, ids, params, prompt=prompt)
                except Exception as exc:
                    self._deliver(rid, exc)
                    continue
                # with the stop string kept in the output, cutting after it never takes back sent text
                self._cursors[rid] = DeltaCursor(() if params.include_stop_str_in_output else params.stop)
            else:
                self.engine.abort_request(msg[1])
                self._cursors.pop(msg[1], None)

    def _run(self) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
            except BaseException as exc:  # reported by the constructor
                self._startup_error = exc
                self._started.set()
                return
        self._started.set()
        while not self._stop:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # fail the running requests, keep serving
                log.exception("engine step failed; aborting the requests in flight")
                for rid in list(self.engine.requests):
                    self.engine.abort_request(rid)
                    self._cursors.pop(rid, None)
                    self._deliver(rid, EngineError(f"the engine failed: {type(exc).__name__}: {exc}"))
                if getattr(exc, "fatal", False):  # e.g. a dead rank: the engine cannot step again
                    self._fatal = exc
                    self._stop = True  # the thread ends, so /health fails; new requests get the error
                continue
            for out in outputs:
                cursor = self._cursors.pop(out.request_id, None) if out.finished or out.error else self._cursors.get(out.request_id)
                if out.error:
                    self._deliver(out.request_id, EngineError(out.error))
                elif cursor is not None:
                    self._deliver(out.request_id, cursor.advance(out))
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
            self._deliver(rid, EngineError("the engine shut down"))
