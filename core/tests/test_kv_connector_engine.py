"""The engine with a KV connector, on the toy model (every output depends on
reading its pages right): reuse across engines, corrupt values, a store that
fails or stalls, the fail policy, and the counters."""

import threading
import time

import pytest
from plinth.api import KVConnector
from plinth.engine.sampling_params import SamplingParams
from toy_engine import reference, run_all, toy_engine

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


class DictStore:
    """A real in-process store: a dict shared by every connector made from it."""

    def __init__(self):
        self.values = {}
        self.lock = threading.Lock()
        self.mode = "ok"  # "raise" | "stall"
        self.stall_s = 3.0  # how long a stalled call takes before it answers
        self.calls = 0
        #: register_buffer calls: (thread, first address, bytes); and load/save
        #: calls whose buffers were not in their thread's registered area
        self.registrations: list[tuple[int, int, int]] = []
        self.unregistered_calls = 0

    def connector(self, layout):
        store = self

        class DictConnector(KVConnector):
            def _fault(self):
                store.calls += 1
                if store.mode == "raise":
                    raise ConnectionError("store down")
                if store.mode == "stall":
                    time.sleep(store.stall_s)

            def register_buffer(self, buffer):
                store.registrations.append((threading.get_ident(), buffer.data_ptr(), buffer.numel()))

            def _check_registered(self, buffers):
                area = [(p, n) for t, p, n in store.registrations if t == threading.get_ident()][-1:]
                if not area or not all(area[0][0] <= b.data_ptr() and b.data_ptr() + b.numel() <= sum(area[0]) for b in buffers):
                    store.unregistered_calls += 1

            def lookup(self, keys):
                self._fault()
                n = 0
                with store.lock:
                    while n < len(keys) and keys[n] in store.values:
                        n += 1
                return n

            def load(self, keys, buffers):
                self._fault()
                self._check_registered(buffers)
                out = []
                for k, b in zip(keys, buffers):
                    with store.lock:
                        v = store.values.get(k)
                    if v is None:
                        out.append(0)
                        continue
                    b[: len(v)] = v[: b.numel()]
                    out.append(len(v))
                return out

            def save(self, keys, values):
                self._fault()
                self._check_registered(values)
                with store.lock:
                    for k, v in zip(keys, values):
                        store.values[k] = v.clone()

            def health(self):
                self._fault()
                return True, "ok"

        return DictConnector(None, config={}, layout=layout)


def _engine(store, **opts):
    options = {"deadline_s": 0.3, "breaker_failures": 2, "breaker_reset_s": 0.2, **opts}
    return toy_engine(page_size=4, num_pages=128, connector=store.connector, connector_options=options)


def _run(engine, rid, prompt, params=PARAMS):
    engine.add_request(rid, prompt, params)
    out = run_all(engine)[rid]
    engine.kv.connector.flush(5)
    return out


PROMPT = list(range(1, 43))  # 42 tokens: 10 full pages


def _unshared(i: int) -> list[int]:
    """A prompt of PROMPT's length that shares no page with PROMPT or with
    _unshared(j), j != i: each request's lookup is its own (a shared prefix
    would be found in the local prefix cache once the first request computed
    it, so only that request would wait on the store)."""
    return [(t + 5 * (i + 1)) % 96 + 1 for t in PROMPT] + [i + 2]


def test_second_engine_loads_pages_instead_of_computing():
    store = DictStore()
    a, b = _engine(store), _engine(store)
    first = _run(a, "a", PROMPT + [5])
    assert first.num_cached_tokens == 0 and len(store.values) == 12  # 43 + 5 computed tokens: 12 full pages
    second = _run(b, "b", PROMPT + [7, 8])
    assert second.outputs[0].token_ids == reference(PROMPT + [7, 8], 6, eos=False)
    assert second.num_cached_tokens == 40 and second.num_external_cached_tokens == 40
    s = b.stats()
    assert s["prefix_cache_external_hit_tokens"] == 40 and s["prefix_cache_local_hit_tokens"] == 0
    assert s["kv_connector_loaded_pages"] == 10 and s["kv_connector_healthy"]
    # a third request on b: its local prefix cache now holds them
    third = _run(b, "c", PROMPT + [9])
    assert third.num_cached_tokens == 40 and third.num_external_cached_tokens == 0
    assert b.pages_held() == 0


def test_staging_areas_are_registered_at_start_up_and_reused_in_chunks():
    """Each worker thread (2 loading, 1 saving) registers its staging area
    once, when the engine starts, before any request; every load and save
    then lies in its thread's area, 10 pages going through 4-page areas in
    chunks, and the pages loaded are right."""
    store = DictStore()
    a = _engine(store, staging_pages=4)
    deadline = time.monotonic() + 10
    # the registrations and the start-up probe (submitted to the lookup pool) run on their own threads
    while (len(store.registrations) < 3 or store.calls < 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(store.registrations) == 3 and len({t for t, _, _ in store.registrations}) == 3
    assert store.calls == 1  # only the start-up probe has called the store
    _run(a, "a", PROMPT + [5])  # 12 pages saved
    b = _engine(store, staging_pages=4)
    out = _run(b, "b", PROMPT + [7, 8])  # 10 pages loaded, in chunks of 4
    assert out.num_external_cached_tokens == 40
    assert out.outputs[0].token_ids == reference(PROMPT + [7, 8], 6, eos=False)
    assert len(store.values) == 12 + 2 and len(store.registrations) == 6  # b saved its own 2 pages; its three areas, at its start
    assert store.unregistered_calls == 0
    for engine in (a, b):
        engine.kv.connector.close(1.0)


def test_corrupt_value_is_a_miss_and_output_stays_right():
    store = DictStore()
    a, b = _engine(store), _engine(store)
    _run(a, "a", PROMPT + [5])
    keys = list(store.values)  # in chain order
    store.values[keys[3]][-1] ^= 0xFF  # one bit of the 4th page
    out = _run(b, "b", PROMPT + [6])
    assert out.outputs[0].token_ids == reference(PROMPT + [6], 6, eos=False)
    assert out.num_external_cached_tokens == 12  # the three pages before the corrupt one
    assert b.stats()["kv_connector_failures"].get("corrupt") == 1
    assert b.stats()["kv_connector_recomputed_tokens"] == 7 * 4  # the store held 10 usable pages


@pytest.mark.parametrize("mode", ["raise", "stall"])
def test_failing_store_never_holds_requests_beyond_the_deadline(mode):
    store = DictStore()
    a = _engine(store)
    _run(a, "warm", PROMPT + [1])
    store.mode = mode
    b = _engine(store)
    t0 = time.monotonic()
    outs = []
    for i in range(4):
        b.add_request(f"r{i}", _unshared(i), PARAMS)
    done = run_all(b)
    took = time.monotonic() - t0
    for i in range(4):
        assert done[f"r{i}"].outputs[0].token_ids == reference(_unshared(i), 6, eos=False)
        assert done[f"r{i}"].num_external_cached_tokens == 0
        outs.append(done[f"r{i}"])
    assert took < 0.3 + 1.0, f"requests waited {took:.2f}s on a broken store"
    s = b.stats()
    # a raising store is already found down by the start-up probe (unreachable: no lookup is tried)
    kinds = ("timeout",) if mode == "stall" else ("error", "unreachable")
    assert sum(s["kv_connector_failures"].get(k, 0) for k in kinds) >= 1, s["kv_connector_failures"]
    if mode == "stall":  # each admission waited on the store about the deadline, never much more
        waits = s["kv_connector_wait_latency"]
        assert waits["count"] == 4 and waits["cumulative"][waits["buckets"].index(1.0)] == 4, waits
    # open, or half_open while a probe (a save after breaker_reset_s on a slow
    # machine) waits on the stalled store; never closed: no call answers in time
    assert s["kv_connector_breaker_opened"] >= 1 and not s["kv_connector_healthy"]
    assert s["kv_connector_breaker_state"] in ("open", "half_open"), s["kv_connector_breaker_state"]
    # the store comes back: after breaker_reset_s a probe closes the circuit and hits resume
    store.mode = "ok"
    deadline = time.monotonic() + 10
    while b.stats()["kv_connector_breaker_state"] != "closed" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.stats()["kv_connector_healthy"]
    b.kv.reset_prefix_cache()
    out = _run(b, "again", PROMPT + [30])
    assert out.num_external_cached_tokens == 40
    assert out.outputs[0].token_ids == reference(PROMPT + [30], 6, eos=False)


def test_a_store_answering_after_the_deadline_keeps_the_circuit_open():
    """Every call of a stalled store answers "ok", but after the deadline: the
    start-up probe's late answer and each half-open probe's must not close
    the circuit (the next requests would wait the deadline again)."""
    store = DictStore()
    store.mode, store.stall_s = "stall", 0.6
    b = _engine(store, deadline_s=0.2, breaker_reset_s=0.1)
    for i in range(2):
        b.add_request(f"r{i}", _unshared(i), PARAMS)
    done = run_all(b)
    assert all(done[f"r{i}"].num_external_cached_tokens == 0 for i in range(2))
    assert b.stats()["kv_connector_breaker_state"] != "closed"
    # the start-up probe answers at 0.6 s, half-open probes every ~0.7 s after
    states, calls = set(), store.calls
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        states.add(b.stats()["kv_connector_breaker_state"])
        time.sleep(0.02)
    s = b.stats()
    assert "closed" not in states, states
    assert store.calls >= calls + 2 and s["kv_connector_failures"].get("unreachable", 0) >= 1, (store.calls, s)
    assert "health probe" in s["kv_connector_health"], s["kv_connector_health"]
    # in time again: the next probe closes it
    store.mode = "ok"
    deadline = time.monotonic() + 5
    while b.stats()["kv_connector_breaker_state"] != "closed" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert b.stats()["kv_connector_healthy"]
    b.kv.connector.close(1.0)


def test_fail_policy_ends_the_request_with_an_error():
    store = DictStore()
    a = _engine(store)
    _run(a, "a", PROMPT + [5])
    for v in store.values.values():
        v[-1] ^= 0xFF
    b = _engine(store, failure_policy="fail")
    b.add_request("x", PROMPT + [6], PARAMS)
    b.add_request("y", [3, 4, 5], PARAMS)
    done = run_all(b)
    assert done["x"].error and "KV load failed" in done["x"].error
    assert done["y"].error is None and done["y"].outputs[0].token_ids == reference([3, 4, 5], 6, eos=False)
    assert b.pages_held() == 0


def test_n_samples_and_preemption_with_a_connector():
    store = DictStore()
    e = toy_engine(page_size=4, num_pages=40, max_num_seqs=8, connector=store.connector, connector_options={"deadline_s": 1})
    prompts = [[(i * 7 + j) % 96 + 1 for j in range(30)] for i in range(8)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        e.add_request(f"r{i}", p, params)
    e.add_request("n", PROMPT, SamplingParams(n=3, max_tokens=5, temperature=0, ignore_eos=True))
    done = run_all(e)
    for i, p in enumerate(prompts):
        assert done[f"r{i}"].outputs[0].token_ids == reference(p, 30, eos=False)
    assert all(o.token_ids == reference(PROMPT, 5, eos=False) for o in done["n"].outputs)
    assert e.scheduler.num_preemptions > 0 and e.pages_held() == 0
