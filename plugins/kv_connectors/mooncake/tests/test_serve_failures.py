"""`platform serve --kv-connector mooncake` with a real mooncake_master on
127.0.0.1, over HTTP (real server processes, the official openai client):

* the master is not running when two servers start: both start, /health says
  degraded with the connector's reason, requests complete by recompute; the
  master comes up and both attach by themselves (no request needed);
* instance A's pages are loaded by instance B (external cached tokens);
* the master is SIGKILLed during a concurrent stream of requests: every one
  completes with the output of a server without a store; the server's own
  histogram says no admission waited on the store beyond the deadline plus a
  step (2.5 s), and no request hangs (wall clock: twice the slowest request
  of the same stream just before, the store up, plus the deadline and 5 s:
  this machine's load alone moves those times 3x);
* the master restarts (empty): the servers recover and hits resume.
"""

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "tests"))
from kv_servers import metric, serve  # noqa: E402
from tiny_models import tiny_model_dir  # noqa: E402

openai = pytest.importorskip("openai")

DEADLINE = 1.0
SHARED = [(i * 37) % 250 + 1 for i in range(160)]  # 10 pages of 16


def _prefix(seed):
    return [(i * 53 + seed * 101) % 250 + 1 for i in range(96)]  # 6 pages of its own


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _complete(url, prompt):
    t = time.monotonic()
    r = _client(url).completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens, time.monotonic() - t


def _wait(cond, timeout, what):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what() if callable(what) else what} within {timeout}s")
        time.sleep(0.2)


def _stream(url, prompts):
    """Concurrent requests, 4 at a time: (text, cached, seconds) each."""
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda p: _complete(url, p), prompts))


def test_store_down_at_start_killed_mid_stream_and_restarted(tiny_root, master_down, tmp_path):
    model = tiny_model_dir("llama", tiny_root)
    m = master_down
    # (pages computed while the store is down are not saved later: A's second prompt has a prefix of its own)
    first = [SHARED + [1, 2], _prefix(30) + [3, 4], _prefix(30) + [5, 6], SHARED + [7, 8]]
    stream = [_prefix(i) + [i] for i in range(8)]
    # after the restart: up to three fresh prefixes, each asked of A then of B
    after = [(_prefix(50 + j) + [1], _prefix(50 + j) + [2]) for j in range(3)]

    ref = serve(model, str(tmp_path / "ref.log"))
    try:
        want = {json.dumps(p): _complete(ref.url, p)[0] for p in first + stream + [q for pair in after for q in pair]}
    finally:
        ref.stop()

    cfg = {**m.config, "deadline_s": DEADLINE, "breaker_failures": 1, "breaker_reset_s": 0.5}
    a = serve(model, str(tmp_path / "a.log"), connector="mooncake", config=cfg, wait_s=60)
    b = serve(model, str(tmp_path / "b.log"), connector="mooncake", config=cfg, wait_s=60)
    try:
        # 1. no master: started, degraded, requests recompute
        for s in (a, b):
            h = s.health()
            assert h["status"] == "degraded" and "mooncake" in h["kv_connector"], h
        text, cached, _ = _complete(a.url, first[0])
        assert text == want[json.dumps(first[0])] and cached == 0
        assert metric(a.metrics(), "plinth:kv_connector_failures_total", kind="unreachable") >= 1
        assert metric(a.metrics(), "plinth:kv_connector_breaker_state", state="closed") == 0

        # 2. the master comes up: both attach by themselves
        m.start()
        for s in (a, b):
            _wait(lambda s=s: s.health()["status"] == "ok", 30, f"{s.url} attached")

        # 3. A computes and saves, B loads
        text, cached, _ = _complete(a.url, first[1])
        assert text == want[json.dumps(first[1])]
        _wait(lambda: metric(a.metrics(), "plinth:kv_connector_saved_pages_total") >= 6, 20, "A saved its pages")
        text, cached, _ = _complete(b.url, first[2])
        assert text == want[json.dumps(first[2])]
        assert cached == 96
        assert metric(b.metrics(), "plinth:prefix_cache_external_hit_tokens_total") == 96

        # 4. SIGKILL during a concurrent stream (each prompt has a prefix of its own: every request asks the
        # store); "normal" is the slowest request of the same stream on B just before, the store up
        normal = max(t for _, _, t in _stream(b.url, [_prefix(60 + i) + [i] for i in range(8)]))
        killer = threading.Timer(0.3, m.kill)
        killer.start()
        results = _stream(b.url, stream)
        killer.join()
        assert m.proc.poll() is not None
        # measured in the server first (independent of how loaded this machine is): no
        # admission waited on the store beyond the deadline plus a step (the 2.5 s bucket)
        mb = b.metrics()
        waits = metric(mb, "plinth:kv_connector_wait_latency_seconds_count")
        late = waits - metric(mb, "plinth:kv_connector_wait_latency_seconds_bucket", le="2.5")
        assert waits >= len(stream) and late == 0, f"{late:.0f} of {waits:.0f} admissions waited > 2.5 s on the store"
        # and no hang end to end. Wall-clock times on a shared 2-core machine move with its load, not
        # with the store: two loaded runs (load average ~20) had the stream before the kill at 1.37 s and
        # the one after at 3.8-4.8 s; then 6.6 s and 3.0-9.5 s, while the server's histogram had no
        # admission waiting > 2.5 s and its log no deadline timeout. So the bound is twice the stream
        # before plus the deadline plus 5 s, not normal + deadline + 1 s.
        bound = 2 * normal + DEADLINE + 5.0
        for p, (text, _cached, took) in zip(stream, results):
            assert text == want[json.dumps(p)]
            assert took < bound, f"took {[round(r[2], 2) for r in results]}s (the same stream, store up: {normal:.2f}s)"
        # later requests, on both servers, still complete promptly
        for s, p in ((a, first[3]), (b, first[3])):
            text, _, took = _complete(s.url, p)
            assert text == want[json.dumps(p)] and took < bound, f"{took:.2f}s (the same stream, store up: {normal:.2f}s)"
        mb = b.metrics()
        assert sum(v for k, v in mb.items() if k.startswith("plinth:kv_connector_failures_total")) >= 1
        _wait(lambda: b.health()["status"] == "degraded", 15, "B degraded")

        # 5. restarted (empty): both recover, A saves again, B's hits resume
        m.start()
        for s in (a, b):
            _wait(lambda s=s: s.health()["status"] == "ok", 30, f"{s.url} recovered")
        # saves and loads are best effort: one made while a client is still re-mounting (A's segment, or
        # B's view of the new master) may be dropped or miss (never wrong, only a recompute), so a fresh
        # prefix is tried again, at most three, 10 s each
        def connector_counters(s):
            return {k: v for k, v in s.metrics().items() if "kv_connector" in k and "latency" not in k}

        for j, (on_a, on_b) in enumerate(after):
            saved = metric(a.metrics(), "plinth:kv_connector_saved_pages_total")
            text, _, _ = _complete(a.url, on_a)
            assert text == want[json.dumps(on_a)]
            try:
                _wait(lambda saved=saved: metric(a.metrics(), "plinth:kv_connector_saved_pages_total") >= saved + 6, 10, "A saved")
            except AssertionError:
                if j == len(after) - 1:
                    raise AssertionError(f"A never saved again after the restart ({connector_counters(a)})") from None
                continue
            text, cached, _ = _complete(b.url, on_b)
            assert text == want[json.dumps(on_b)]
            if cached == 96:
                break
            assert j < len(after) - 1, f"B never loaded A's pages after the restart: {cached} cached ({connector_counters(b)})"
    finally:
        a.stop()
        b.stop()
