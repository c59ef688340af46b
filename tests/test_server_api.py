"""The HTTP API through the official clients, on a real uvicorn server.

Each test runs against two engines: the real engine over a fake bigram model
(fast: every choice is exact, so streamed and unstreamed outputs of a seeded
request must match), and the real engine over SmolLM2-135M-Instruct (slow).
"""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import fake_engine, free_pages_back, serve

MODEL = "test-model"
BACKENDS = ["fake", pytest.param("smollm2", marks=pytest.mark.slow)]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=BACKENDS)
def srv(request):
    own = request.param == "fake"
    engine = fake_engine() if own else request.getfixturevalue("smollm2_async_engine")
    with serve(engine, names=[MODEL, "alias"]) as s:
        s.kind = request.param
        s.exact = own  # the fake model's logits do not depend on batching or caching
        yield s
    if own:
        engine.close()


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)


CHAT = [{"role": "user", "content": "Name three colours."}]


# ---------------------------------------------------------------------------
# OpenAI
# ---------------------------------------------------------------------------


def test_models(oai, srv):
    ids = [m.id for m in oai.models.list().data]
    assert ids == [MODEL, "alias"]
    assert oai.models.retrieve("alias").id == "alias"


def test_chat(oai, srv):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert isinstance(r.created, int)
    (c,) = r.choices
    assert c.index == 0 and c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    if c.finish_reason == "length":
        assert r.usage.completion_tokens == 8
    # the same prompt again: its full pages come from the prefix cache
    r2 = oai.chat.completions.create(model="alias", messages=CHAT, max_tokens=2, temperature=0)
    assert r2.model == "alias"
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_with_usage(oai, srv):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0, seed=7)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.id == chunks[0].id and ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    finishes = [ch.choices[0].finish_reason for ch in chunks[:-1] if ch.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1])
    assert chunks[-1].usage.completion_tokens >= 1
    if srv.exact:
        full = oai.chat.completions.create(**kwargs)
        assert text == full.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions(oai, srv):
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].text and r.choices[0].finish_reason in ("stop", "length")
    if srv.kind == "smollm2":
        assert r.choices[0].text.startswith(" Paris")
    # a batch of prompts (strings and token ids): choices in prompt order
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    r = oai.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == r.choices[1].text
    assert r.usage.prompt_tokens == 2 * len(ids)


def test_completions_stream(oai, srv):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=3)
    chunks = list(oai.completions.create(stream=True, **kwargs))
    assert all(ch.object == "text_completion" for ch in chunks)
    text = "".join(ch.choices[0].text for ch in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    if srv.exact:
        assert text == oai.completions.create(**kwargs).choices[0].text


def test_n3_distinct_with_seed(oai, srv):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, seed=1234, n=3)
    r = oai.chat.completions.create(**kwargs)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len(set(texts)) == 3, texts
    assert r.usage.completion_tokens >= 3
    # streamed: the choices interleave by index and add up to the same texts
    seen: dict[int, str] = {0: "", 1: "", 2: ""}
    order = []
    for ch in oai.chat.completions.create(stream=True, **kwargs):
        for c in ch.choices:
            seen[c.index] += c.delta.content or ""
            order.append(c.index)
    assert set(order) == {0, 1, 2}
    if srv.exact:
        assert [seen[i] for i in range(3)] == texts
        assert [c.message.content for c in oai.chat.completions.create(**kwargs).choices] == texts


def test_chat_logprobs(oai, srv):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=3, temperature=0)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.token, str) and isinstance(entry.bytes, list)
        if "\ufffd" not in entry.token:
            assert bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert "".join(e.token for e in content).strip() == r.choices[0].message.content.strip() or r.choices[0].finish_reason == "stop"
    # streamed logprobs arrive with their tokens
    n = 0
    for ch in oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=1, temperature=0, stream=True):
        if ch.choices and ch.choices[0].logprobs:
            n += len(ch.choices[0].logprobs.content)
    assert n == len(content)


def test_completion_logprobs_and_echo(oai, srv):
    prompt = "The capital of France is"
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=2, echo=True, temperature=0)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    n = r.usage.prompt_tokens + r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[r.usage.prompt_tokens] == len(prompt)  # offsets index the returned text
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=0, temperature=0)
    assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens


def test_stop(oai, srv):
    base = dict(model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = oai.completions.create(**base).choices[0].text
    stop = text[6:8] if srv.exact else "."
    assert stop in text
    r = oai.completions.create(stop=[stop, "@@never@@"], **base)
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert c.text == text[: text.index(stop)]
    # streamed text never shows a stop string, not even its first characters
    streamed = "".join(ch.choices[0].text for ch in oai.completions.create(stop=[stop], stream=True, **base))
    assert streamed == c.text
    # chat, with the stop string kept
    r = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stop=" ", extra_body={"include_stop_str_in_output": True, "ignore_eos": True}
    )
    if r.choices[0].finish_reason == "stop":
        assert r.choices[0].message.content.endswith(" ")


def test_json_schema_20_samples(oai, srv):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a person as JSON with name, age and city."}],
        max_tokens=60,
        temperature=1.0,
        seed=11,
        n=20,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    assert len(r.choices) == 20
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_json_object(oai, srv):
    r = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=40, temperature=0.7, seed=5, n=3, response_format={"type": "json_object"}
    )
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:  # cut off by max_tokens: still a valid prefix of JSON
            assert c.message.content.lstrip().startswith("{")


def test_structural_tag_format(oai, srv):
    """xgrammar's form: at least one tag, then stop."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}
    fmt = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<weather>"],
            "tags": [
                {
                    "type": "tag",
                    "begin": "<weather>",
                    # no runs of whitespace: a small model at temperature 0 may otherwise never close the object
                    "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
                    "end": "</weather>",
                }
            ],
            "at_least_one": True,
            "stop_after_first": True,
        },
    }
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0, response_format=fmt)
    text = r.choices[0].message.content
    m = re.search(r"<weather>(.*?)</weather>", text, re.S)
    assert m, text
    jsonschema.validate(json.loads(m.group(1)), schema)


def test_structural_tag_legacy(oai, srv):
    """vLLM's legacy form: free text; whatever follows a trigger is a valid tag."""
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
    fmt = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
        "triggers": ["<f"],
    }
    # the trigger's tokens favoured, so every run has tags to check (a model
    # left to itself may never write "<f"), and, less, the pieces of a short
    # tag's JSON: at temperature 2 a model may otherwise pad the JSON with
    # whitespace (which the schema allows) up to max_tokens. The bias favours
    # tokens, not their order: only the grammar makes what follows "<f" a
    # valid tag.
    def tokens(text):
        return httpx.post(srv.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    bias = {str(t): 10 for piece in ('"', ":", "1", "}") for t in tokens(piece)}
    bias.update({str(t): 30 for t in tokens("<f")})
    r = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=60, temperature=2.0, seed=2, n=4, response_format=fmt, logit_bias=bias
    )
    complete = 0
    for c in r.choices:
        text = c.message.content
        for start in (m.start() for m in re.finditer("<f", text)):
            tag = re.match(r"<f>(.*?)</f>", text[start:], re.S)
            if tag is None:  # only the last tag may be cut off, by max_tokens
                assert c.finish_reason == "length" and "</f>" not in text[start:], text
                continue
            jsonschema.validate(json.loads(tag.group(1)), schema)
            complete += 1
    assert complete > 0, [c.message.content for c in r.choices]


def test_guided_regex(oai, srv):
    r = oai.completions.create(
        model=MODEL, prompt="Phone:", max_tokens=20, temperature=1.0, seed=1, extra_body={"guided_regex": r"\d{3}-\d{4}"}
    )
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text), r.choices[0].text
    assert r.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------
# Anthropic
# ---------------------------------------------------------------------------


def test_messages_system_top_level_and_inline(claude, srv):
    top = claude.messages.create(
        model=MODEL, max_tokens=8, system="You are terse.", messages=CHAT, extra_body={"temperature": 0}
    )
    assert top.id.startswith("msg_") and top.type == "message" and top.role == "assistant"
    assert top.content[0].type == "text" and top.content[0].text
    assert top.stop_reason in ("end_turn", "max_tokens")
    assert top.usage.output_tokens >= 1
    inline = claude.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "system", "content": "You are terse."}, *CHAT], extra_body={"temperature": 0}
    )
    assert inline.usage.input_tokens == top.usage.input_tokens  # the same prompt
    blocks = claude.messages.create(
        model=MODEL, max_tokens=8, system=[{"type": "text", "text": "You are terse."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}], extra_body={"temperature": 0},
    )  # fmt: skip
    assert blocks.usage.input_tokens == top.usage.input_tokens
    if srv.exact:
        assert inline.content[0].text == top.content[0].text == blocks.content[0].text
    # no system prompt at all: another prompt (SmolLM2's template then adds its default one)
    none = claude.messages.create(model=MODEL, max_tokens=8, messages=CHAT, extra_body={"temperature": 0})
    assert none.usage.input_tokens != top.usage.input_tokens


def test_messages_stream_events(claude, srv):
    with claude.messages.stream(model=MODEL, max_tokens=10, messages=CHAT, extra_body={"temperature": 0.8}) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    raw = [e for e in events if e not in ("text",)]  # the client adds "text" helper events
    assert raw[0] == "message_start"
    assert raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) <= {"content_block_delta", "ping"}
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens >= 1
    # the raw SSE: event names match the data's type
    with httpx.stream(
        "POST", srv.url + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": CHAT, "stream": True}, timeout=60
    ) as resp:
        lines = [line for line in resp.iter_lines() if line]
    pairs = list(zip(lines[::2], lines[1::2], strict=False))
    for ev, data in pairs:
        assert ev.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == ev[7:]


def test_messages_stop_sequences(claude, srv):
    base = dict(model=MODEL, max_tokens=30, messages=CHAT, extra_body={"temperature": 0})
    text = claude.messages.create(**base).content[0].text
    if len(text) < 4:
        pytest.skip(f"output too short to pick a stop sequence from: {text!r}")
    stop = text[2:4]
    r = claude.messages.create(stop_sequences=[stop], **base)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop)]
    with claude.messages.stream(stop_sequences=[stop], **base) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == r.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_count_tokens(claude, srv):
    n = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=CHAT).input_tokens
    r = claude.messages.create(model=MODEL, max_tokens=1, system="Be brief.", messages=CHAT)
    assert n == r.usage.input_tokens > 0


# ---------------------------------------------------------------------------
# the rest of the surface
# ---------------------------------------------------------------------------


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_metrics(oai, srv):
    before = _samples(srv.url)
    oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    list(oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stream=True))
    after = _samples(srv.url)
    for name, at_least in [
        ("plinth:prompt_tokens_total", 2),
        ("plinth:generation_tokens_total", 2),
        ("plinth:request_success_total", 2),
        ("plinth:time_to_first_token_seconds_count", 2),
        ("plinth:e2e_request_latency_seconds_count", 2),
        ("plinth:http_requests_total", 3),
    ]:
        assert _total(after, name) - _total(before, name) >= at_least, name
    assert _total(after, "plinth:inter_token_latency_seconds_count") > 0
    assert _total(after, "plinth:time_per_output_token_seconds_count") > 0
    for gauge in ("plinth:num_requests_running", "plinth:num_requests_waiting", "plinth:kv_cache_usage_perc", "plinth:prefix_cache_hit_rate"):
        assert any(n == gauge for n, _ in after), gauge
    assert 0 < _total(after, "plinth:prefix_cache_hit_rate") <= 1
    ok = [v for (n, labels), v in after.items() if n == "plinth:http_requests_total" and ("status", "200") in labels]
    assert sum(ok) >= 3
    # vLLM's names beside plinth's (llm-d's scorers read these), same values, vLLM's labels
    for plinth_name, vllm_name in [
        ("plinth:prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("plinth:generation_tokens_total", "vllm:generation_tokens_total"),
        ("plinth:request_success_total", "vllm:request_success_total"),
        ("plinth:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
        ("plinth:e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"),
        ("plinth:time_per_output_token_seconds_count", "vllm:request_time_per_output_token_seconds_count"),
        ("plinth:inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
        ("plinth:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
        ("plinth:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
        ("plinth:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        ("plinth:num_requests_waiting", "vllm:num_requests_waiting"),
        ("plinth:num_requests_running", "vllm:num_requests_running"),
    ]:
        assert any(n == vllm_name for n, _ in after), vllm_name
        assert _total(after, vllm_name) == _total(after, plinth_name), vllm_name
    assert all(dict(labels).get("engine") == "0" and dict(labels).get("model_name") for (n, labels) in after if n.startswith("vllm:"))
    assert _total(after, "vllm:prefix_cache_queries_total") > 0


def test_tokenize_detokenize_version_health(srv):
    t = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] > 0
    d = httpx.post(srv.url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"].endswith("Hello world")
    chat = httpx.post(srv.url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > t["count"]
    v = httpx.get(srv.url + "/version").json()
    assert v["version"] and v["models"] == [MODEL, "alias"] and v["engine"]["max_model_len"] > 0
    if srv.kind == "smollm2":
        assert v["engine"]["backend"] and v["engine"]["device"]
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    assert httpx.get(srv.url + "/ready").status_code == 200


def test_idle_afterwards(srv):
    """Nothing above left pages held."""
    assert free_pages_back(srv.engine, srv.engine.stats()["num_pages"])


def test_messages_structured_output(claude, srv):
    """Anthropic's structured outputs: output_config.format."""
    r = claude.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "A person as JSON, please."}],
        output_config={"format": {"type": "json_schema", "schema": PERSON}},
        extra_body={"temperature": 0.8},
    )
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), PERSON)
