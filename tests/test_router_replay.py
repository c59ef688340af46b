"""The router's KV-event subscriber fills a sequence gap from the replica's
replay socket (vLLM's protocol: DEALER ``[b"", start_seq]``, answers ``[b"",
seq, payload]`` then seq -1), so batches lost on the way leave its prefix
index equal to the replica's prefix cache; without a replay socket the loss
shows (the index goes wrong), which is what the replay is for."""

import time

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from plinth.server.router import EventSubscriber, PrefixIndex  # noqa: E402
from server_fixtures import wait_for  # noqa: E402
from test_kv_events import make_engine, run  # noqa: E402

LOST = {0, 2, 3, 5}  # the first batch too: as for a router started after the replica


def workload(engine):
    """Prompts that store pages, share prefixes and evict (6 pages of 4 tokens)."""
    base = [10, 11, 12, 13, 20, 21, 22, 23]
    prompts = [base + [30], base + [40, 41, 42, 43, 50], [100 + i for i in range(13)], base + [60, 61, 62, 63, 1],
               [150 + i for i in range(9)], base[:4] + [70, 71, 72, 73, 2], [230 + i for i in range(17)], base + [3]]  # fmt: skip
    for i, p in enumerate(prompts):
        run(engine, f"r{i}", p)


def test_lost_batches_are_replayed_and_the_index_ends_equal(tmp_path):
    pub, rep = f"ipc://{tmp_path}/kv-pub", f"ipc://{tmp_path}/kv-replay"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": rep}
    engine = make_engine(num_pages=6, page_size=4, events_cfg=cfg)
    replayed, unreplayed = PrefixIndex(), PrefixIndex()
    subs = [EventSubscriber(pub, replayed, rep, drop=LOST.__contains__), EventSubscriber(pub, unreplayed, None, drop=LOST.__contains__)]
    try:
        time.sleep(0.5)  # PUB/SUB slow joiner
        workload(engine)
        publisher = engine.pool.events.publisher
        assert wait_for(lambda: publisher._queue.empty() and replayed.last_seq == unreplayed.last_seq == publisher._buffer[-1][0], 10)
        n = replayed.last_seq + 1  # batches 0..n-1 went out
        assert n >= 7 and n - 1 not in LOST  # the last batch arrives, so the gaps before it show
        truth = set(engine.pool.cached)
        assert truth and set(replayed.by_hash) == truth
        assert subs[0].replayed == len(LOST) and subs[0].lost == 0
        assert subs[1].lost == len(LOST) and set(unreplayed.by_hash) != truth
    finally:
        for s in subs:
            s.stop()
        engine.close()
