"""A schema-driven fuzz of the OpenAPI document (schemathesis), against a
server on 127.0.0.1: requests made from the document (positive) are mostly
accepted, requests that break it (negative) are refused with a 4xx, and
nothing is ever a 5xx. Bounded: a few examples per operation, derandomized."""

from __future__ import annotations

import collections

import httpx
import pytest
from server_fixtures import fake_engine, free_pages_back, serve

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

MODEL = "test-model"
EXAMPLES = {"positive": 15, "negative": 8}


@pytest.fixture(scope="module")
def srv():
    engine = fake_engine(delay=0)
    with serve(engine, names=[MODEL]) as s:
        yield s
    engine.close()


@pytest.mark.timeout(600)
def test_openapi_fuzz_finds_no_5xx_and_positive_cases_pass(srv):
    baseline = srv.engine.stats()["num_pages"]
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    statuses: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    bad: list[str] = []
    case_mode = [""]  # the mode the running generator draws in
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            case_mode[0] = mode.value

            @settings(
                max_examples=EXAMPLES[mode.value],
                deadline=None,
                derandomize=True,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                r = case.call(base_url=srv.url, timeout=60)
                statuses[case.operation.label, case_mode[0]][r.status_code] += 1
                if r.status_code >= 500:
                    bad.append(f"{case.operation.label} -> {r.status_code}: {case.body!r:.300} -> {r.text:.300}")

            try:
                run()
            except Unsatisfiable:  # nothing to break: an operation without parameters or body
                pass
    assert not bad, "\n".join(bad)
    positive = {k[0]: c for k, c in statuses.items() if k[1] == "positive"}
    accepted = sum(n for c in positive.values() for s, n in c.items() if s < 400)
    total = sum(sum(c.values()) for c in positive.values())
    print({k: dict(c) for k, c in statuses.items()})
    assert accepted >= 0.75 * total, positive
    for label, c in positive.items():
        assert any(s < 400 for s in c), f"{label}: no generated request was accepted: {dict(c)}"
    for (label, mode), c in statuses.items():
        if mode == "negative":
            assert all(400 <= s < 500 or s < 300 for s in c), (label, dict(c))
    assert free_pages_back(srv.engine, baseline)
    assert httpx.get(srv.url + "/health").status_code == 200


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
