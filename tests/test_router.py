"""`platform router` over three tiny-model `platform serve` processes publishing KV events:
a repeated long prefix goes to the replica that holds it (known from its
events), the official OpenAI and Anthropic clients stream through it, and a
SIGKILLed replica is dropped within seconds while requests keep being served."""

import json
import time

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

import anthropic  # noqa: E402
import openai  # noqa: E402
from kv_servers import serve  # noqa: E402
from plinth.engine.startup import load_tokenizer  # noqa: E402
from plinth.server.router import PrefixIndex, build_router_app, request_keys  # noqa: E402
from server_fixtures import ServerThread, wait_for  # noqa: E402
from tiny_models import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.slow

PREFIX = " ".join(f"w{i}" for i in range(150))  # ~450 tokens: many 16-token pages


@pytest.fixture(scope="module")
def fleet(tiny_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    model = tiny_model_dir("llama", tiny_root)
    procs, events, replays = [], [], []
    try:
        for i in range(3):
            ep, replay = f"ipc://{tmp}/kv{i}", f"ipc://{tmp}/replay{i}"
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ep, "replay_endpoint": replay, "topic": f"kv@r{i}@tiny"}
            procs.append(serve(model, str(tmp / f"r{i}.log"), "--max-num-batched-tokens", "512", "--kv-events-config", json.dumps(cfg)))
            events.append(ep)
            replays.append(replay)
        app = build_router_app([p.url for p in procs], events, replay=replays, interval=0.3, tokenizer=load_tokenizer(model))
        with ServerThread(app) as router:
            router.procs, router.events, router.replays = procs, events, replays
            router.app = app
            yield router
    finally:
        for p in procs:
            p.stop()


def served(router):
    return {u: s["served"] for u, s in router.app.state.replicas.stats().items()}


def test_repeated_prefix_goes_to_its_holder(fleet):
    c = httpx.Client(base_url=fleet.url, timeout=120)
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": PREFIX + " first", "max_tokens": 1})
    assert r.status_code == 200, r.text
    idx = fleet.app.state.indexes
    assert wait_for(lambda: any(ix.keys for ix in idx.values()), 10), "no KV events reached the router"
    holders = [u for u, ix in idx.items() if ix.keys]
    assert len(holders) == 1
    (holder,) = holders
    before = served(fleet)
    for i in range(4):
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": PREFIX + f" then {i}", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 400  # the holder's prefix cache served it
    after = served(fleet)
    assert after[holder] - before[holder] == 4
    # an unrelated prompt: no replica holds it, so the load scores decide (not the holder by habit)
    assert c.get("/health").json()["status"] == "ok"
    text = c.get("/metrics").text
    assert "plinth_router:prefix_matched_blocks_total" in text


SYSTEM = " ".join(f"rule {i}." for i in range(45))  # a long shared system prompt: many full pages
CHAT = {"model": "tiny", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}], "max_tokens": 1}
COMPLETION = {"model": "tiny", "prompt": " ".join(f"c{i}" for i in range(150)), "max_tokens": 1}
MESSAGES = {"model": "tiny", "system": SYSTEM + " And more.", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 1}  # fmt: skip


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION), ("/v1/messages", MESSAGES)],
                         ids=["chat", "completion", "anthropic"])  # fmt: skip
def test_router_tokens_are_the_replicas(fleet, path, body):
    """The router tokenizes the request itself (no /tokenize call), to the ids the
    replica computes, so every full block's key is one the replica's events stored."""
    router = fleet.app.state.router
    ids = router.prompt_tokens(path, body)
    assert ids and router.health()[0]["tokenizer"] == "router"
    c = httpx.Client(base_url=fleet.url, timeout=120)
    before = served(fleet)
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage.get("prompt_tokens", usage.get("input_tokens")) == len(ids)  # the replica's own count
    (holder,) = [u for u, n in served(fleet).items() if n > before[u]]
    idx = fleet.app.state.indexes[holder]
    keys = request_keys(ids, 16)
    assert len(keys) >= 20
    assert wait_for(lambda: idx.matched(keys) == len(keys), 10), f"{idx.matched(keys)} of {len(keys)} blocks in the replica's events"
    # and the replica's /tokenize agrees token for token
    doc = {"prompt": body["prompt"]} if "prompt" in body else None
    if path == "/v1/chat/completions":
        doc = {"messages": body["messages"]}
    if doc is not None:
        assert httpx.post(holder + "/tokenize", json=doc, timeout=30).json()["tokens"] == ids


def test_without_a_tokenizer_the_replicas_tokenize(fleet, caplog):
    """A router that cannot load the replicas' model says so and asks their /tokenize:
    the prefix still routes. Started after the replicas, it catches up on their
    events from their replay sockets."""
    urls = [p.url for p in fleet.procs]
    with caplog.at_level("WARNING", logger="plinth.router"):
        app = build_router_app(urls, fleet.events, replay=fleet.replays, interval=0.3)
    assert any("/tokenize" in m for m in caplog.messages)
    with ServerThread(app) as router:
        c = httpx.Client(base_url=router.url, timeout=120)
        assert c.get("/health").json()["tokenizer"] == "replicas"
        path, body = "/v1/chat/completions", CHAT
        keys = request_keys(fleet.app.state.router.prompt_tokens(path, body), 16)
        holders = [u for u, ix in fleet.app.state.indexes.items() if ix.matched(keys) == len(keys)]
        assert holders
        indexes = app.state.indexes
        assert wait_for(lambda: all(indexes[u].matched(keys) == len(keys) for u in holders), 10)  # caught up by replay
        before = {u: s["served"] for u, s in app.state.replicas.stats().items()}
        r = c.post(path, json=body)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * (len(keys) - 1)
        after = {u: s["served"] for u, s in app.state.replicas.stats().items()}
        assert [u for u in after if after[u] > before[u]][0] in holders


def test_official_clients_stream_through(fleet):
    oai = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert any(ch.choices and ch.choices[0].finish_reason == "length" for ch in chunks)
    comp = list(oai.completions.create(model="tiny", prompt="abc", max_tokens=4, stream=True))
    assert sum(len(ch.choices[0].text) > 0 for ch in comp if ch.choices) >= 1
    ant = anthropic.Anthropic(base_url=fleet.url, api_key="unused", max_retries=0, timeout=120)
    with ant.messages.stream(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5 and isinstance(text, str)


def test_sigkilled_replica_is_dropped_and_serving_goes_on(fleet):
    idx = fleet.app.state.indexes
    holder = next((u for u, ix in idx.items() if ix.keys), fleet.procs[0].url)
    victim = next(p for p in fleet.procs if p.url == holder)
    victim.proc.kill()  # SIGKILL
    victim.proc.wait(30)
    c = httpx.Client(base_url=fleet.url, timeout=120)
    t0 = time.monotonic()
    for i in range(4):  # the prefix's holder is gone: its requests go elsewhere, none fails
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": PREFIX + f" after {i}", "max_tokens": 1})
        assert r.status_code == 200, r.text
    assert wait_for(lambda: not fleet.app.state.replicas.stats()[holder]["healthy"], 5)
    assert time.monotonic() - t0 < 60
    h = c.get("/health").json()
    assert h["status"] == "degraded" and not h["replicas"][holder]["healthy"]
    assert not idx[holder].keys  # its prefix index went with it


def test_prefix_index_from_both_layouts():
    """The router's index reads events as vLLM 0.32 maps and as positional arrays, with bytes hashes too."""
    toks = list(range(48))
    for ev1, ev2 in [
        ({"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": toks[:32], "block_size": 16},
         {"type": "BlockStored", "block_hashes": [13], "parent_block_hash": 12, "token_ids": toks[32:48], "block_size": 16}),
        (["BlockStored", [b"\x01" * 32, b"\x02" * 32], None, toks[:32], 16, None, "GPU", None],
         ["BlockStored", [b"\x03" * 32], b"\x02" * 32, toks[32:48], 16, None, "GPU", None]),
    ]:  # fmt: skip
        ix = PrefixIndex()
        ix.apply([0.0, [ev1], 0])
        assert ix.matched(request_keys(toks + [99] * 10, 16)) == 2
        ix.apply([0.0, [ev2], 0])
        remove = {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"} if isinstance(ev1, dict) else ["BlockRemoved", [b"\x02" * 32], "GPU"]
        ix.apply([0.0, [remove], 0])
        assert ix.matched(request_keys(toks, 16)) == 1  # the chain breaks at the removed block
        ix.apply([0.0, [{"type": "AllBlocksCleared"} if isinstance(ev1, dict) else ["AllBlocksCleared"]], 0])
        assert not ix.keys
