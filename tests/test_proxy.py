"""platform proxy against stand-in instances (in threads, 127.0.0.1): what
the prefill instance is sent, least-loaded choice with ties in turn, a dead
or failing prefill instance falling back to the decode instance, a client
error from the prefill instance answered as is, streams passed through."""

import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from kv_servers import free_port
from plinth.server.proxy import build_proxy_app, prefill_body
from plinth.server.replicas import ReplicaSet
from server_fixtures import ServerThread


def stand_in(name, log, status=200):
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        log.append((name, body))
        if status != 200:
            return JSONResponse({"error": {"message": f"{name} says {status}"}}, status)
        if body.get("stream"):
            async def gen():
                for t in ("a", "b", "c"):
                    yield f"data: {json.dumps({'choices': [{'text': t}]})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        return {"choices": [{"text": f"from {name}"}], "usage": {"prompt_tokens_details": {"cached_tokens": 7}}}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def test_prefill_body_and_pool():
    body = {"model": "m", "prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}, "n": 2}
    assert prefill_body("/v1/completions", body) == {"model": "m", "prompt": "x", "max_tokens": 1, "stream": False, "n": 1}
    assert prefill_body("/v1/chat/completions", {"max_completion_tokens": 9})["max_tokens"] == 1
    assert prefill_body("/v1/responses", {"max_output_tokens": 9}) == {"max_output_tokens": 1, "stream": False}
    pool = ReplicaSet(["a", "b", "c"])
    assert [pool.least_loaded().url for _ in range(3)] == ["a", "b", "c"]  # ties in turn
    pool.replicas[0].inflight = pool.replicas[2].inflight = 2
    assert {pool.least_loaded().url for _ in range(3)} == {"b"}  # least loaded
    pool.mark_down(pool.replicas[1], "test")
    assert {pool.least_loaded().url for _ in range(4)} == {"a", "c"}  # a down replica is skipped


def test_proxy_flow_and_fallbacks():
    log = []
    with ServerThread(stand_in("p1", log)) as p1, ServerThread(stand_in("p2", log)) as p2, \
            ServerThread(stand_in("d1", log)) as d1, ServerThread(stand_in("bad", log, 500)) as bad, \
            ServerThread(stand_in("client_err", log, 400)) as cerr:
        dead = f"http://127.0.0.1:{free_port()}"
        with ServerThread(build_proxy_app([p1.url, p2.url], [d1.url])) as px:
            r = httpx.post(px.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}, timeout=10)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "from d1"
            assert [n for n, _ in log] == ["p1", "d1"]
            assert log[0][1]["max_tokens"] == 1 and log[1][1]["max_tokens"] == 5
            with httpx.stream("POST", px.url + "/v1/completions", json={"prompt": "hi", "stream": True}, timeout=10) as s:
                text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                               if line.startswith("data: {"))
            assert text == "abc" and [n for n, _ in log[2:]] == ["p2", "d1"]  # the other prefill instance's turn
            h = httpx.get(px.url + "/health", timeout=10).json()
            assert h["status"] == "ok" and len(h["prefill"]) == 2
        log.clear()
        with ServerThread(build_proxy_app([dead, bad.url], [d1.url])) as px:
            for _ in range(2):  # a dead and a failing prefill instance: the decode instance computes it all
                r = httpx.post(px.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}, timeout=10)
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == "from d1"
            assert [n for n, _ in log] == ["d1", "bad", "d1"]
            assert httpx.get(px.url + "/health", timeout=10).json()["status"] == "degraded"
        log.clear()
        with ServerThread(build_proxy_app([cerr.url], [d1.url])) as px:
            r = httpx.post(px.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
            assert r.status_code == 400 and "client_err says 400" in r.text
            assert [n for n, _ in log] == ["client_err"]  # never reached the decode instance


def test_both_fronts_answer_a_bad_body_with_400():
    """A body that is not JSON, or JSON but not an object: 400 from the
    proxy and the router (one check serves both), with the server's error
    body for the route (OpenAI's, Anthropic's on /v1/messages), and no
    instance is sent anything."""
    from plinth.server.router import build_router_app

    log = []
    bodies = ((b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"))
    with ServerThread(stand_in("p1", log)) as p1, ServerThread(stand_in("d1", log)) as d1:
        for app in (build_proxy_app([p1.url], [d1.url]), build_router_app([d1.url], policy="round-robin")):
            with ServerThread(app) as front:
                for path in ("/v1/completions", "/v1/messages"):
                    for content, why in bodies:
                        r = httpx.post(front.url + path, content=content, headers={"content-type": "application/json"}, timeout=10)
                        assert r.status_code == 400, r.text
                        answer = r.json()
                        if path == "/v1/messages":
                            assert answer["type"] == "error"
                        error = answer["error"]
                        assert why in error["message"] and error["type"] == "invalid_request_error"
    assert log == []


def test_both_fronts_answer_502_when_no_instance_can_take_the_request():
    """The decode instance (proxy) or every replica (router) unreachable: 502
    with the server's error body for the route (type api_error, code
    upstream_unavailable; Anthropic's shape on /v1/messages), naming the
    instance that failed; the router's /v1/models alike."""
    from plinth.server.router import build_router_app

    dead = f"http://127.0.0.1:{free_port()}"
    for app in (build_proxy_app([dead], [dead]), build_router_app([dead], policy="round-robin")):
        with ServerThread(app) as front:
            for path in ("/v1/completions", "/v1/messages"):
                r = httpx.post(front.url + path, json={"prompt": "hi", "max_tokens": 5}, timeout=10)
                assert r.status_code == 502, r.text
                answer = r.json()
                if path == "/v1/messages":
                    assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}
                error = answer["error"]
                assert error["type"] == "api_error"
                assert path == "/v1/messages" or error["code"] == "upstream_unavailable"
                assert "replica" in error["message"] or dead in error["message"]
    with ServerThread(build_router_app([dead], policy="round-robin")) as front:
        r = httpx.get(front.url + "/v1/models", timeout=10)
        assert r.status_code == 502 and r.json()["error"]["message"] == "no replica answers"
