"""The engine behind the server: ``LLMEngine`` on its own thread, with asyncio
streams per request.

The engine thread owns the engine: requests and aborts reach it through an
inbox it drains before each step, and each step's outputs go back to the
event loop with one ``call_soon_threadsafe`` for all its streams (one wake-up
of the loop's thread a step, not one per stream). Torch and the cpukernels
release the GIL inside ops, so the event loop keeps serving while a step runs.

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
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from plinth.engine.config import EngineConfig, SchedulerConfig
from plinth.engine.factory import build_engine
from plinth.engine.interfaces import (
    CLOSE_TIMEOUT_S,
    EngineClient,
    EngineCore,
    EngineDraining,
    EngineError,
    EngineOverloaded,
    KVTransferView,
)
from plinth.engine.outputs import DeltaCursor, RequestOutput, coalesce
from plinth.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from plinth.contract.model import ModelConfig
    from plinth.plugins import PluginRegistry
    from plinth.tokenizer import Tokenizer

log = logging.getLogger("plinth.engine")


#: what a request's stream receives: an output (with its deltas), or the error that ended it
Delivery = RequestOutput | BaseException


def _put_all(batch: Sequence[tuple[str, asyncio.Queue[Delivery], Delivery]]) -> None:
    for _, q, item in batch:
        q.put_nowait(item)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Delivery]


class AsyncLLM(EngineClient):
    """``engine`` is an ``EngineCore`` or a function that builds one. Give the
    function: it then runs on the engine thread, so the model is loaded and
    stepped by the same thread. (libgomp keeps one OpenMP team per thread that
    runs torch ops; loading on one thread and stepping on another leaves two
    teams on the cores, and every op then sleeps and wakes instead of
    spinning: measured 1.7x slower decode on 2 cores.)"""

    def __init__(self, engine: EngineCore | Callable[[], EngineCore], *, max_waiting_requests: int | None = None) -> None:
        #: None: the setting's default (``SchedulerConfig.max_waiting_requests``)
        self.max_waiting_requests = SchedulerConfig().max_waiting_requests if max_waiting_requests is None else max_waiting_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._cursors: dict[str, DeltaCursor] = {}  # engine thread only
        self._wake = threading.Event()
        self._idle = threading.Event()  # set by the engine thread when nothing is in flight
        self._stop = False
        self._closed = False
        #: why new requests are refused (draining), or None
        self._refusing: str | None = None
        #: the error that stopped the engine thread (a dead rank), or None
        self._fatal: BaseException | None = None
        self._ids = itertools.count()
        self._factory = engine if not isinstance(engine, EngineCore) else None
        #: the engine this client drives (for tests and benchmarks; the server uses only this class's methods)
        self.engine: EngineCore = None if self._factory else engine  # type: ignore[assignment]
        self._started = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="plinth-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._startup_error is not None:
            self._thread.join()
            raise self._startup_error

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def from_config(cls, config: EngineConfig, registry: PluginRegistry | None = None) -> "AsyncLLM":
        return cls(lambda: build_engine(config, registry), max_waiting_requests=config.scheduler.max_waiting_requests)

    # ---- EngineClient -----------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def num_pending(self) -> int:
        return self.engine.num_waiting() + self._inbox.qsize()

    def describe(self) -> dict[str, Any]:
        return {**self.engine.describe(), "max_model_len": self.engine.max_model_len}

    def kv_transfer(self) -> KVTransferView | None:
        return self.engine.kv_transfer()

    def health(self) -> tuple[bool, str]:
        if self._fatal is not None:
            return False, f"the engine failed: {self._fatal}"
        if not self._thread.is_alive():
            return False, "the engine thread is not running"
        return True, "ok"

    def accepting(self) -> tuple[bool, str]:
        ok, why = self.health()
        if not ok:
            return ok, why
        if self._refusing is not None:
            return False, self._refusing
        return True, "ready"

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

        Raises RequestError (bad input) before the first output,
        EngineOverloaded when the queue is full and EngineDraining while the
        engine shuts down. Leaving the iteration early (a client that
        disconnected) aborts the request and frees its pages.
        """
        self.engine.validate(list(prompt_token_ids), params)
        if self._fatal is not None or self._stop:
            raise EngineError(f"the engine failed: {self._fatal}" if self._fatal else "the engine is shut down")
        if self._refusing is not None:
            raise EngineDraining(self._refusing)
        if self.num_pending() >= self.max_waiting_requests:
            raise EngineOverloaded(f"{self.num_pending()} requests are already waiting; retry later")
        request_id = request_id or self.new_request_id()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._idle.clear()
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

    def drain(self, timeout: float, reason: str = "the server is shutting down") -> int:
        self._refusing = reason
        self._wake.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._idle.wait(min(0.05, max(0.0, deadline - time.monotonic()))) and self._inbox.empty():
                return 0
        if not self._thread.is_alive():
            return 0
        box: list[int] = []
        done = threading.Event()
        self._inbox.put(("abort_all", box, done))
        self._wake.set()
        done.wait(CLOSE_TIMEOUT_S)  # the engine thread answers after the step it is in
        return box[0] if box else 0

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the engine thread (requests still running get an error), then
        close the engine (KV saves flushed, ranks ended), within ``timeout``."""
        if self._closed:
            return
        self._closed = True
        self._refusing = self._refusing or "the engine is shut down"
        bound = time.monotonic() + timeout
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine thread did not stop within %.0f s (a step is stuck)", timeout)
        if self.engine is not None:
            self.engine.close(max(0.0, bound - time.monotonic()))

    # ---- the engine thread ------------------------------------------------------------

    def _deliver(self, request_id: str, item: Delivery) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: Sequence[tuple[str, Delivery]]) -> None:
        """Hand each (request id, output or error) to its stream: one wake-up
        of each event loop for the lot (a step's outputs), not one per stream."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Queue[Delivery], Delivery]]] = {}
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((rid, stream.queue, item))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # its event loop is closed
                for rid, _, _ in batch:
                    self._streams.pop(rid, None)

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
            elif msg[0] == "abort":
                self.engine.abort_request(msg[1])
                self._cursors.pop(msg[1], None)
            else:  # abort_all (drain): each stream ends with its final output, finish reason abort
                _, box, done = msg
                ids = self.engine.unfinished_request_ids()
                for rid in ids:
                    out = self.engine.abort_request(rid)
                    cursor = self._cursors.pop(rid, None)
                    if out is not None and cursor is not None:
                        self._deliver(rid, cursor.advance(out))
                box.append(len(ids))
                done.set()

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
                if self._inbox.empty():
                    self._idle.set()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # fail the running requests, keep serving
                log.exception("engine step failed; aborting the requests in flight")
                for rid in self.engine.unfinished_request_ids():
                    self.engine.abort_request(rid)
                    self._cursors.pop(rid, None)
                    self._deliver(rid, EngineError(f"the engine failed: {type(exc).__name__}: {exc}"))
                if getattr(exc, "fatal", False):  # e.g. a dead rank: the engine cannot step again
                    self._fatal = exc
                    self._stop = True  # the thread ends, so /health fails; new requests get the error
                continue
            delivered: list[tuple[str, Delivery]] = []
            for out in outputs:
                cursor = self._cursors.pop(out.request_id, None) if out.finished or out.error else self._cursors.get(out.request_id)
                if out.error:
                    delivered.append((out.request_id, EngineError(out.error)))
                elif cursor is not None:
                    delivered.append((out.request_id, cursor.advance(out)))
            self._deliver_all(delivered)
        for rid in self.engine.unfinished_request_ids():
            self.engine.abort_request(rid)
            self._deliver(rid, EngineError("the engine shut down"))
        self._idle.set()
