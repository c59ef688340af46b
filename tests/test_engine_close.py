"""close() is real: it flushes the KV saves still in flight (the local
connector's disk tier then holds the pages: a second engine loads them) and
leaves no thread behind; LLM and AsyncLLM are context managers."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from plinth import LLM, SamplingParams
from tiny_models import tiny_model_dir

pytest.importorskip("plinth_plugin_kv_local")

KW = dict(device="cpu", backend="torch", dtype="float32", num_pages=64, load_progress=False, max_num_batched_tokens=256)
SHARED = [(i * 37) % 250 + 1 for i in range(160)]  # 10 pages of 16
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
SAVE_DELAY = 1.0  # under the connector's 2 s deadline: a slow save, not a failed one


def new_threads(before: set[int]) -> list[str]:
    return [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]


def slow_saves(transfer) -> None:
    """The store takes SAVE_DELAY per save: close() finds them in flight."""
    save = transfer.connector.save

    def slow(keys, values):
        time.sleep(SAVE_DELAY)
        return save(keys, values)

    transfer.connector.save = slow


def test_llm_close_flushes_pending_saves_and_stops_every_thread(tiny_root, tmp_path):
    model = tiny_model_dir("llama", tiny_root)
    connector = dict(kv_connector="local", kv_connector_config={"cpu_bytes": 0, "disk_dir": str(tmp_path / "kv")})
    before = {t.ident for t in threading.enumerate()}
    with LLM(model, **KW, **connector) as llm:
        transfer = llm.engine.kv_transfer()
        slow_saves(transfer)
        assert {"plinth-kv-watch"} <= set(new_threads(before))
        llm.generate([SHARED + [7, 8, 9]], PARAMS)
        assert transfer.counters["saved_pages"] == 0  # still in flight when close() starts
    assert transfer.counters["saved_pages"] >= 10, transfer.counters
    assert new_threads(before) == []
    with pytest.raises(Exception, match="closed"):
        llm.generate([[1, 2, 3]], PARAMS)

    with LLM(model, **KW, **connector) as second:
        (out,) = second.generate([SHARED + [20, 21]], PARAMS)
    assert out.num_external_cached_tokens == 160  # what close() flushed
    assert new_threads(before) == []


def test_async_llm_close_stops_its_thread(tiny_root):
    from plinth.engine.async_engine import AsyncLLM
    from plinth.engine.config import EngineConfig
    from plinth.engine.interfaces import EngineError

    model = tiny_model_dir("llama", tiny_root)
    before = {t.ident for t in threading.enumerate()}

    async def one(engine) -> list[int]:
        async for out in engine.generate([1, 2, 3, 4], PARAMS):
            last = out
        return last.outputs[0].token_ids

    with AsyncLLM.from_config(EngineConfig.from_kwargs(model=model, **KW)) as engine:
        assert "plinth-engine" in new_threads(before)
        assert len(asyncio.run(one(engine))) == 4
        assert engine.health() == (True, "ok")
    assert new_threads(before) == []
    assert engine.health()[0] is False
    assert engine.accepting()[0] is False
    with pytest.raises(EngineError, match="shut down"):
        asyncio.run(one(engine))
