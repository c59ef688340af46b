"""KV-cache events in vLLM's wire format, for llm-d's KV-cache indexer and `platform router`.

The KV pool tells a :class:`KVEventRecorder` what enters its prefix cache
(``stored``), what it evicts (``removed``) and when it forgets everything
(``cleared``); the scheduler's ``end_step`` flushes one step's events as one
batch. This module owns everything else: the msgspec structs, the encoding
and the ZMQ sockets, written against vLLM's ``vllm/distributed/kv_events.py``:

- a batch is ``[ts, events, data_parallel_rank]`` (``EventBatch`` is
  ``array_like=True, omit_defaults=True``);
- each event is a tagged struct (``tag=True``: the tag is the class name,
  ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). vLLM 0.32 encodes
  it as a map ``{"type": "BlockStored", ...}``; older releases, and llm-d's
  indexer (``pkg/kvevents/engineadapter/vllm_adapter.go``, which decodes
  ``[tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name]``), use the positional form, ``array_like=True``. The
  map is the default; ``"array_like": true`` in ``--kv-events-config``
  chooses the positional one;
- ZMQ PUB frames ``(topic, 8-byte big-endian sequence, payload)``; the replay
  ROUTER answers ``[identity, b"", start_seq]`` with every buffered
  ``(seq, payload)`` from ``start_seq`` on, then ``(-1, b"")``;
- an endpoint holding ``*``, ``::``, ``ipc://`` or ``inproc://`` is bound, any
  other connected; data-parallel rank ``d`` adds ``d`` to a tcp port (inproc
  endpoints get ``_dp{d}``), as vLLM's ``offset_endpoint_port`` does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from itertools import count
from typing import Any, Mapping, Sequence

from plinth.errors import ConfigError

log = logging.getLogger("plinth.kv_events")

#: vLLM's ``MEDIUM_GPU``: the name llm-d's indexer gives the engine's own KV
#: pool (whatever the device); a KV connector's tiers report their own
MEDIUM_ENGINE = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class KVEventsConfig:
    """``--kv-events-config``: vLLM's ``KVEventsConfig`` fields, plus ``array_like``."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # null | zmq
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    #: events as positional arrays with the tag first (vLLM before 0.32, llm-d's indexer)
    array_like: bool = False

    @classmethod
    def from_mapping(cls, doc: Mapping[str, Any] | None) -> "KVEventsConfig | None":
        if not doc:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        cfg = cls(**doc)
        if cfg.publisher not in ("null", "zmq"):
            raise ConfigError(f"--kv-events-config: publisher must be 'zmq' or 'null', not {cfg.publisher!r}")
        if cfg.enable_kv_cache_events and cfg.publisher == "null" and "publisher" not in doc:
            cfg.publisher = "zmq"  # vLLM's default publisher once events are on
        return cfg

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def offset_endpoint_port(endpoint: str | None, dp_rank: int) -> str | None:
    """vLLM's ``ZmqEventPublisher.offset_endpoint_port``."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint:
        if ":" in endpoint:
            i = endpoint.rfind(":")
            return f"{endpoint[:i]}:{int(endpoint[i + 1 :]) + dp_rank}"
        return endpoint
    raise ConfigError(f"kv events endpoint {endpoint!r}: must contain 'inproc' or 'tcp' to be offset per dp rank")


def event_types(array_like: bool) -> dict[str, Any]:
    """The structs of one layout, field for field vLLM's (0.32)."""
    import msgspec

    # msgspec's stubs do not declare Struct's class keywords
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # pyright: ignore[reportCallIssue]
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, array_like=array_like):  # pyright: ignore[reportCallIssue]
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return {c.__name__: c for c in (EventBatch, BlockStored, BlockRemoved, AllBlocksCleared)}


class ZmqEventPublisher:
    """PUB socket + replay ROUTER, served by one thread (ZMQ sockets are not
    thread-safe), with the last ``buffer_steps`` payloads kept for replay."""

    SHUTDOWN_TIMEOUT = 1.0

    def __init__(self, cfg: KVEventsConfig, dp_rank: int = 0) -> None:
        import msgspec
        import zmq

        self.dp_rank = dp_rank
        self.endpoint = offset_endpoint_port(cfg.endpoint, dp_rank)
        self.replay_endpoint = offset_endpoint_port(cfg.replay_endpoint, dp_rank)
        self._topic = cfg.topic.encode()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._encode = msgspec.msgpack.Encoder().encode
        self._seq = count()
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        ep = self.endpoint or ""
        self._replay = None
        try:
            if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
                self._pub.bind(ep)
            else:
                self._pub.connect(ep)
            if self.replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise ConfigError(f"--kv-events-config: cannot open {ep} / {self.replay_endpoint}: {exc}") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: PUB %s%s", self.endpoint, f", replay {self.replay_endpoint}" if self.replay_endpoint else "")

    def publish(self, batch: Any) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:  # a stuck publisher thread must not stall the step loop
            log.warning("KV events: queue full, a batch is dropped (subscribers can replay up to the gap)")

    def _run(self) -> None:
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    log.exception("KV events: replay failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                break
            try:
                seq = next(self._seq)
                payload = self._encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:
                log.exception("KV events: publishing failed")
                time.sleep(0.1)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frame = self._replay.recv_multipart()
        if len(frame) != 3:
            log.warning("KV events: invalid replay request of %d frames", len(frame))
            return
        client, _, start = frame
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self._running = False
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT)
        except queue.Full:
            pass
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


class KVEventRecorder:
    """The KV pool's event sink: collects a step's events, publishes them as one batch.

    ``stored``/``removed`` take the engine's page hashes; ``parent`` is None
    for a prompt's first page (as vLLM reports it)."""

    def __init__(self, publisher: Any, *, block_size: int, array_like: bool = False) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self._types = event_types(array_like)
        self._events: list[Any] = []
        self._lock = threading.Lock()  # a KV connector's thread may report its tiers

    def stored(
        self,
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        *,
        medium: str | None = MEDIUM_ENGINE,
        group_idx: int | None = None,
        spec_kind: str | None = None,
        sliding_window: int | None = None,
    ) -> None:
        ev = self._types["BlockStored"](
            block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(token_ids), block_size=self.block_size,
            lora_id=None, medium=medium, lora_name=None, group_idx=group_idx, kv_cache_spec_kind=spec_kind,
            kv_cache_spec_sliding_window=sliding_window,
        )  # fmt: skip
        with self._lock:
            self._events.append(ev)

    def removed(self, hashes: Sequence[int], *, medium: str | None = MEDIUM_ENGINE, group_idx: int | None = None) -> None:
        ev = self._types["BlockRemoved"](block_hashes=list(hashes), medium=medium, group_idx=group_idx)
        with self._lock:
            self._events.append(ev)

    def cleared(self) -> None:
        with self._lock:
            self._events.append(self._types["AllBlocksCleared"]())

    def flush(self) -> None:
        """Publish what this step recorded (nothing when nothing happened)."""
        if not self._events:
            return
        with self._lock:
            events, self._events = self._events, []
        self.publisher.publish(self._types["EventBatch"](ts=time.time(), events=events, data_parallel_rank=self.publisher.dp_rank))

    def close(self) -> None:
        self.flush()
        self.publisher.close()


def build_recorder(config: Mapping[str, Any] | None, *, block_size: int, dp_rank: int = 0) -> KVEventRecorder | None:
    """The recorder for ``--kv-events-config``, or None when events are off."""
    cfg = KVEventsConfig.from_mapping(config)
    if cfg is None or not cfg.enabled:
        return None
    try:
        publisher = ZmqEventPublisher(cfg, dp_rank)
    except ImportError as exc:
        raise ConfigError(f"--kv-events-config needs pyzmq and msgspec (pip install 'plinth-core[kv-events]'): {exc}") from None
    return KVEventRecorder(publisher, block_size=block_size, array_like=cfg.array_like)
