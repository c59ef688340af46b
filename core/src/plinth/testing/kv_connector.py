"""KV-connector conformance: save / lookup / load round trips through the
core's own transfer layer, corrupt, truncated and foreign values rejected,
and a store that raises or stalls never stalling the caller.

    from plinth.testing import check_kv_connector
    check_kv_connector("local", config={"disk_dir": "/tmp/kv"})

The checks drive the plugin exactly as the engine does (``KVTransfer``: store
calls on its threads, a deadline, a circuit breaker, the value header), over
a small random "KV cache" of pages in CPU memory.
"""

from __future__ import annotations

import itertools
import random
import time
from types import SimpleNamespace
from typing import Any, Mapping

from plinth.api import KVConnector
from plinth.testing._report import Report
from plinth.testing.registration import discover_all

_ids = itertools.count(1_000_000)


def kv_test_layout(*, page_bytes: int = 4096, page_size: int = 4, fingerprint: str | None = None) -> Any:
    """A layout for tests (its own fingerprint: never mixes with a real model's)."""
    from plinth.api import KVLayout
    from plinth.engine.kv_transfer import HEADER_BYTES

    fp = fingerprint or f"conformance{random.getrandbits(48):012x}"
    return KVLayout(
        model_id="conformance", fingerprint=fp, page_size=page_size, page_bytes=page_bytes,
        value_bytes=HEADER_BYTES + page_bytes, dtype="uint8", num_kv_heads=1,
    )


def kv_value_bytes(page_bytes: int) -> int:
    """The bytes a connector stores for one page of ``page_bytes``: the
    header the core writes and checks, then the page."""
    from plinth.engine.kv_transfer import HEADER_BYTES

    return HEADER_BYTES + page_bytes


def kv_key(layout: Any, page_hash: int) -> str:
    """The store key the core uses for the page with chained hash
    ``page_hash`` under ``layout``."""
    from plinth.engine.kv_transfer import make_key

    return make_key(layout, page_hash)


class _Pages:
    """A tiny KV cache: pages of random bytes."""

    def __init__(self, num_pages: int, page_bytes: int, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8, generator=g)

    def read(self, pages: Any) -> Any:
        return self.data[list(pages)].clone()

    def write(self, pages: Any, values: Any) -> None:
        self.data[list(pages)] = values


class _Faulty(KVConnector):
    """Wraps a connector: every store call raises, or stalls for ``stall_s``."""

    def __init__(self, inner: Any, mode: str, stall_s: float = 2.0) -> None:
        # no KVConnector.__init__: every call goes to ``inner``
        self.inner, self.mode, self.stall_s = inner, mode, stall_s

    def _fault(self) -> None:
        if self.mode == "raise":
            raise ConnectionError("injected store failure")
        time.sleep(self.stall_s)

    def lookup(self, keys: Any) -> int:
        self._fault()
        return self.inner.lookup(keys)

    def load(self, keys: Any, buffers: Any) -> Any:
        self._fault()
        return self.inner.load(keys, buffers)

    def save(self, keys: Any, values: Any) -> None:
        self._fault()
        self.inner.save(keys, values)

    def register_buffer(self, buffer: Any) -> None:
        self.inner.register_buffer(buffer)

    def health(self) -> tuple[bool, str]:
        self._fault()
        return self.inner.health()

    def close(self) -> None:
        pass


def _seq() -> Any:
    i = next(_ids)
    return SimpleNamespace(seq_id=i, request=SimpleNamespace(request_id=f"conformance-{i}"))


def fetch(transfer: Any, hashes: list[int], first: int = 0, timeout: float = 30.0) -> tuple[list[Any], float]:
    """Poll ``transfer.lookup`` like admission does, until it answers; the
    payloads and the longest single call's duration."""
    seq = _seq()
    end = time.monotonic() + timeout
    longest = 0.0
    while True:
        t = time.monotonic()
        got = transfer.lookup(seq, first, hashes)
        longest = max(longest, time.monotonic() - t)
        if got is not None:
            return got, longest
        if time.monotonic() > end:
            raise TimeoutError("lookup never answered")
        transfer.wait(0.01)


def check_kv_connector(
    name: str,
    *,
    config: Mapping[str, Any] | None = None,
    make: Any = None,
    deadline_s: float = 0.5,
    num_pages: int = 16,
    page_bytes: int = 4096,
) -> Report:
    """The KV-connector contract of the plugin registered as ``name``
    (``make(layout) -> connector`` overrides how it is built)."""
    import torch

    from plinth.api import KVConnector, SelectionContext
    from plinth.engine.kv_transfer import KVTransfer, make_key

    report = Report(f"kv_connector {name}")
    if make is None:
        cls = discover_all().get("kv_connector", name).load()
        report.expect(issubclass(cls, KVConnector), "the implementation subclasses KVConnector")

        def build(layout: Any) -> Any:
            return cls(SelectionContext(), config=dict(config or {}), layout=layout)

        make = build

    layout = kv_test_layout(page_bytes=page_bytes)
    src = _Pages(num_pages, page_bytes, seed=1)
    dst = _Pages(num_pages, page_bytes, seed=2)
    conn = make(layout)
    opts = {"deadline_s": deadline_s, "breaker_failures": 2, "breaker_reset_s": 0.3}
    saver = KVTransfer(conn, layout, read_pages=src.read, write_pages=dst.write, options=opts)
    hashes = [random.getrandbits(63) for _ in range(6)]

    # 1. save, then lookup + load through a second transfer over the same store
    saver.pages_computed(list(zip(range(6), hashes)))
    report.expect(saver.flush(timeout=30), "saves finish")
    report.expect(saver.counters["saved_pages"] == 6, "six pages saved", f"saved {saver.counters['saved_pages']}, failures {saver.failures}")
    reader = KVTransfer(conn, layout, read_pages=dst.read, write_pages=dst.write, options=opts)
    got, _ = fetch(reader, hashes)
    if report.expect(len(got) == 6, "lookup + load finds the six saved pages", f"found {len(got)}: {reader.failures}"):
        reader.write_pages(list(range(6)), got)
        report.expect(bool(torch.equal(dst.data[:6], src.data[:6])), "loaded pages equal the saved ones byte for byte")

    # 2. only the leading run counts
    gap = hashes[:2] + [random.getrandbits(63)] + hashes[3:]
    got, _ = fetch(reader, gap)
    report.expect(len(got) == 2, "a gap ends the lookup (a prefix only)", f"got {len(got)}")
    got, _ = fetch(reader, hashes[2:], first=2)
    report.expect(len(got) == 4, "a lookup from the middle of a chain", f"got {len(got)}")

    # 3. corrupt, truncated and foreign values are misses
    bad = [random.getrandbits(63) for _ in range(3)]
    vb = layout.value_bytes
    staging = torch.zeros(3, vb, dtype=torch.uint8)
    from plinth.engine.kv_transfer import encode_value

    other = kv_test_layout(page_bytes=page_bytes)  # another model's layout
    for i, h in enumerate(bad):
        encode_value(other if i == 2 else layout, make_key(layout, h), src.data[i], staging[i])
    staging[0, vb - 1] ^= 0xFF  # one flipped bit of payload
    values = [staging[0], staging[1][: vb // 2].clone(), staging[2]]
    conn.register_buffer(staging)
    conn.save([make_key(layout, h) for h in bad], values)
    for i, kind in enumerate(("corrupt", "truncated", "foreign")):
        before = dst.data.clone()
        got, _ = fetch(reader, [bad[i]])
        report.expect(got == [], f"a {kind} value is a miss", f"got {len(got)} pages")
        report.expect(reader.failures.get(kind, 0) >= 1, f"a {kind} value is counted", str(reader.failures))
        report.expect(bool(torch.equal(before, dst.data)), f"a {kind} value never reaches a page")

    # 4. a store that raises or stalls never stalls the caller
    for mode in ("raise", "stall"):
        faulty = KVTransfer(_Faulty(make(layout), mode, stall_s=deadline_s * 4), layout, read_pages=src.read, write_pages=dst.write, options=opts)
        t0 = time.monotonic()
        got, longest = fetch(faulty, hashes)
        waited = time.monotonic() - t0
        report.expect(got == [], f"a store that {mode}s: the lookup misses")
        report.expect(longest < 0.1, f"a store that {mode}s: no call blocks the caller", f"longest call {longest:.3f}s")
        report.expect(waited < deadline_s + 0.5, f"a store that {mode}s: answered within the deadline", f"{waited:.2f}s")
        fetch(faulty, [random.getrandbits(63)])  # a second failure opens the circuit
        report.expect(faulty.breaker.state == "open", f"a store that {mode}s: the circuit opens", faulty.breaker.state)
        got, longest = fetch(faulty, hashes)
        report.expect(got == [] and longest < 0.1, f"a store that {mode}s: with the circuit open, lookups miss at once")
        report.expect(not faulty.health()[0], f"a store that {mode}s: health says degraded")
        faulty.close()

    # 5. health answers
    try:
        ok, why = conn.health()
        report.expect(ok, "health() of a working store is ok", why)
    except Exception as exc:
        report.problem(f"health() raised {type(exc).__name__}: {exc}")
    saver.close()
    return report.raise_for_problems()
