"""Many streams at once, and clients that leave: afterwards every KV page is
free again and the server still answers."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import fake_engine, free_pages_back, serve, wait_for

MODEL = "test-model"
BACKENDS = ["fake", pytest.param("smollm2", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=BACKENDS)
def srv(request):
    own = request.param == "fake"
    engine = fake_engine() if own else request.getfixturevalue("smollm2_async_engine")
    with serve(engine, names=[MODEL]) as s:
        s.kind = request.param
        yield s
    if own:
        engine.close()


def _aborted(url: str) -> float:
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if fam.name == "plinth:request_success":
            return sum(s.value for s in fam.samples if s.name.endswith("_total") and s.labels.get("finished_reason") == "abort")
    return 0.0


def test_64_concurrent_streams(srv):
    engine = srv.engine
    baseline = engine.stats()["num_pages"]
    assert free_pages_back(engine, baseline)
    max_tokens = 24 if srv.kind == "fake" else 12

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        text, finish, usage = "", None, 0
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Request {i}: count to five."}],
            max_tokens=max_tokens,
            temperature=1.0,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
            if ch.usage:
                usage = ch.usage.completion_tokens
        return text, finish, usage

    async def main() -> list:
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=100), timeout=300)
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", http_client=http, max_retries=0)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await http.aclose()

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert len(results) == 64
    for _text, finish, usage in results:
        assert finish in ("stop", "length")
        assert 1 <= usage <= max_tokens
    print(f"64 streams, {sum(r[2] for r in results)} tokens in {elapsed:.1f}s")
    assert free_pages_back(engine, baseline)
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def _long_request(srv) -> dict:
    # long enough that it would run for many seconds if it were not aborted
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long story."}],
        "max_tokens": 900 if srv.kind == "fake" else 1500,
        "ignore_eos": True,
        "temperature": 1.0,
    }


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/completions"])
def test_disconnect_mid_stream_frees_pages(srv, path):
    engine = srv.engine
    baseline = engine.stats()["num_pages"]
    assert free_pages_back(engine, baseline)
    aborted = _aborted(srv.url)
    body = dict(_long_request(srv), stream=True)
    if path == "/v1/completions":
        body["prompt"] = body.pop("messages")[0]["content"]
    with httpx.stream("POST", srv.url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(8):
            next(lines)
        assert engine.engine.pages_held() > 0  # the request is running
        generated = engine.stats()["generation_tokens"]
    # the client closed the connection: the request is aborted and its pages freed at once
    t0 = time.monotonic()
    assert free_pages_back(engine, baseline, timeout=10), engine.stats()
    assert time.monotonic() - t0 < 10
    assert engine.stats()["generation_tokens"] - generated < body["max_tokens"] // 2
    assert wait_for(lambda: _aborted(srv.url) == aborted + 1, 5)
    assert httpx.get(srv.url + "/health").status_code == 200


def test_disconnect_while_waiting_for_a_full_answer(srv):
    """Not streamed: a client that gives up is noticed too."""
    engine = srv.engine
    baseline = engine.stats()["num_pages"]
    aborted = _aborted(srv.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/chat/completions", json=_long_request(srv), timeout=1.0)
    assert free_pages_back(engine, baseline, timeout=10), engine.stats()
    assert wait_for(lambda: _aborted(srv.url) == aborted + 1, 5)


def test_kept_alive_connections_answer_at_once(srv):
    """TCP_NODELAY on accepted connections: without it, every answer after the
    first on a kept-alive connection waits ~40 ms for a delayed ACK."""
    with httpx.Client() as client:
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            assert client.get(srv.url + "/health").status_code == 200
            times.append(time.perf_counter() - t0)
    assert sorted(times)[3] < 0.025, times
