"""Bad input never costs a 500 or the server: every case of the issue's item 7,
each checked for its status and its error body (OpenAI's shape, Anthropic's
on /v1/messages); then API keys (401), the body limit (413) and a full
queue (503 with Retry-After). Afterwards the server still answers and no
KV page is held."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from server_fixtures import fake_engine, free_pages_back, serve, wait_for

MODEL = "test-model"
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSG = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
BACKENDS = ["fake", pytest.param("smollm2", marks=pytest.mark.slow)]

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module", params=BACKENDS)
def srv(request):
    own = request.param == "fake"
    engine = fake_engine() if own else request.getfixturevalue("smollm2_async_engine")
    with serve(engine, names=[MODEL]) as s:
        yield s
    if own:
        engine.close()


def chat(**kw):
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **kw}


def cmpl(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


def msg(**kw):
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **kw}


LONG = object()  # placeholder: a prompt longer than the server's max_model_len

# (id, path, body (dict, or bytes sent as is), status, code or None, param or None)
CASES = [
    # malformed JSON, and bodies that are not a JSON object
    ("json-chat", CHAT, b'{"model": "x", "messages": [', 400, "invalid_json", None),
    ("json-completions", CMPL, b"{'single': 'quotes'}", 400, "invalid_json", None),
    ("json-messages", MSG, b'{"model": ', 400, None, None),
    ("not-an-object", CHAT, b"[1, 2, 3]", 400, None, None),
    ("empty-body", CHAT, b"", 400, None, None),
    # wrong types
    ("type-temperature", CHAT, chat(temperature="hot"), 400, "invalid_type", "temperature"),
    ("type-messages", CHAT, chat(messages="hello"), 400, "invalid_type", "messages"),
    ("type-max-tokens", CHAT, chat(max_tokens="many"), 400, "invalid_type", "max_tokens"),
    ("type-n", CMPL, cmpl(n=1.5), 400, None, "n"),
    ("type-stop", CHAT, chat(stop=5), 400, None, "stop"),
    ("type-prompt", CMPL, cmpl(prompt={"text": "hi"}), 400, None, "prompt"),
    ("type-content", CHAT, chat(messages=[{"role": "user", "content": 42}]), 400, None, "messages.0.content"),
    ("type-messages-max-tokens", MSG, msg(max_tokens="x"), 400, None, "max_tokens"),
    ("missing-max-tokens", MSG, {"model": MODEL, "messages": HI}, 400, "missing_required_parameter", "max_tokens"),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "missing_required_parameter", "messages"),
    ("missing-prompt", CMPL, {"model": MODEL}, 400, "missing_required_parameter", "prompt"),
    # unknown model
    ("model-chat", CHAT, chat(model="gpt-17"), 404, "model_not_found", "model"),
    ("model-completions", CMPL, cmpl(model="gpt-17"), 404, "model_not_found", "model"),
    ("model-messages", MSG, msg(model="claude-17"), 404, None, None),
    ("model-count-tokens", COUNT, {"model": "claude-17", "messages": HI}, 404, None, None),
    # empty messages
    ("empty-messages-chat", CHAT, chat(messages=[]), 400, None, "messages"),
    ("empty-messages-messages", MSG, msg(messages=[]), 400, None, None),
    # a conversation of system text alone is a prompt (as the document allows): see test_server_api
    # unknown role
    ("role-chat", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, None, "messages.0.role"),
    ("role-messages", MSG, msg(messages=[{"role": "wizard", "content": "hi"}]), 400, None, None),
    # n out of range
    ("n-zero", CHAT, chat(n=0), 400, "invalid_value", "n"),
    ("n-too-many", CHAT, chat(n=129), 400, None, "n"),
    ("n-negative-completions", CMPL, cmpl(n=-1), 400, None, "n"),
    # max_tokens < 1, or beyond the context
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "invalid_value", "max_tokens"),
    ("max-completion-tokens-negative", CHAT, chat(max_completion_tokens=-3), 400, None, "max_completion_tokens"),
    ("max-tokens-zero-completions", CMPL, cmpl(max_tokens=0), 400, None, "max_tokens"),
    ("max-tokens-zero-messages", MSG, msg(max_tokens=0), 400, None, None),
    ("max-tokens-context-chat", CHAT, chat(max_tokens=10**7), 400, "context_length_exceeded", "max_tokens"),
    ("max-tokens-context-completions", CMPL, cmpl(max_tokens=10**7), 400, "context_length_exceeded", "max_tokens"),
    ("max-tokens-context-messages", MSG, msg(max_tokens=10**7), 400, None, None),
    # a prompt longer than max_model_len
    ("long-prompt-ids", CMPL, LONG, 400, "context_length_exceeded", "prompt"),
    ("long-prompt-chat", CHAT, LONG, 400, "context_length_exceeded", "prompt"),
    ("long-prompt-messages", MSG, LONG, 400, None, None),
    # invalid JSON schema
    ("schema-type", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}), 400, "invalid_json_schema", "response_format.json_schema.schema"),
    ("schema-not-object", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}), 400, "invalid_json_schema", None),
    ("schema-bad-ref", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}), 400, None, "response_format"),
    ("schema-guided-json", CMPL, cmpl(guided_json="{not json"), 400, "invalid_type", "guided_json"),  # a schema object, not JSON text
    ("schema-messages", MSG, msg(output_config={"format": {"type": "json_schema", "schema": {"type": 5}}}), 400, None, None),
    ("response-format-type", CHAT, chat(response_format={"type": "yaml"}), 400, None, "response_format.type"),
    # invalid structural tag
    ("tag-format", CHAT, chat(response_format={"type": "structural_tag", "format": {"type": "bogus"}}), 400, "invalid_structural_tag", "response_format"),
    ("tag-trigger", CHAT, chat(response_format={"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<x"]}), 400, "invalid_structural_tag", None),
    ("tag-no-triggers", CHAT, chat(response_format={"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}]}), 400, "invalid_structural_tag", "response_format.triggers"),
    ("tag-empty", CHAT, chat(response_format={"type": "structural_tag"}), 400, "invalid_structural_tag", None),
    ("tag-bad-schema", CHAT, chat(response_format={"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": "nonsense"}, "end": "</f>"}], "triggers": ["<f"]}), 400, "invalid_json_schema", None),
    # other values out of range
    ("temperature-negative", CHAT, chat(temperature=-1), 400, None, "temperature"),
    ("temperature-beyond-float32", CHAT, chat(temperature=1e308), 400, None, "temperature"),
    ("temperature-infinite", CHAT, b'{"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}', 400, None, "temperature"),
    ("repetition-penalty-beyond-float32", CMPL, cmpl(repetition_penalty=1e300), 400, None, "repetition_penalty"),
    ("top-p-zero", CHAT, chat(top_p=0), 400, None, "top_p"),
    ("top-k-zero", CMPL, cmpl(top_k=0), 400, None, "top_k"),
    ("presence-penalty", CHAT, chat(presence_penalty=5), 400, None, "presence_penalty"),
    ("logprobs-too-many", CMPL, cmpl(logprobs=50), 400, None, "logprobs"),
    ("top-logprobs-too-many", CHAT, chat(logprobs=True, top_logprobs=30), 400, None, "top_logprobs"),
    ("top-logprobs-alone", CHAT, chat(top_logprobs=2), 400, None, "top_logprobs"),
    ("token-out-of-vocab", CMPL, cmpl(prompt=[1, 2, 10**9]), 400, None, "prompt"),
    ("negative-token", CMPL, cmpl(prompt=[-1]), 400, None, "prompt"),
    ("empty-prompt", CMPL, cmpl(prompt=[]), 400, None, "prompt"),
    ("empty-prompt-in-batch", CMPL, cmpl(prompt=[[1, 2], []]), 400, None, "prompt"),
    ("image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, None, "messages.0.content.0.type"),
    ("image-block", MSG, msg(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400, None, None),
    ("best-of", CMPL, cmpl(best_of=3), 400, None, "best_of"),
    ("lone-surrogate-chat", CHAT, b'{"model": "test-model", "messages": [{"role": "user", "content": "a\\ud800"}]}', 400, None, "messages"),
    ("lone-surrogate-prompt", CMPL, b'{"model": "test-model", "prompt": "a\\ud800"}', 400, None, "prompt"),
    ("text-plain-body", CHAT, ("text/plain", b'{"model": "test-model", "messages": []}'), 400, None, None),
    ("deeply-nested", CHAT, b"[" * 100000 + b"]" * 100000, 400, None, None),
]


def _long_body(path: str, max_len: int) -> dict:
    if path == CMPL:
        return cmpl(prompt=[65] * (max_len + 5))
    text = "a " * (max_len + 5)
    if path == MSG:
        return msg(messages=[{"role": "user", "content": text}])
    return chat(messages=[{"role": "user", "content": text}])


def check_error(resp: httpx.Response, path: str, status: int, code=None, param=None) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body) == {"type", "error"}
        assert set(body["error"]) == {"type", "message"}
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        assert body["error"]["type"] == {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 413: "request_too_large", 503: "overloaded_error"}[status]
    else:
        assert set(body) == {"error"}
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert isinstance(err["message"], str) and err["message"]
        assert err["type"] == {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 503: "overloaded_error"}[status]
        if code is not None:
            assert err["code"] == code, err
        if param is not None:
            assert err["param"] == param, err
    return body


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(srv, case):
    _, path, body, status, code, param = case
    if body is LONG:
        body = _long_body(path, srv.engine.max_model_len)
    if isinstance(body, tuple):  # (content type, bytes)
        resp = httpx.post(srv.url + path, content=body[1], headers={"content-type": body[0]})
    elif isinstance(body, bytes):
        resp = httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"})
    else:
        resp = httpx.post(srv.url + path, json=body)
    check_error(resp, path, status, code, param)


@pytest.mark.parametrize("path", [CHAT, CMPL, MSG])
def test_bad_input_when_streaming(srv, path):
    """A streamed request fails before its stream starts: a plain error answer."""
    body = {CHAT: chat, CMPL: cmpl, MSG: msg}[path](max_tokens=0, stream=True)
    check_error(httpx.post(srv.url + path, json=body), path, 400)


def test_unknown_route_and_method(srv):
    check_error(httpx.post(srv.url + "/v1/nothing", json={}), "/v1/nothing", 404)
    check_error(httpx.get(srv.url + CHAT), CHAT, 405)
    assert httpx.head(srv.url + "/health").status_code == 200


def test_still_serving_and_nothing_held(srv):
    r = httpx.post(srv.url + CHAT, json=chat(max_tokens=3), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert httpx.get(srv.url + "/health").status_code == 200
    assert free_pages_back(srv.engine, srv.engine.stats()["num_pages"])


# ---------------------------------------------------------------------------
# API keys, the body limit, a full queue (on the fake engine)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    e = fake_engine()
    yield e
    e.close()


def test_api_key(engine):
    with serve(engine, names=[MODEL], api_key="sekret") as s:
        check_error(httpx.post(s.url + CHAT, json=chat()), CHAT, 401, "invalid_api_key")
        bad = {"Authorization": "Bearer wrong"}
        check_error(httpx.post(s.url + CHAT, json=chat(), headers=bad), CHAT, 401, "invalid_api_key")
        check_error(httpx.get(s.url + "/v1/models"), "/v1/models", 401)
        check_error(httpx.post(s.url + "/tokenize", json={"prompt": "x"}), "/tokenize", 401)
        good = {"Authorization": "Bearer sekret"}
        assert httpx.post(s.url + CHAT, json=chat(), headers=good).status_code == 200
        # Anthropic routes: x-api-key (what the anthropic client sends) or a Bearer token
        check_error(httpx.post(s.url + MSG, json=msg()), MSG, 401)
        check_error(httpx.post(s.url + MSG, json=msg(), headers={"x-api-key": "wrong"}), MSG, 401)
        assert httpx.post(s.url + MSG, json=msg(), headers={"x-api-key": "sekret"}).status_code == 200
        assert httpx.post(s.url + MSG, json=msg(), headers=good).status_code == 200
        # x-api-key is Anthropic's header, not OpenAI's
        check_error(httpx.post(s.url + CHAT, json=chat(), headers={"x-api-key": "sekret"}), CHAT, 401)
        # the official clients send their key
        import anthropic
        import openai

        assert openai.OpenAI(base_url=s.url + "/v1", api_key="sekret").models.list().data[0].id == MODEL
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0).models.list()
        a = anthropic.Anthropic(base_url=s.url, api_key="sekret")
        assert a.messages.count_tokens(model=MODEL, messages=HI).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=s.url, api_key="nope", max_retries=0).messages.count_tokens(model=MODEL, messages=HI)
        # open routes
        for path in ("/health", "/ready", "/metrics", "/version"):
            assert httpx.get(s.url + path).status_code == 200, path


def test_api_key_from_environment(engine, monkeypatch):
    monkeypatch.setenv("PLINTH_API_KEY", "from-env")
    with serve(engine, names=[MODEL]) as s:
        check_error(httpx.post(s.url + CHAT, json=chat()), CHAT, 401)
        assert httpx.post(s.url + CHAT, json=chat(), headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_body_too_large(engine):
    with serve(engine, names=[MODEL], max_request_body_bytes=2048) as s:
        big = chat(messages=[{"role": "user", "content": "x" * 4000}])
        check_error(httpx.post(s.url + CHAT, json=big), CHAT, 413, "request_too_large")
        check_error(httpx.post(s.url + MSG, json=msg(messages=[{"role": "user", "content": "x" * 4000}])), MSG, 413)

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b" " * 1000

        resp = httpx.post(s.url + CMPL, content=chunks(), headers={"content-type": "application/json"})
        check_error(resp, CMPL, 413)
        # under the limit: fine
        assert httpx.post(s.url + CHAT, json=chat()).status_code == 200


def test_full_queue_503():
    engine = fake_engine(max_num_seqs=1, max_waiting_requests=2, delay=0.01)
    try:
        with serve(engine, names=[MODEL]) as s:
            long = chat(max_tokens=400, stream=True, ignore_eos=True)
            stop = threading.Event()
            started = []

            def hold():
                with httpx.stream("POST", s.url + CHAT, json=long, timeout=60) as r:
                    started.append(r.status_code)
                    for _ in r.iter_lines():
                        if stop.is_set():
                            return

            threads = [threading.Thread(target=hold, daemon=True) for _ in range(3)]
            for t in threads:
                t.start()
                wait_for(lambda n=len(started): len(started) > n, 10)
            # one runs, two wait: the queue is full
            assert wait_for(lambda: engine.stats()["running"] == 1 and engine.stats()["waiting"] == 2, 10), engine.stats()
            resp = httpx.post(s.url + CHAT, json=chat())
            check_error(resp, CHAT, 503, "overloaded")
            assert int(resp.headers["retry-after"]) >= 1
            check_error(httpx.post(s.url + MSG, json=msg()), MSG, 503)
            stop.set()
            for t in threads:
                t.join(30)
            assert started == [200, 200, 200]
            # the clients left: their requests were aborted and the server answers again
            assert free_pages_back(engine, engine.stats()["num_pages"])
            assert httpx.post(s.url + CHAT, json=chat()).status_code == 200
    finally:
        engine.close()


ODD_VALUES = [None, -1, 0, 2, 1.5, 1e308, -1e308, 10**30, "", "x", "\u0000", [], [1], ["a", None], {}, {"a": 1}, True]
FUZZ_BODIES = {
    CHAT: chat(
        temperature=0.5, top_p=0.9, top_k=5, min_p=0.0, n=1, seed=1, stop=["\n"], stop_token_ids=[1], presence_penalty=0.1,
        frequency_penalty=0.1, repetition_penalty=1.1, ignore_eos=False, min_tokens=0, logprobs=True, top_logprobs=1,
        response_format={"type": "text"}, stream=False, stream_options={"include_usage": True}, user="u",
        max_completion_tokens=2, chat_template_kwargs={}, add_generation_prompt=True, skip_special_tokens=True,
        include_stop_str_in_output=False, tools=[], guided_regex="a+",
    ),
    CMPL: cmpl(echo=False, logprobs=1, best_of=1, suffix=None, logit_bias={}, guided_json={"type": "object"}),
    MSG: msg(system="s", stop_sequences=["\n"], temperature=0.5, top_p=0.9, top_k=5, metadata={}, stream=False),
}


def test_fuzzed_fields_never_500(engine, caplog):
    """Every field of a valid request set to odd values: answers are 200 or
    4xx, and no value the server lets through breaks the sampler (a NaN
    distribution would sample tokens the grammar forbids)."""
    statuses: dict[int, int] = {}
    with serve(engine, names=[MODEL]) as srv, httpx.Client(timeout=60) as client:
        _fuzz(srv, client, statuses)
        assert client.get(srv.url + "/health").status_code == 200
    assert statuses.get(200) and statuses.get(400)
    assert "grammar rejected" not in caplog.text


def _fuzz(srv, client: httpx.Client, statuses: dict[int, int]) -> None:
    for path, valid in FUZZ_BODIES.items():
        for field in list(valid) + ["messages.0.content", "messages.0"]:
            for value in ODD_VALUES:
                body = json.loads(json.dumps(valid))
                if field.startswith("messages.") and "messages" in body:
                    if field == "messages.0":
                        body["messages"][0] = value
                    else:
                        body["messages"][0]["content"] = value
                elif field.startswith("messages."):
                    continue
                else:
                    body[field] = value
                body["stream"] = False if field != "stream" else value
                if field not in ("max_tokens", "max_completion_tokens", "n"):
                    body["max_tokens"] = body.get("max_tokens") if path == MSG else 2
                resp = client.post(srv.url + path, json=body)
                statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
                assert resp.status_code < 500, (path, field, value, resp.text)
                if resp.status_code >= 400:
                    check_error(resp, path, resp.status_code)
