"""An engine on a tiny random Llama with the mooncake connector and a real
mooncake_master: pages computed once are loaded after the local prefix cache
is dropped; the master killed (SIGKILL) mid-run costs no request more than
the deadline and changes no output; restarted, hits resume by themselves."""

import time

import pytest
from plinth import LLM, SamplingParams
from tiny_models import tiny_model_dir

SHARED = [(i * 37) % 250 + 1 for i in range(160)]  # 10 pages of 16
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
DEADLINE = 1.0


class _Spy:
    """The real store client, each method call's name recorded."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if callable(attr):
            self.calls.append(name)
        return attr


def _llm(model, **kw):
    return LLM(model, dtype="float32", backend="torch", load_progress=False, num_pages=256, page_size=16, **kw)


def _gen(llm, prompt):
    t = time.monotonic()
    (out,) = llm.generate([prompt], PARAMS, use_tqdm=False)
    return out, time.monotonic() - t


@pytest.fixture(scope="module")
def model(tiny_root):
    return tiny_model_dir("llama", tiny_root)


def test_hits_then_master_killed_then_restarted(model, master):
    prompts = [SHARED + [i, i + 1] for i in range(1, 6)]
    ref_llm = _llm(model)
    refs = [_gen(ref_llm, p)[0].outputs[0].token_ids for p in prompts]
    normal = max(_gen(ref_llm, p)[1] for p in prompts)
    del ref_llm

    cfg = {**master.config, "deadline_s": DEADLINE, "breaker_failures": 1, "breaker_reset_s": 0.5}
    llm = _llm(model, kv_connector="mooncake", kv_connector_config=cfg)
    kv = llm.engine.kv
    conn = kv.connector.connector
    end = time.monotonic() + 20  # the worker threads register their staging areas at start-up
    while conn.registrations < 3 and time.monotonic() < end:
        time.sleep(0.05)
    assert conn.registrations == 3 and len(conn._regions) == 3  # 2 load threads, 1 save thread
    spy = conn._store = _Spy(conn._store)  # the real client, its calls counted from here on
    out, _ = _gen(llm, prompts[0])
    assert out.outputs[0].token_ids == refs[0] and out.num_external_cached_tokens == 0
    assert kv.connector.flush(10)
    kv.reset_prefix_cache()
    out, _ = _gen(llm, prompts[1])
    assert out.outputs[0].token_ids == refs[1]
    assert out.num_external_cached_tokens == 160 and out.num_cached_tokens == 160

    master.kill()
    for i in (2, 3):
        kv.reset_prefix_cache()
        out, took = _gen(llm, prompts[i])
        assert out.outputs[0].token_ids == refs[i]  # recomputed, same tokens
        assert out.num_external_cached_tokens == 0
        assert took < DEADLINE + normal + 1.0, f"a request waited {took:.2f}s on a dead master"
    s = llm.engine.stats()
    assert sum(s["kv_connector_failures"].values()) >= 1, s["kv_connector_failures"]
    assert not s["kv_connector_healthy"]

    master.start()
    end = time.monotonic() + 30
    while not llm.engine.stats()["kv_connector_healthy"] and time.monotonic() < end:
        time.sleep(0.2)
    assert llm.engine.stats()["kv_connector_healthy"], llm.engine.stats()["kv_connector_health"]
    # the restarted master lost its data: save again, then hits resume
    kv.reset_prefix_cache()
    out, _ = _gen(llm, prompts[4])
    assert out.outputs[0].token_ids == refs[4]
    end = time.monotonic() + 20
    while time.monotonic() < end:  # saves may be skipped while the client re-mounts
        assert kv.connector.flush(10)
        if llm.engine.stats()["kv_connector_saved_pages"] >= 20:
            break
        kv.reset_prefix_cache()
        _gen(llm, prompts[4])
    loads_before = spy.calls.count("batch_get_into")
    kv.reset_prefix_cache()
    out, _ = _gen(llm, prompts[0])
    assert out.outputs[0].token_ids == refs[0]
    assert out.num_external_cached_tokens == 160
    # no registration on the load/save path, before, during or after the outage: the
    # areas registered at start-up are reused, zero-copy, after the restart too
    assert "register_buffer" not in spy.calls and "unregister_buffer" not in spy.calls, spy.calls
    assert spy.calls.count("batch_get_into") > loads_before and "batch_put_from" in spy.calls
    assert "get_batch" not in spy.calls and "put_batch" not in spy.calls
    assert conn.registrations == 3


def test_a_value_corrupted_in_the_store_is_a_miss(model, master):
    """A byte flipped in one stored page (rewritten in the real store with
    upsert): that page and the ones after it are recomputed, never loaded;
    the output is unchanged and the failure is counted by kind."""
    from mooncake.store import MooncakeDistributedStore
    from plinth.testing import kv_key

    prompt = SHARED + [9, 9]
    ref_llm = _llm(model)
    ref = _gen(ref_llm, prompt)[0].outputs[0].token_ids
    del ref_llm
    llm = _llm(model, kv_connector="mooncake", kv_connector_config={**master.config, "deadline_s": 5.0})
    kv = llm.engine.kv
    _gen(llm, prompt)
    assert kv.connector.flush(10)
    seq_hashes = list(kv.connector._known)  # the 10 pages just saved, in order
    assert len(seq_hashes) == 10
    key = kv_key(kv.connector.layout, seq_hashes[4])
    c = master.config
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", c["metadata_server"], 16 << 20, 16 << 20, "tcp", "", c["master_server_address"]) == 0
    value = bytearray(store.get(key))
    assert len(value) == kv.connector.layout.value_bytes
    value[-1] ^= 0xFF  # the payload's last byte: the checksum no longer matches
    assert store.upsert(key, bytes(value)) == 0
    assert bytes(store.get(key)) == bytes(value)
    kv.reset_prefix_cache()
    out, _ = _gen(llm, prompt)
    assert out.outputs[0].token_ids == ref
    assert out.num_external_cached_tokens == 4 * 16  # the pages before the corrupt one
    s = llm.engine.stats()
    assert s["kv_connector_failures"].get("corrupt", 0) == 1
    assert s["kv_connector_recomputed_tokens"] == 6 * 16
