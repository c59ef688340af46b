"""The ``mooncake`` KV connector: pages in Mooncake Store.

Configuration (the fields Mooncake's own vLLM/SGLang integrations use), from
``--kv-connector-config``, else the JSON file named by ``config_path`` or
``$MOONCAKE_CONFIG_PATH``:

* ``metadata_server``: e.g. ``http://127.0.0.1:8080/metadata`` (the master's
  built-in HTTP metadata server), or ``P2PHANDSHAKE``
* ``master_server_address``: ``host:port`` of ``mooncake_master``
* ``protocol``: ``tcp`` (default) or ``rdma``; ``device_name``: RDMA devices
* ``global_segment_size``, ``local_buffer_size``: what this client
  contributes to the store / uses for transfers (default 256 MiB / 128 MiB),
  bytes or a size string as Mooncake's own config reader takes it ("3GB",
  "512 mb", "1.5g")
* ``local_hostname``: the address peers fetch this client's segment from.
  Default: 127.0.0.1 when the master is on loopback, else the address of
  the interface that reaches the master (a loopback address would send
  peers on other hosts to their own machine)
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


#: mooncake-wheel/mooncake/mooncake_config.py:75-85 (_SIZE_SUFFIXES), tried in this order
SIZE_SUFFIXES = (
    ("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40),
    ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40), ("b", 1),
)  # fmt: skip


def parse_size(name: str, value: Any) -> int:
    """Bytes from an int or a size string, as Mooncake's config reader
    (mooncake_config.py:127 ``_parse_segment_size``) reads them: "3GB" is
    3 x 2^30, a bare number is bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"mooncake: {name} must be bytes or a size string like '3GB', not {value!r}")
    if isinstance(value, int):
        return value
    s = str(value).strip().lower()
    try:
        for suffix, multiplier in SIZE_SUFFIXES:
            if s.endswith(suffix):
                return int(float(s[: -len(suffix)].strip()) * multiplier)
        return int(float(s))
    except ValueError:
        raise ConfigError(f"mooncake: {name} must be bytes or a size string like '3GB', not {value!r}") from None


def _host(address: str) -> str:
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]")


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def route_to(address: str) -> str:
    """The local address of the interface that reaches ``host:port`` (a UDP
    connect sends nothing; the kernel only picks the route)."""
    host, _, port = address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host.strip("[]"), int(port or 9)))
        return s.getsockname()[0]


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
    cfg["global_segment_size"] = parse_size("global_segment_size", cfg.get("global_segment_size", 256 << 20))
    cfg["local_buffer_size"] = parse_size("local_buffer_size", cfg.get("local_buffer_size", 128 << 20))
    if not cfg.get("local_hostname"):
        master = str(cfg["master_server_address"])
        if _is_loopback(_host(master)):
            cfg["local_hostname"] = "127.0.0.1"
        else:
            try:
                cfg["local_hostname"] = route_to(master)
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"mooncake: local_hostname is not set and no interface reaches the master {master} ({exc}): "
                    "give local_hostname, the address peers on other hosts fetch this segment from"
                ) from None
            log.info("mooncake: local_hostname %s (the interface that reaches the master %s)", cfg["local_hostname"], master)
    elif _is_loopback(str(cfg["local_hostname"])) and not _is_loopback(_host(str(cfg["master_server_address"]))):
        raise ConfigError(
            f"mooncake: local_hostname {cfg['local_hostname']} is a loopback address but the master "
            f"{cfg['master_server_address']} is on another host: peers there would fetch this segment from themselves"
        )
    if cfg["protocol"] not in ("tcp", "rdma"):
        raise ConfigError(f"mooncake: protocol must be tcp or rdma, got {cfg['protocol']!r}")
    return cfg


#: one of the plugin's extras, each one distribution of the `mooncake` package
INSTALL_HINT = "pip install 'plinth-plugin-mooncake[tcp]', or [cuda] with CUDA; apt-get install libibverbs1"


def mooncake_distributions() -> list[str]:
    """The installed distributions that provide the ``mooncake`` package."""
    import importlib.metadata

    return sorted(set(importlib.metadata.packages_distributions().get("mooncake", [])))


class MooncakeConnector(KVConnector):
    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        if importlib.util.find_spec("mooncake") is None:
            return [f"mooncake is not installed ({INSTALL_HINT})"]
        owners = mooncake_distributions()
        if len(owners) > 1:  # one package written by two distributions: whichever came last holds its files
            return [f"two distributions provide the mooncake package ({' and '.join(owners)}): uninstall both, then {INSTALL_HINT}"]
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
        #: staging-area registrations made (one per core worker thread, again only when an area grows)
        self.registrations = 0

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

    # ---- zero copy: each core worker thread's staging area, registered at start-up and kept ----

    def register_buffer(self, buffer: Any) -> None:
        if not self.zero_copy:
            return
        store = self._client()
        old = self._regions.pop(threading.get_ident(), None)
        if old is not None:  # the core grew this thread's area: the old one is freed after this
            rc = store.unregister_buffer(old[0])
            if rc != 0:
                log.warning("mooncake: unregister_buffer returned %d", rc)
        addr, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        rc = store.register_buffer(addr, size)
        if rc != 0:  # -600 with the master dead: the core registers again at this thread's next call
            raise ConnectionError(f"mooncake: register_buffer returned {rc}")
        self._regions[threading.get_ident()] = (addr, size)
        self.registrations += 1

    def _registered(self, buffers: Sequence[Any]) -> bool:
        region = self._regions.get(threading.get_ident())
        if region is None:
            return False
        lo, hi = region[0], region[0] + region[1]
        return all(lo <= b.data_ptr() and b.data_ptr() + b.numel() <= hi for b in buffers)

    def load(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        store = self._client()
        if self._registered(buffers):
            got = store.batch_get_into(list(keys), [b.data_ptr() for b in buffers], [b.numel() for b in buffers])
            if got and got[0] < 0 and got[0] != OBJECT_NOT_FOUND:
                raise ConnectionError(f"mooncake: batch_get_into returned {got[0]}")
            return [int(n) if n > 0 else 0 for n in got]
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
        if self._registered(values):
            rcs = store.batch_put_from(list(keys), [v.data_ptr() for v in values], [v.numel() for v in values])
            failed = [r for r in rcs if r < 0 and r != OBJECT_ALREADY_EXISTS]
            if failed:
                raise ConnectionError(f"mooncake: batch_put_from failed for {len(failed)} of {len(rcs)} keys ({failed[0]})")
            return
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
