"""The engine side of a KV connector: every store call off the step loop.

The connector plugin (``plinth.api.KVConnector``) makes plain blocking
calls. This module runs them on its own threads and never lets the step loop
wait on them:

* admission asks ``lookup(seq, hashes)``: the first call starts a fetch job
  (the store's lookup, then its load into staging buffers, then the header
  check of every value) and answers ``None`` ("ask again later"); a later
  call returns the good pages' payloads, or nothing once the deadline has
  passed (a timeout: those tokens are recomputed).
* after a step, pages that became full are read out of the KV cache on the
  loop (a memory copy, so a store call that outlives its deadline never
  touches live pages) and a save job stores them.
* a circuit breaker opens after ``breaker_failures`` failures in a row: while
  open no store call is made (lookups miss, saves are skipped); after
  ``breaker_reset_s`` one call probes the store (``health()``), and success
  within the deadline closes it again.

Every stored value carries a header the core writes and checks: magic, the
layout fingerprint, a digest of its key, the payload length and a blake2b
checksum. A corrupt, truncated or foreign value is a miss, never loaded.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from plinth.api import KVConnector, KVLayout
from plinth.errors import ConfigError, PlinthError

log = logging.getLogger("plinth.kv_connector")

MAGIC = b"PLINTHKV"
#: magic, fingerprint digest, key digest, payload length, payload checksum
_HEADER = struct.Struct("<8s16s16sQ16s")
HEADER_BYTES = _HEADER.size  # 64

POLICIES = ("recompute", "fail")
ROLES = ("kv_both", "kv_producer", "kv_consumer")
#: worker threads: lookups+loads, and saves (each with its own staging area)
LOOKUP_THREADS, SAVE_THREADS = 2, 1
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KVTransferError(PlinthError):
    """A request whose KV the store held could not be loaded, under the ``fail`` policy."""


def _digest(data: Any) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def make_key(layout: KVLayout, page_hash: int) -> str:
    """The store key of one page: layout fingerprint, tp rank, chained page hash."""
    return f"plinth/{layout.fingerprint}/tp{layout.tp_rank}/{page_hash & 0xFFFFFFFFFFFFFFFF:016x}"


def encode_value(layout: KVLayout, key: str, payload: torch.Tensor, out: torch.Tensor) -> None:
    """Write header + payload into ``out`` (uint8, ``layout.value_bytes``)."""
    data = payload.numpy()
    header = _HEADER.pack(MAGIC, _digest(layout.fingerprint.encode()), _digest(key.encode()), data.nbytes, _digest(data))
    out[:HEADER_BYTES] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    out[HEADER_BYTES : HEADER_BYTES + data.nbytes] = payload


def check_value(layout: KVLayout, key: str, value: torch.Tensor, nbytes: int) -> tuple[torch.Tensor | None, str]:
    """(payload, "") when ``value`` is a good value of ``key`` in this
    layout; (None, kind) otherwise: kind is missing, truncated, corrupt or foreign."""
    if nbytes <= 0:
        return None, "missing"
    if nbytes != layout.value_bytes or value.numel() < layout.value_bytes:
        return None, "truncated"
    magic, fp, kd, length, checksum = _HEADER.unpack(value[:HEADER_BYTES].numpy().tobytes())
    if magic != MAGIC:
        return None, "corrupt"
    if fp != _digest(layout.fingerprint.encode()) or length != layout.page_bytes:
        return None, "foreign"
    if kd != _digest(key.encode()):
        return None, "corrupt"
    payload = value[HEADER_BYTES : HEADER_BYTES + length]
    if _digest(payload.numpy()) != checksum:
        return None, "corrupt"
    return payload, ""


class CircuitBreaker:
    """closed -> open after ``threshold`` failures in a row; open -> half_open
    (one probe) after ``reset_s``; the probe's success closes it."""

    def __init__(self, threshold: int = 3, reset_s: float = 2.0) -> None:
        self.threshold = max(1, threshold)
        self.reset_s = reset_s
        self.state = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self.times_opened = 0
        #: called when the circuit closes again (the store may have lost its data)
        self.on_recover: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """May a store call be made now? (In the open state after reset_s,
        True once: that call is the probe.)"""
        with self._lock:
            if self.state == "closed":
                return True
            if self.state == "open" and time.monotonic() - self.opened_at >= self.reset_s:
                self.state = "half_open"
                return True
            return False

    def success(self) -> None:
        with self._lock:
            recovered = self.state != "closed"
            self.state, self.failures = "closed", 0
        if recovered:
            log.info("KV connector: the store answers again; circuit closed")
            if self.on_recover is not None:
                self.on_recover()

    def trip(self) -> None:
        """Open now (the start-up probe found no store)."""
        with self._lock:
            if self.state != "open":
                self.times_opened += 1
            self.state, self.opened_at = "open", time.monotonic()

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self.state == "half_open" or (self.state == "closed" and self.failures >= self.threshold):
                if self.state == "closed":
                    self.times_opened += 1
                    log.warning("KV connector: %d failures in a row; circuit open (store calls stop for %.1fs)", self.failures, self.reset_s)
                self.state, self.opened_at = "open", time.monotonic()


class Histogram:
    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        cum, acc = [], 0
        for c in self.counts:
            acc += c
            cum.append(acc)
        return {"buckets": list(self.buckets), "cumulative": cum, "sum": self.sum, "count": self.count}


@dataclass
class _Fetch:
    future: Future
    deadline: float
    num_pages: int
    first: int
    started: float = field(default_factory=time.monotonic)


@dataclass
class FetchResult:
    payloads: list[torch.Tensor]
    stored: int  # pages the store said it held
    failure: str = ""  # the kind of the first bad value, if any


_instances = itertools.count()


class KVTransfer:
    """One engine's connection to a KV store; called only from the engine thread."""

    def __init__(
        self,
        connector: KVConnector,
        layout: KVLayout,
        *,
        read_pages: Callable[[Sequence[int]], torch.Tensor],
        write_pages: Callable[[Sequence[int], torch.Tensor], None],
        options: Mapping[str, Any] | None = None,
    ) -> None:
        opts = dict(options or {})
        self.connector = connector
        self.layout = layout
        self.read_pages = read_pages
        self._write_pages = write_pages
        self.policy = str(opts.get("failure_policy", "recompute"))
        if self.policy not in POLICIES:
            raise ConfigError(f"kv connector failure_policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        self.role = str(opts.get("kv_role", "kv_both"))
        if self.role not in ROLES:
            raise ConfigError(f"kv_role must be one of {', '.join(ROLES)}, got {self.role!r}")
        self.deadline_s = float(opts.get("deadline_s", 2.0))
        self.max_pending_saves = int(opts.get("max_pending_saves", 4))
        self.max_pending_lookups = int(opts.get("max_pending_lookups", 16))
        self.breaker = CircuitBreaker(int(opts.get("breaker_failures", 3)), float(opts.get("breaker_reset_s", 2.0)))
        self.breaker.on_recover = self._forget_known
        # names of this transfer's own: close() joins its threads by them
        n = next(_instances)
        self._thread_prefixes = (f"plinth-kv-load-{n}_", f"plinth-kv-save-{n}_")
        self._lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix=self._thread_prefixes[0][:-1])
        self._saves = ThreadPoolExecutor(SAVE_THREADS, thread_name_prefix=self._thread_prefixes[1][:-1])
        #: pages a staging area holds: a call with more pages runs in chunks of this many
        self.staging_pages = max(1, int(opts.get("staging_pages", 32)))
        self._fetches: dict[int, _Fetch] = {}
        self._pending_saves: list[Future] = []
        self._save_batch: list[tuple[int, int]] = []  # (page, hash) to save after this step
        self._known: OrderedDict[int, None] = OrderedDict()  # hashes the store holds (saved or loaded)
        self._known_cap = 1 << 16
        self._events: Any = None  # the KV-event recorder, with --kv-events-config
        self._key_hash: OrderedDict[str, int] = OrderedDict()  # the keys this engine saved -> page hashes
        self._lock = threading.Lock()
        #: each worker thread's staging area, registered with the connector once and reused
        self._arenas = threading.local()
        self._probe: Future | None = None
        self._prepare_workers()
        # metrics
        self.counters: dict[str, int] = {
            "lookups": 0, "lookup_pages": 0, "hit_pages": 0, "loaded_pages": 0, "loaded_bytes": 0,
            "saved_pages": 0, "saved_bytes": 0, "recomputed_tokens": 0, "skipped_open": 0,
        }
        self.failures: dict[str, int] = {}
        self.load_latency = Histogram()
        self.save_latency = Histogram()
        #: how long each request's admission waited on the store (answered, failed or timed out):
        #: the rule "a dead store costs at most the deadline", measured where it holds
        self.wait_latency = Histogram()
        self._health_reason = ""
        # probe the store at once (a store down at start-up shows as degraded
        # health, not as a healthy server whose first requests time out), and
        # keep probing while the circuit is open, so the connector attaches by
        # itself when the store comes up, requests or not
        self._closed = threading.Event()
        self._probe = self._lookups.submit(self._run_probe, True)
        self._watcher = threading.Thread(target=self._watch, name="plinth-kv-watch", daemon=True)
        self._watcher.start()

    def _prepare_workers(self) -> None:
        """Start every worker thread now and have each register its staging
        area (an RDMA memory registration for Mooncake), so that loads and
        saves only reuse them. A barrier per pool makes each job land on its
        own thread; the step loop does not wait for them."""
        for pool, n in ((self._lookups, LOOKUP_THREADS), (self._saves, SAVE_THREADS)):
            barrier = threading.Barrier(n)
            for _ in range(n):
                pool.submit(self._prepare_thread, barrier)

    def _prepare_thread(self, barrier: threading.Barrier) -> None:
        try:
            barrier.wait(timeout=5.0)
        except threading.BrokenBarrierError:  # a thread slow to start: it registers on its own job
            pass
        try:
            self._staging_area()
        except Exception as exc:  # a store down at start-up: this thread registers at its first call
            log.info("KV connector: staging area not registered at start-up (%s: %s)", type(exc).__name__, exc)

    def _watch(self) -> None:
        period = max(0.05, min(self.breaker.reset_s, 5.0))
        while not self._closed.wait(period):
            try:
                self._maybe_probe()
            except RuntimeError:  # the executor shut down
                return

    # ---- scheduler side --------------------------------------------------------------

    def lookup(self, seq: Any, first: int, hashes: Sequence[int]) -> list[torch.Tensor] | None:
        """Payloads of the leading pages the store holds of ``hashes``
        (``seq``'s page hashes from index ``first``), maybe none, or None
        while the fetch is in flight. Raises KVTransferError under the
        ``fail`` policy when stored pages could not be loaded."""
        job = self._fetches.get(seq.seq_id)
        if job is not None and job.first > first:  # the local prefix shrank meanwhile: ask afresh
            del self._fetches[seq.seq_id]
            job = None
        now = time.monotonic()
        if job is None:
            if self.role == "kv_producer" or not hashes:
                return []
            if len(self._fetches) >= self.max_pending_lookups:
                self._fail("busy", count_breaker=False)
                return []
            if not self.breaker.allow():
                self.counters["skipped_open"] += 1
                return []
            keys = [make_key(self.layout, h) for h in hashes]
            self.counters["lookups"] += 1
            self.counters["lookup_pages"] += len(keys)
            fut = self._lookups.submit(self._fetch, keys)
            self._fetches[seq.seq_id] = _Fetch(fut, now + self.deadline_s, len(keys), first)
            return None
        if not job.future.done():
            if now < job.deadline:
                return None
            del self._fetches[seq.seq_id]
            self.wait_latency.observe(now - job.started)
            self._fail("timeout")
            return self._degraded(seq, "the store did not answer within the deadline", None)
        del self._fetches[seq.seq_id]
        self.wait_latency.observe(now - job.started)
        try:
            res: FetchResult = job.future.result()
        except Exception as exc:
            self._fail("error")
            log.warning("KV connector lookup failed: %s: %s", type(exc).__name__, exc)
            return self._degraded(seq, f"the store failed: {type(exc).__name__}: {exc}", None)
        self.breaker.success()
        self.load_latency.observe(time.monotonic() - job.started)
        n = len(res.payloads)
        self.counters["hit_pages"] += n
        payloads = res.payloads[first - job.first :]  # the local prefix cache may have grown meanwhile
        if res.failure:
            self._fail(res.failure, count_breaker=False)
            if n < res.stored:
                return self._degraded(
                    seq, f"{res.stored - n} stored pages were {res.failure}", payloads, missing=res.stored - n
                )
        return payloads

    def _degraded(self, seq: Any, why: str, payloads: list[torch.Tensor] | None, missing: int = 0) -> list[torch.Tensor]:
        rid = seq.request.request_id
        if self.policy == "fail":
            raise KVTransferError(f"request {rid}: KV load failed: {why}")
        tokens = missing * self.layout.page_size
        self.counters["recomputed_tokens"] += tokens
        self._health_reason = why
        log.warning("request %s: KV load failed (%s); recomputing%s", rid, why, f" {tokens} tokens" if tokens else "")
        return payloads or []

    def _fetch(self, keys: list[str]) -> FetchResult:
        """On a worker thread: lookup, load into fresh buffers, check."""
        stored = int(self.connector.lookup(keys))
        stored = max(0, min(stored, len(keys)))
        if stored == 0:
            return FetchResult([], 0)
        staging = self._staging_area()
        payloads: list[torch.Tensor] = []
        for start in range(0, stored, len(staging)):  # in chunks the staging area holds
            part = keys[start : min(stored, start + len(staging))]
            buffers = [staging[i] for i in range(len(part))]
            sizes = list(self.connector.load(part, buffers))
            for i, key in enumerate(part):
                payload, kind = check_value(self.layout, key, buffers[i], int(sizes[i]) if i < len(sizes) else 0)
                if payload is None:
                    return FetchResult(payloads, stored, kind)
                payloads.append(payload.clone())  # the staging area is this thread's next chunk's too
        return FetchResult(payloads, stored)

    def _staging_area(self) -> torch.Tensor:
        """This worker thread's staging area (``staging_pages`` value-sized
        rows), registered with the connector once, at start-up
        (``_prepare_workers``), and reused by every call on this thread; a
        registration that failed (the store was down) is retried here."""
        arena = getattr(self._arenas, "buffer", None)
        if arena is None:
            arena = torch.empty(self.staging_pages, self.layout.value_bytes, dtype=torch.uint8)
            self._arenas.buffer, self._arenas.registered = arena, False
        if not self._arenas.registered:
            self.connector.register_buffer(arena)
            self._arenas.registered = True
        return arena

    def write_pages(self, pages: Sequence[int], payloads: Sequence[torch.Tensor]) -> None:
        """Fill freshly allocated pages with fetched payloads (on the loop)."""
        self._write_pages(pages, torch.stack(list(payloads)))
        self.counters["loaded_pages"] += len(pages)
        self.counters["loaded_bytes"] += len(pages) * self.layout.page_bytes

    def forget(self, seq: Any) -> None:
        """A sequence left before its fetch was used."""
        self._fetches.pop(seq.seq_id, None)

    def _forget_known(self) -> None:
        """After an outage the store may have restarted empty: save again what it had."""
        with self._lock:
            self._known.clear()

    def attach_events(self, recorder: Any) -> None:
        """Publish the store's tier changes as KV events (``KVEventRecorder``):
        ``BlockStored`` without tokens (a location update, as vLLM's offloading
        reports one) or ``BlockRemoved``, with the tier's medium."""
        self._events = recorder
        self.connector.tier_listener = self._tier_changed

    def _tier_changed(self, kind: str, keys: Sequence[str], medium: str) -> None:
        with self._lock:
            hashes = [h for h in (self._key_hash.get(k) for k in keys) if h is not None]
        if not hashes:
            return
        if kind == "stored":
            self._events.stored(hashes, None, [], medium=medium)
        elif kind == "removed":
            self._events.removed(hashes, medium=medium)

    def remember(self, hashes: Sequence[int]) -> None:
        """Hashes the store holds (saved or loaded): not saved again."""
        with self._lock:
            for h in hashes:
                self._known[h] = None
                self._known.move_to_end(h)
            while len(self._known) > self._known_cap:
                self._known.popitem(last=False)

    # ---- worker side: saves -----------------------------------------------------------------

    def pages_computed(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(page, hash) pairs that became full this step."""
        if self.role != "kv_consumer":
            self._save_batch.extend(pairs)

    def end_step(self) -> None:
        """Read this step's new full pages and hand them to a save job."""
        batch, self._save_batch = self._save_batch, []
        seen: set[int] = set()
        todo = []
        with self._lock:
            known = [h in self._known for _, h in batch]
        for (page, h), k in zip(batch, known):
            if not k and h not in seen:
                seen.add(h)
                todo.append((page, h))
        if not todo:
            return
        self._pending_saves = [f for f in self._pending_saves if not f.done()]
        if len(self._pending_saves) >= self.max_pending_saves:
            self._fail("save_dropped", count_breaker=False)
            return
        if not self.breaker.allow():
            self.counters["skipped_open"] += 1
            return
        data = self.read_pages([p for p, _ in todo])  # on the loop: a copy of the pages as they are now
        hashes = [h for _, h in todo]
        self.remember(hashes)
        self._pending_saves.append(self._saves.submit(self._save, hashes, data))

    def _save(self, hashes: list[int], data: torch.Tensor) -> None:
        t0 = time.monotonic()
        try:
            staging = self._staging_area()
            keys = [make_key(self.layout, h) for h in hashes]
            if self._events is not None:
                with self._lock:
                    for key, h in zip(keys, hashes):
                        self._key_hash[key] = h
                        self._key_hash.move_to_end(key)
                    while len(self._key_hash) > self._known_cap:
                        self._key_hash.popitem(last=False)
            for start in range(0, len(keys), len(staging)):  # in chunks the staging area holds
                part = keys[start : start + len(staging)]
                for i, key in enumerate(part):
                    encode_value(self.layout, key, data[start + i], staging[i])
                self.connector.save(part, [staging[i] for i in range(len(part))])
        except Exception as exc:
            with self._lock:
                for h in hashes:
                    self._known.pop(h, None)
            self._fail("save_error")
            log.warning("KV connector save of %d pages failed: %s: %s", len(hashes), type(exc).__name__, exc)
            return
        dt = time.monotonic() - t0
        with self._lock:
            self.save_latency.observe(dt)
            self.counters["saved_pages"] += len(hashes)
            self.counters["saved_bytes"] += len(hashes) * self.layout.page_bytes
        if dt > self.deadline_s:
            self._fail("save_timeout")
        else:
            self.breaker.success()

    # ---- both ---------------------------------------------------------------------------

    def _fail(self, kind: str, *, count_breaker: bool = True) -> None:
        with self._lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1
        self._health_reason = kind
        if count_breaker:
            self.breaker.failure()

    def pending(self) -> bool:
        return bool(self._fetches)

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` for any fetch in flight (an otherwise idle step)."""
        futs = [j.future for j in self._fetches.values()]
        if futs:
            wait_futures(futs, timeout=timeout, return_when="FIRST_COMPLETED")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the saves in flight (tests, shutdown, a prefill instance
        handing off); True when none is left."""
        self.end_step()
        futs = [f for f in self._pending_saves if not f.done()]
        done, not_done = wait_futures(futs, timeout=timeout if timeout is not None else self.deadline_s)
        return not not_done

    def wait_saves(self, timeout: float | None = None) -> bool:
        """Wait for the save jobs already handed off (any thread may call
        this: a prefill instance answers only once the prompt's pages are
        in the store). True when none is left."""
        futs = [f for f in list(self._pending_saves) if not f.done()]
        if not futs:
            return True
        _, not_done = wait_futures(futs, timeout=timeout if timeout is not None else self.deadline_s)
        return not not_done

    def _maybe_probe(self) -> None:
        if self.breaker.state == "open" and (self._probe is None or self._probe.done()) and self.breaker.allow():
            self._probe = self._lookups.submit(self._run_probe)

    def _run_probe(self, startup: bool = False) -> None:
        t0 = time.monotonic()
        try:
            ok, why = self.connector.health()
        except Exception as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        took = time.monotonic() - t0
        if ok and took > self.deadline_s:
            # a store that answers only after the deadline fails every lookup
            # too: its late "ok" must not close the circuit (requests would
            # wait the deadline again, then reopen it)
            if startup:  # not found down at start-up either: the breaker stays as requests left it
                log.warning("KV connector: the store took %.1fs to answer the start-up probe (deadline %.1fs)", took, self.deadline_s)
                return
            ok, why = False, f"the store took {took:.1f}s to answer a health probe (deadline {self.deadline_s:.1f}s)"
        if ok:
            self.breaker.success()
        else:
            self._health_reason = why
            with self._lock:
                self.failures["unreachable"] = self.failures.get("unreachable", 0) + 1
            if startup:
                log.warning("KV connector: the store is not reachable at start-up (%s); serving without it until it is", why)
                self.breaker.trip()
            else:
                self.breaker.failure()

    def health(self) -> tuple[bool, str]:
        """(healthy, why not) without calling the store: the breaker's state."""
        self._maybe_probe()
        if self.breaker.state == "closed":
            return True, "ok"
        return False, f"circuit {self.breaker.state}: {self._health_reason}"

    def stats(self) -> dict[str, Any]:
        ok, why = self.health()
        with self._lock:
            return {
                **{f"kv_connector_{k}": v for k, v in self.counters.items()},
                "kv_connector_failures": dict(self.failures),
                "kv_connector_breaker_state": self.breaker.state,
                "kv_connector_breaker_opened": self.breaker.times_opened,
                "kv_connector_healthy": ok,
                "kv_connector_health": why,
                "kv_connector_load_latency": self.load_latency.snapshot(),
                "kv_connector_save_latency": self.save_latency.snapshot(),
                "kv_connector_wait_latency": self.wait_latency.snapshot(),
            }

    def close(self, timeout: float | None = None) -> bool:
        """Hand this step's full pages to a save, wait for every save in
        flight (at most ``timeout``, default the deadline; those not started
        by then are cancelled), stop this transfer's threads, close the
        connector. True when every save finished."""
        if self._closed.is_set():
            return True
        bound = time.monotonic() + (self.deadline_s if timeout is None else timeout)
        flushed = self.flush(timeout=max(0.0, bound - time.monotonic()))
        if not flushed:
            log.warning("KV connector: closing with saves still running after %.1fs; cancelling the rest", bound - time.monotonic())
        self._closed.set()
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self._saves.shutdown(wait=False, cancel_futures=True)
        # a store call in progress cannot be interrupted: its thread is waited
        # for up to the bound, then left (daemon) with a warning
        self._watcher.join(max(0.0, bound - time.monotonic()))
        for t in threading.enumerate():
            if t.name.startswith(self._thread_prefixes):
                t.join(max(0.0, bound - time.monotonic()))
                if t.is_alive():
                    log.warning("KV connector: thread %s still in a store call at close", t.name)
        try:
            self.connector.close()
        except Exception as exc:  # closing a dead store must not fail shutdown
            log.warning("KV connector close failed: %s", exc)
        return flushed


#: kv_connector_config keys the core reads (the rest go to the plugin)
CORE_OPTIONS = (
    "failure_policy", "kv_role", "deadline_s", "breaker_failures", "breaker_reset_s", "max_pending_saves",
    "max_pending_lookups", "staging_pages",
)


def build_kv_transfer(
    registry: Any,
    name: str,
    options: Mapping[str, Any],
    ctx: Any,
    runner: Any,
    *,
    model_id: str,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> KVTransfer:
    """Choose the connector plugin (a named one validates or fails loudly),
    describe the KV layout it stores, and wrap it in a KVTransfer."""
    entry = registry.select("kv_connector", name, ctx)
    cls = entry.load()
    shapes = runner.page_shapes()
    dtype = str(runner.dtype).removeprefix("torch.")
    ident = f"{model_id}|page_size={runner.page_size}|{dtype}|{shapes}|tp={tp_rank}/{tp_size}"
    page_bytes = runner.page_bytes()
    cfg = runner.cfg
    layout = KVLayout(
        model_id=model_id,
        fingerprint=hashlib.blake2b(ident.encode(), digest_size=12).hexdigest(),
        page_size=runner.page_size,
        page_bytes=page_bytes,
        value_bytes=HEADER_BYTES + page_bytes,
        dtype=dtype,
        num_kv_heads=max(1, cfg.num_kv_heads // tp_size),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    connector = cls(ctx, config=dict(options), layout=layout)
    transfer = KVTransfer(connector, layout, read_pages=runner.read_pages, write_pages=runner.write_pages, options=options)
    log.info(
        "KV connector %s: role %s, policy %s, deadline %.2fs, layout %s (%d bytes a page)",
        entry.label(), transfer.role, transfer.policy, transfer.deadline_s, layout.fingerprint, page_bytes,
    )
    return transfer


def connector_options(kv_connector: str | None, kv_connector_config: Mapping[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
    """plinth's own (``--kv-connector NAME --kv-connector-config JSON``) or
    vLLM's / LMDeploy's spelling (``{"kv_connector": NAME, "kv_role": ...,
    "kv_connector_extra_config": {...}}``) -> (name, options)."""
    opts = dict(kv_connector_config or {})
    extra = opts.pop("kv_connector_extra_config", None) or {}
    name = opts.pop("kv_connector", None) or kv_connector
    opts.update(extra)
    if name and kv_connector and name != kv_connector:
        raise ConfigError(f"--kv-connector {kv_connector} and kv_connector {name!r} in its config disagree")
    return name, opts
