"""The router's scoring and replica tracking without servers: llm-d's weighted
sum (prefix fraction, free KV cache, min-max queue), health polls marking a
replica down and back, and the vLLM gauges read from a /metrics page."""

import asyncio

import httpx
from plinth.server.replicas import ReplicaSet, parse_gauges
from plinth.server.router import PrefixIndex, Scorer, request_keys

TOKENS = list(range(64))  # four 16-token blocks


def indexed(n_blocks):
    ix = PrefixIndex()
    if n_blocks:
        ix.apply([0.0, [{"type": "BlockStored", "block_hashes": list(range(1, n_blocks + 1)), "parent_block_hash": None,
                         "token_ids": TOKENS[: 16 * n_blocks], "block_size": 16}], 0])  # fmt: skip
    return ix


def test_weighted_score_as_llm_d():
    rs = ReplicaSet(["a", "b", "c"])
    a, b, c = rs.replicas
    idx = {"a": indexed(4), "b": indexed(2), "c": indexed(0)}
    a.waiting, b.waiting, c.waiting = 4, 2, 0
    a.kv_usage, b.kv_usage, c.kv_usage = 0.5, 0.0, 0.25
    ranked = Scorer(rs, idx, prefix=2, kv_cache=1, queue=1).score(TOKENS)
    got = {r.url: (round(s, 6), m) for s, r, m in ranked}
    # prefix 4/4, 2/4, 0; free KV 0.5, 1, 0.75; queue (4-q)/(4-0): 0, 0.5, 1
    assert got == {"a": (2.5, 4), "b": (2.5, 2), "c": (1.75, 0)}
    assert {ranked[0][1].url, ranked[1][1].url} == {"a", "b"} and ranked[2][1].url == "c"
    # prefix weight 0: load alone decides
    assert Scorer(rs, idx, prefix=0, kv_cache=1, queue=1).score(TOKENS)[0][1].url == "c"
    # in-flight requests through the router count when the scrape is stale
    c.inflight = 9
    assert Scorer(rs, idx, prefix=0, kv_cache=0, queue=1).score(TOKENS)[0][1].url == "b"


def test_a_down_replica_is_not_scored_and_its_block_keys_chain():
    rs = ReplicaSet(["a", "b"])
    rs.mark_down(rs.replicas[0], "test")
    ranked = Scorer(rs, {"a": indexed(4), "b": indexed(0)}, prefix=2, kv_cache=1, queue=1).score(TOKENS)
    assert [r.url for _, r, _ in ranked] == ["b"]
    keys = request_keys(TOKENS, 16)
    assert len(keys) == 4 and request_keys(TOKENS[:32], 16) == keys[:2]  # chained: a prefix's keys are a prefix
    assert indexed(4).matched(request_keys([999] + TOKENS[1:], 16)) == 0  # the first block differs: nothing matches


def test_health_polls_mark_down_and_back():
    state = {"b": "ok"}

    def handler(request):
        host = request.url.host
        if host == "b" and state["b"] == "dead":
            raise httpx.ConnectError("refused")
        if request.url.path == "/metrics":
            return httpx.Response(200, text='vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
                                             'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')  # fmt: skip
        return httpx.Response(200, json={"status": "ok"})

    rs = ReplicaSet(["http://a", "http://b"], scrape_metrics=True, interval=1.0)
    downs = []
    rs.on_down.append(lambda r: downs.append(r.url))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await rs.poll_once(client)
            assert all(r.healthy for r in rs.replicas) and rs.replicas[0].waiting == 3 and rs.replicas[0].kv_usage == 0.25
            state["b"] = "dead"
            await rs.poll_once(client)
            assert [r.url for r in rs.up()] == ["http://a"] and downs == ["http://b"]
            state["b"] = "ok"
            await rs.poll_once(client)
            assert len(rs.up()) == 2

    asyncio.run(go())


def test_parse_gauges_sums_label_sets_and_ignores_others():
    page = "\n".join([
        "# HELP vllm:num_requests_waiting x", 'vllm:num_requests_waiting{engine="0"} 2.0', 'vllm:num_requests_waiting{engine="1"} 1.0',
        'vllm:num_requests_running{engine="0"} 4', "vllm:kv_cache_usage_perc 0.5", "plinth:num_requests_waiting 99",
        "vllm:num_requests_waiting_total 7",
    ])  # fmt: skip
    assert parse_gauges(page) == {"waiting": 3.0, "running": 4.0, "kv_usage": 0.5}
