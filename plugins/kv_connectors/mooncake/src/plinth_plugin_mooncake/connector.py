"""The ``mooncake`` KV connector: pages in Mooncake Store.

Configuration (the fields Mooncake's own vLLM/SGLang integrations use), from
``--kv-connector-config``, else the JSON file named by ``config_path`` or
``$MOONCAKE_CONFIG_PATH``:

* ``metadata_server``: e.g. ``http://127.0.0.1:8080/metadata`` (the master's
  built-in HTTP metadata server), or ``P2PHANDSHAKE``
* ``master_server_address``: ``host:port`` of ``mooncake_master``
* ``protocol``: ``tcp`` (default) or ``rdma``; ``device_name``: RDMA devices
* ``global_segment_size``, ``local_buffer_size``: bytes this client
  contributes to the store / uses for transfers (default 256 MiB / 128 MiB)
* ``local_hostname``: this client's address (default 127.0.0.1)
* ``zero_copy`` (default true): move values with ``batch_get_into`` /
  ``batch_put_from`` straight between the store and the core's staging
  buffers, registered with the transfer engine (``register_buffer``); false:
  ``get_batch`` / ``put_batch`` through Python bytes (two more copies)

Mooncake answers with return codes, and a dead master makes each call block
for seconds (see the project's FACTS): the core calls this class only off the
step loop, under a deadline and a circuit breaker, so here a failure just
raises. The client connects lazily and reconnects by itself: a store that is
down at start-up is a degraded server, not a failed start.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import threading
import time
from typing import Any, Sequence
from urllib.parse import urlsplit

from plinth.api import ConfigError, KVConnector, SelectionContext

log = logging.getLogger("plinth.kv_connector.mooncake")

#: Mooncake Store error codes (mooncake-store/include/types.h)
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705

FIELDS = (
    "metadata_server", "master_server_address", "protocol", "device_name", "global_segment_size",
    "local_buffer_size", "local_hostname",
)


def load_config(options: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    path = options.get("config_path") or os.environ.get("MOONCAKE_CONFIG_PATH")
    if path:
        try:
            with open(path) as f:
                cfg.update(json.load(f))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"mooncake: cannot read the config file {path}: {exc}") from exc
    cfg.update({k: v for k, v in options.items() if k in FIELDS})
    missing = [k for k in ("metadata_server", "master_server_address") if not cfg.get(k)]
    if missing:
        raise ConfigError(
            f"mooncake: {', '.join(missing)} not set (give them in --kv-connector-config, a JSON file "
            "named by config_path or $MOONCAKE_CONFIG_PATH)"
        )
    cfg.setdefault("protocol", "tcp")
    cfg.setdefault("device_name", "")
    cfg.setdefault("global_segment_size", 256 << 20)
    cfg.setdefault("local_buffer_size", 128 << 20)
    cfg.setdefault("local_hostname", "127.0.0.1")
    if cfg["protocol"] not in ("tcp", "rdma"):
        raise ConfigError(f"mooncake: protocol must be tcp or rdma, got {cfg['protocol']!r}")
    return cfg


class MooncakeConnector(KVConnector):
    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        if importlib.util.find_spec("mooncake") is None:
            return ["mooncake is not installed (pip install mooncake-transfer-engine-non-cuda; apt-get install libibverbs1)"]
        return []

    def __init__(self, ctx: SelectionContext, *, config: Any, layout: Any) -> None:
        super().__init__(ctx, config=config, layout=layout)
        self.store_config = load_config(self.config)
        deadline = float(self.config.get("deadline_s", 2.0))
        # bound every client RPC as far as the client lets us (see FACTS: a dead master still blocks ~4 s)
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(100, int(deadline * 1000))))
        if self.store_config["protocol"] == "tcp" and self.store_config["local_hostname"] in ("127.0.0.1", "localhost"):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        try:
            from mooncake.store import MooncakeDistributedStore  # imported only when chosen
        except ImportError as exc:  # a missing libibverbs.so.1 shows here
            raise ConfigError(f"mooncake: cannot import mooncake.store: {exc} (apt-get install libibverbs1)") from exc
        self._cls = MooncakeDistributedStore
        self._store: Any = None
        self._lock = threading.Lock()
        self._last_attempt = 0.0
        self.zero_copy = str(self.config.get("zero_copy", True)).lower() not in ("0", "false", "no")
        #: staging areas registered with the transfer engine: thread id -> (address, bytes)
        self._regions: dict[int, tuple[int, int]] = {}

    def _client(self) -> Any:
        with self._lock:
            if self._store is not None:
                return self._store
            now = time.monotonic()
            if now - self._last_attempt < 0.5:
                raise ConnectionError("mooncake: not connected (retrying)")
            self._last_attempt = now
            c = self.store_config
            self._reachable()
            store = self._cls()
            rc = store.setup(
                c["local_hostname"], c["metadata_server"], int(c["global_segment_size"]), int(c["local_buffer_size"]),
                c["protocol"], c["device_name"], c["master_server_address"],
            )
            if rc != 0:
                raise ConnectionError(f"mooncake: setup with master {c['master_server_address']} returned {rc}")
            log.info("mooncake: connected to master %s", c["master_server_address"])
            self._store = store
            return store

    def _reachable(self) -> None:
        """Fail fast when the master (or its HTTP metadata server) refuses a
        TCP connection: ``setup()`` against a dead master retries for about
        90 s (20 tries of ~4.4 s) while holding the client lock."""
        c = self.store_config
        targets = [c["master_server_address"]]
        meta = str(c["metadata_server"])
        if meta.startswith(("http://", "https://")):
            targets.append(urlsplit(meta).netloc)
        for target in targets:
            host, _, port = str(target).rpartition(":")
            try:
                socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=0.5).close()
            except (OSError, ValueError) as exc:
                raise ConnectionError(f"mooncake: {target} does not answer: {exc}") from None

    def lookup(self, keys: Sequence[str]) -> int:
        found = self._client().batch_is_exist(list(keys))
        n = 0
        for r in found:
            if r < 0:
                if n == 0:
                    raise ConnectionError(f"mooncake: batch_is_exist returned {r}")
                break
            if r != 1:
                break
            n += 1
        return n

    # ---- zero copy: the core's staging area registered for the call that follows on this thread ----

    def register_buffer(self, buffer: Any) -> None:
        if not self.zero_copy:
            return
        store = self._client()
        addr, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        rc = store.register_buffer(addr, size)
        if rc != 0:
            log.warning("mooncake: register_buffer returned %d; this call copies through bytes", rc)
            return
        self._regions[threading.get_ident()] = (addr, size)

    def _registered(self, buffers: Sequence[Any]) -> tuple[int, int] | None:
        region = self._regions.get(threading.get_ident())
        if region is None:
            return None
        lo, hi = region[0], region[0] + region[1]
        for b in buffers:
            if not (lo <= b.data_ptr() and b.data_ptr() + b.numel() <= hi):
                return None
        return region

    def _unregister(self, store: Any) -> None:
        region = self._regions.pop(threading.get_ident(), None)
        if region is not None:
            rc = store.unregister_buffer(region[0])  # the core frees the staging area after this call
            if rc != 0:
                log.warning("mooncake: unregister_buffer returned %d", rc)

    def load(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        store = self._client()
        if self._registered(buffers) is not None:
            try:
                got = store.batch_get_into(list(keys), [b.data_ptr() for b in buffers], [b.numel() for b in buffers])
            finally:
                self._unregister(store)
            if got and got[0] < 0 and got[0] != OBJECT_NOT_FOUND:
                raise ConnectionError(f"mooncake: batch_get_into returned {got[0]}")
            return [int(n) if n > 0 else 0 for n in got]
        self._unregister(store)
        return self._load_bytes(store, keys, buffers)

    def _load_bytes(self, store: Any, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        import numpy as np

        values = store.get_batch(list(keys))
        sizes = []
        for v, buf in zip(values, buffers):
            if not v:
                sizes.append(0)
                continue
            view = buf.numpy()
            n = min(len(v), view.nbytes)
            view[:n] = np.frombuffer(v, dtype=np.uint8, count=n)
            sizes.append(len(v))
        return sizes

    def save(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        store = self._client()
        if self._registered(values) is not None:
            try:
                rcs = store.batch_put_from(list(keys), [v.data_ptr() for v in values], [v.numel() for v in values])
            finally:
                self._unregister(store)
            failed = [r for r in rcs if r < 0 and r != OBJECT_ALREADY_EXISTS]
            if failed:
                raise ConnectionError(f"mooncake: batch_put_from failed for {len(failed)} of {len(rcs)} keys ({failed[0]})")
            return
        self._unregister(store)
        rc = store.put_batch(list(keys), [v.numpy().tobytes() for v in values])
        if rc < 0:
            raise ConnectionError(f"mooncake: put_batch returned {rc}")

    def health(self) -> tuple[bool, str]:
        store = self._client()
        rc = store.health_check()
        if rc != 0:
            return False, f"mooncake: health_check returned {rc}"
        probe = store.is_exist("plinth/health")
        if probe < 0:
            return False, f"mooncake: the master does not answer ({probe})"
        return True, "ok"

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            threading.Thread(target=store.close, daemon=True).start()  # close() on a dead master takes ~9 s
