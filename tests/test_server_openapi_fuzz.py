"""The schema is the validation: schemathesis, the `st` CLI with every
check, against a server on 127.0.0.1 finds no schema-violating body
accepted, no valid body refused, no Allow header that differs from the
document, no 5xx and no response off its schema.

The server is the real engine (scheduler, KV pool, sampler, detokenizer,
grammar masks) over a random bigram model (tests/server_fixtures.py). The run
is bounded: the model pinned by the document (``model`` is an enum of the
served names), tokens capped in generated valid requests
(tests/openapi_fuzz_hooks.py), a fixed seed, a few examples per operation
(a few thousand requests with schemathesis' coverage phase, ~40 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_fixtures import fake_engine, free_pages_back, serve

pytest.importorskip("schemathesis")

MODEL = "test-model"
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def srv():
    # a context long enough for any prompt a generated body holds (the document cannot bound a prompt's tokens)
    engine = fake_engine(delay=0, max_model_len=8192, num_pages=2048)
    with serve(engine, names=[MODEL]) as s:
        yield s
    engine.close()


@pytest.mark.timeout(600)
def test_a_schema_fuzzer_finds_no_mismatch(srv, tmp_path):
    baseline = srv.engine.stats()["num_pages"]
    st = Path(sys.executable).parent / "st"
    cmd = [str(st), "run", srv.url + "/openapi.json", "--checks", "all", "--phases", "examples,coverage,fuzzing",
           "--max-examples", "10", "--seed", "46", "--workers", "1", "--request-timeout", "60", "--no-color"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(TESTS), "SCHEMATHESIS_HOOKS": "openapi_fuzz_hooks"}
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=540)
    report = out.stdout + out.stderr
    print(report[-3000:])
    assert out.returncode == 0, report[-12000:]
    assert "No issues found" in report and "15/15" in report, report[-3000:]
    assert free_pages_back(srv.engine, baseline)
    assert httpx.get(srv.url + "/health").status_code == 200


# the eleven mismatches schemathesis found before the request models became the validation (issue 46)
VIOLATING = [
    ("/detokenize", {"tokens": ["1"]}),
    ("/tokenize", {"prompt": "hi", "return_token_strs": "true"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": "false", "max_tokens": 2}),
    ("/v1/completions", {"prompt": [[False]], "max_tokens": 2}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "output_format": "json"}),
    # an output_format beside output_config was never read, so never checked
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
                      "output_format": {"type": "json_schema", "schema": 5}}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [{"type": "redacted_thinking"}]}]}),
    ("/v1/responses", {"input": "hi", "seed": "5", "max_output_tokens": 2}),
    # found by the same run beside the list: a bias given as text
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {"0": "1.5"}}),
]
VALID = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {"65": 1.5, "0": -100}}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "system", "content": "be brief"}]}),
]


@pytest.mark.parametrize(("path", "body"), VIOLATING, ids=[f"{p}-{i}" for i, (p, _) in enumerate(VIOLATING)])
def test_a_body_the_document_refuses_is_refused(srv, path, body):
    r = httpx.post(srv.url + path, json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text


@pytest.mark.parametrize(("path", "body"), VALID, ids=[p for p, _ in VALID])
def test_a_body_the_document_allows_is_answered(srv, path, body):
    r = httpx.post(srv.url + path, json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 200, r.text


def test_logit_bias_keys_are_what_the_document_says(srv):
    doc = httpx.get(srv.url + "/openapi.json").json()
    names = doc["components"]["schemas"]["CompletionRequest"]["properties"]["logit_bias"]["anyOf"][0]["propertyNames"]
    import re

    pattern = re.compile(names["pattern"])
    vocab = srv.engine.model_config.vocab_size
    for key, ok in (("0", True), (str(vocab - 1), True), (str(vocab), False), ("07", False), ("a", False), ("-1", False)):
        assert bool(pattern.match(key)) is ok, key
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "logit_bias": {key: 1}})
        assert (r.status_code == 200) is ok, (key, r.text)


@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_allow_names_every_documented_method(srv, path):
    doc = httpx.get(srv.url + "/openapi.json").json()
    documented = {m.upper() for m in doc["paths"][path]}
    r = httpx.options(srv.url + path)
    assert r.status_code == 405
    assert {m.strip() for m in r.headers["allow"].split(",")} == documented == {"GET", "HEAD"}


def test_openapi_documents_errors_and_typed_inputs(srv):
    doc = httpx.get(srv.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas  # FastAPI's 422 is never sent
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
            if method == "post":
                body = op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
                assert body.endswith("AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"), path
                assert {"401", "404", "413"} <= set(op["responses"])
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"):
        assert "Retry-After" in doc["paths"][path]["post"]["responses"]["503"]["headers"]
    items = schemas["ResponsesRequest"]["properties"]["input"]["anyOf"][1]["items"]["oneOf"]
    assert {i["$ref"].rsplit("/", 1)[1] for i in items} == {"MessageItem", "FunctionCallItem", "FunctionCallOutputItem", "ReasoningItem"}
    assert schemas["ChatCompletionRequest"]["properties"]["model"]["anyOf"][0]["enum"] == [MODEL]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    # the error bodies the server sends match the documented ones
    r = httpx.post(srv.url + "/v1/responses", json={"model": MODEL, "input": [{"type": "image", "url": "x"}]})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
