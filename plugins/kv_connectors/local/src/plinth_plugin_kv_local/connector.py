"""The ``local`` KV connector: a CPU-memory tier, then an optional disk tier.

Options (``--kv-connector-config``):

* ``cpu_bytes``: byte budget of the memory tier (default 1 GiB; 0 disables
  it); least recently used values are evicted first.
* ``disk_dir``: a directory for the disk tier (default: none). Values are
  files named by a digest of their key, written to a temporary name and
  renamed, so two engine processes on one host can share the directory
  (one writes while the other reads) and it survives restarts.
* ``disk_bytes``: byte budget of the disk tier (default 4 GiB); the least
  recently used files (by modification time: a read touches the file) go first.

Values are opaque bytes here: the core writes and checks their header (key,
model and layout identity, checksum), so a corrupt or foreign file is a miss.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np
from plinth.api import ConfigError, KVConnector, SelectionContext

#: vLLM's medium names for the tiers (``vllm/distributed/kv_events.py``), carried by their KV events
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


def _size(value: Any, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, str):
        units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
        v = value.strip().lower().removesuffix("b").removesuffix("i")
        if v and v[-1] in units:
            return int(float(v[:-1]) * units[v[-1]])
        return int(float(v))
    return int(value)


class LocalConnector(KVConnector):
    def __init__(self, ctx: SelectionContext, *, config: Any, layout: Any) -> None:
        super().__init__(ctx, config=config, layout=layout)
        try:
            self.cpu_bytes = _size(self.config.get("cpu_bytes"), 1 << 30)
            self.disk_bytes = _size(self.config.get("disk_bytes"), 4 << 30)
        except ValueError as exc:
            raise ConfigError(f"kv connector local: bad byte size: {exc}") from exc
        self.disk_dir: str | None = self.config.get("disk_dir")
        if self.disk_dir:
            os.makedirs(self.disk_dir, exist_ok=True)
        if self.cpu_bytes <= 0 and not self.disk_dir:
            raise ConfigError("kv connector local: cpu_bytes is 0 and no disk_dir is set: nothing can be stored")
        self._mem: OrderedDict[str, bytes] = OrderedDict()
        self._mem_used = 0
        self._lock = threading.Lock()
        self._disk_used: int | None = None  # measured on first use
        self._disk_keys: dict[str, str] = {}  # path -> key, for the files this process wrote (KV events)
        self.evictions = 0

    # ---- memory tier ---------------------------------------------------------------

    def _mem_put(self, key: str, data: bytes) -> None:
        if len(data) > self.cpu_bytes:
            return
        evicted = []
        with self._lock:
            old = self._mem.pop(key, None)
            if old is not None:
                self._mem_used -= len(old)
            self._mem[key] = data
            self._mem_used += len(data)
            while self._mem_used > self.cpu_bytes:
                gone_key, gone = self._mem.popitem(last=False)
                self._mem_used -= len(gone)
                self.evictions += 1
                evicted.append(gone_key)
        if old is None:
            self.report_tier("stored", [key], MEDIUM_CPU)
        self.report_tier("removed", evicted, MEDIUM_CPU)

    def _mem_get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._mem.get(key)
            if data is not None:
                self._mem.move_to_end(key)
            return data

    # ---- disk tier ---------------------------------------------------------------------

    def _path(self, key: str) -> str:
        assert self.disk_dir is not None  # the disk tier is on
        return os.path.join(self.disk_dir, hashlib.blake2b(key.encode(), digest_size=20).hexdigest() + ".kv")

    def _disk_put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if os.path.exists(path):
            return
        fd, tmp = tempfile.mkstemp(dir=self.disk_dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        with self._lock:
            if self._disk_used is not None:
                self._disk_used += len(data)
            self._disk_keys[path] = key
        self.report_tier("stored", [key], MEDIUM_STORAGE)
        self._evict_disk()

    def _evict_disk(self) -> None:
        with self._lock:
            if self._disk_used is not None and self._disk_used <= self.disk_bytes:
                return
        files = []
        for entry in os.scandir(self.disk_dir):
            if entry.name.endswith(".kv"):
                try:
                    st = entry.stat()
                except FileNotFoundError:  # another process evicted it
                    continue
                files.append((st.st_mtime, st.st_size, entry.path))
        used = sum(f[1] for f in files)
        files.sort()
        for _, size, path in files:
            if used <= self.disk_bytes:
                break
            try:
                os.unlink(path)
                self.evictions += 1
                gone = self._disk_keys.pop(path, None)
                if gone is not None:
                    self.report_tier("removed", [gone], MEDIUM_STORAGE)
            except FileNotFoundError:
                pass
            used -= size
        with self._lock:
            self._disk_used = used

    def _disk_get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)  # recently used: evicted last
            return data
        except FileNotFoundError:
            return None

    # ---- the contract ----------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> int:
        n = 0
        for key in keys:
            with self._lock:
                held = key in self._mem
            if not held and not (self.disk_dir and os.path.exists(self._path(key))):
                break
            n += 1
        return n

    def load(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        sizes = []
        for key, buf in zip(keys, buffers):
            data = self._mem_get(key) if self.cpu_bytes > 0 else None
            if data is None and self.disk_dir:
                data = self._disk_get(key)
                if data is not None and self.cpu_bytes > 0:
                    self._mem_put(key, data)
            if data is None:
                sizes.append(0)
                continue
            view = buf.numpy()
            n = min(len(data), view.nbytes)
            view[:n] = np.frombuffer(data, dtype=np.uint8, count=n)
            sizes.append(len(data))
        return sizes

    def save(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        for key, value in zip(keys, values):
            data = value.numpy().tobytes()
            if self.cpu_bytes > 0:
                self._mem_put(key, data)
            if self.disk_dir:
                self._disk_put(key, data)

    def health(self) -> tuple[bool, str]:
        if self.disk_dir and not os.access(self.disk_dir, os.W_OK):
            return False, f"{self.disk_dir} is not writable"
        return True, "ok"

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"cpu_values": len(self._mem), "cpu_bytes_used": self._mem_used, "evictions": self.evictions}
