"""KV events in vLLM's wire format, decoded the way vLLM's and llm-d's subscribers decode them.

The subscriber's structs below are written from vLLM's
``vllm/distributed/kv_events.py`` (0.32: ``EventBatch`` ``array_like=True``,
``KVCacheEvent`` ``tag=True`` maps) and, for ``array_like``, from the layout
llm-d's ``pkg/kvevents/engineadapter/vllm_adapter.go`` decodes (``[tag,
block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name]``); they never import plinth's own."""

import time

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from plinth.engine.kv_events import build_recorder, offset_endpoint_port  # noqa: E402
from server_fixtures import BigramRunner, ByteTokenizer  # noqa: E402


def subscriber_types(array_like: bool):
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, array_like=array_like):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def make_engine(num_pages, page_size, events_cfg):
    from plinth.api import ModelConfig
    from plinth.engine.block_manager import BlockPool
    from plinth.engine.engine import LLMEngine
    from plinth.engine.executor import LocalExecutor
    from plinth.engine.kv_cache_manager import KVCacheManager
    from plinth.engine.scheduler import Scheduler
    from server_fixtures import BOS, EOS, FAKE_LOGITS

    cfg = ModelConfig(
        architecture="Bigram", vocab_size=FAKE_LOGITS, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
        head_dim=8, max_model_len=256, eos_token_ids=(EOS,), bos_token_id=BOS,
    )  # fmt: skip
    runner = BigramRunner(delay=0)
    kv = KVCacheManager(BlockPool(num_pages, page_size), hash_seed=12345, copy_pages=runner.copy_pages)
    kv.pool.events = build_recorder(events_cfg, block_size=page_size)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=256)
    return LLMEngine(executor=LocalExecutor(runner), tokenizer=ByteTokenizer(), model_config=cfg, scheduler=sched, max_model_len=256)


def run(engine, rid, prompt, max_tokens=1):
    from plinth.engine.sampling_params import SamplingParams

    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def receive(sock, types, timeout=5.0):
    """Every (seq, batch) the SUB socket gets until it is quiet for 0.3 s."""
    decoder = msgspec.msgpack.Decoder(types[0])
    out = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sock.poll(300):
            if out:
                break
            continue
        topic, seq, payload = sock.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), decoder.decode(payload), payload))
    return out


@pytest.mark.parametrize("array_like", [False, True], ids=["tagged-map", "array-like"])
def test_events_stored_removed_and_replayed(tmp_path, array_like):
    pub, rep = f"ipc://{tmp_path}/kv-pub", f"ipc://{tmp_path}/kv-replay"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": rep, "topic": "kv@pod@m",
           "array_like": array_like}  # fmt: skip
    ps = 4
    engine = make_engine(num_pages=6, page_size=ps, events_cfg=cfg)
    types = subscriber_types(array_like)
    KVEventBatch, BlockStored, BlockRemoved, _ = types
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    time.sleep(0.3)  # PUB/SUB slow joiner
    try:
        prompt = [10, 11, 12, 13, 20, 21, 22, 23, 30, 31]  # two full pages and two tokens
        run(engine, "a", prompt)
        got = receive(sub, types)
        assert got and all(t == b"kv@pod@m" for t, *_ in got)
        stored = [e for _, _, b, _ in got for e in b.events if isinstance(e, BlockStored)]
        assert [e.token_ids for e in stored] == [prompt[:8]]  # one run of the prompt's full pages
        (first,) = stored
        assert first.parent_block_hash is None and first.block_size == ps and len(first.block_hashes) == 2
        assert first.medium == "GPU" and first.lora_id is None
        assert got[0][2].data_parallel_rank == 0
        # the raw layout: a map with "type", or a positional array with the tag first
        raw = msgspec.msgpack.decode(got[0][3])
        assert isinstance(raw, list) and len(raw) == 3
        ev = raw[1][0]
        if array_like:
            assert ev[:5] == ["BlockStored", first.block_hashes, None, prompt[:8], ps]
        else:
            assert ev["type"] == "BlockStored" and ev["token_ids"] == prompt[:8]

        # the same prefix and one more page: only the new page is stored, its parent the prompt's last
        longer = prompt[:8] + [40, 41, 42, 43, 50]
        run(engine, "b", longer)
        got2 = receive(sub, types)
        stored2 = [e for _, _, b, _ in got2 for e in b.events if isinstance(e, BlockStored)]
        assert [e.token_ids for e in stored2] == [[40, 41, 42, 43]]
        assert stored2[0].parent_block_hash == first.block_hashes[-1]

        # other prompts take every page: the cached ones are evicted, LRU first
        run(engine, "c", [100 + i for i in range(21)])
        got3 = receive(sub, types)
        removed = [h for _, _, b, _ in got3 for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert set(first.block_hashes + stored2[0].block_hashes) <= set(removed)

        seqs = [s for _, s, _, _ in got + got2 + got3]
        assert seqs == list(range(len(seqs)))
        # replay from the second batch: every buffered batch from there, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(rep)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                assert payload == b""
                break
            replayed.append((n, payload))
        assert [n for n, _ in replayed] == seqs[1:]
        assert [p for _, p in replayed] == [p for _, s, _, p in got + got2 + got3 if s >= 1]
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        engine.close()


def test_reset_prefix_cache_reports_all_blocks_cleared(tmp_path):
    pub = f"ipc://{tmp_path}/kv-pub"
    engine = make_engine(8, 4, {"enable_kv_cache_events": True, "endpoint": pub})
    types = subscriber_types(False)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)
    try:
        run(engine, "a", list(range(1, 10)))
        engine.kv.reset_prefix_cache()
        engine.kv.end_step()
        events = [e for _, _, b, _ in receive(sub, types) for e in b.events]
        assert type(events[0]).__name__ == "BlockStored" and type(events[-1]).__name__ == "AllBlocksCleared"
    finally:
        sub.close(linger=0)
        engine.close()


def test_endpoint_offsets_per_dp_rank_as_vllm():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://10.0.0.1:5557", 1) == "tcp://10.0.0.1:5558"
    assert offset_endpoint_port("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint_port(None, 2) is None


def test_bad_kv_events_config_is_a_config_error():
    from plinth.engine.config import EngineConfig
    from plinth.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown field"):
        EngineConfig.from_kwargs(kv_events_config={"enable_kv_cache_events": True, "endpoit": "tcp://*:1"})
    with pytest.raises(ConfigError, match="publisher"):
        EngineConfig.from_kwargs(kv_events_config={"enable_kv_cache_events": True, "publisher": "kafka"})


def test_local_connector_tiers_report_their_medium(tmp_path):
    """The local connector's CPU and disk tiers publish BlockStored (a location
    update: no tokens) and BlockRemoved with vLLM's medium names."""
    pytest.importorskip("plinth_plugin_kv_local")
    import torch
    from plinth.api import SelectionContext
    from plinth.engine.kv_events import KVEventRecorder
    from plinth.engine.kv_transfer import KVTransfer
    from plinth.testing.kv_connector import kv_test_layout
    from plinth_plugin_kv_local.connector import LocalConnector

    class Capture:
        dp_rank = 0

        def __init__(self):
            self.batches = []

        def publish(self, batch):
            self.batches.append(batch)

        def close(self):
            pass

    layout = kv_test_layout(page_bytes=64)
    vb = layout.value_bytes
    conn = LocalConnector(
        SelectionContext(), config={"cpu_bytes": 3 * vb, "disk_dir": str(tmp_path / "kv"), "disk_bytes": 2 * vb + 1}, layout=layout
    )
    transfer = KVTransfer(
        conn, layout,
        read_pages=lambda pages: torch.arange(len(pages) * 64, dtype=torch.uint8).reshape(len(pages), 64),
        write_pages=lambda pages, data: None,
    )  # fmt: skip
    pub = Capture()
    rec = KVEventRecorder(pub, block_size=layout.page_size)
    transfer.attach_events(rec)
    try:
        transfer.pages_computed([(i, 1000 + i) for i in range(4)])
        transfer.end_step()
        for f in transfer._pending_saves:
            f.result(30)
        rec.flush()
    finally:
        transfer.close()
    events = [e for b in pub.batches for e in b.events]
    stored = {(e.medium, h) for e in events if type(e).__name__ == "BlockStored" for h in e.block_hashes}
    removed = {(e.medium, h) for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes}
    assert {("CPU", 1000 + i) for i in range(4)} <= stored and {("STORAGE", 1000 + i) for i in range(4)} <= stored
    assert all(e.token_ids == [] and e.parent_block_hash is None for e in events if type(e).__name__ == "BlockStored")
    assert ("CPU", 1000) in removed  # three values fit in memory: the first is evicted
    assert {h for m, h in removed if m == "STORAGE"} == {1000, 1001}  # two fit on disk
