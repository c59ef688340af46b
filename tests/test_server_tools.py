"""Tool calling, reasoning and logit_bias through the official clients, on a
real server over the real engine.

Two fake models: a scripted one that writes a fixed answer for a prompt
holding a given key (the model's own tool-call format, parsed by the plugin
parsers: auto tool choice, reasoning, malformed calls), and the random bigram
model under a grammar (required and named tool choices: valid by
construction, whatever the model).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch
from server_fixtures import EOS, BigramRunner, fake_engine, serve

MODEL = "tools-model"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
SCRIPTS = {
    "KEY-CALL": "Let me look.\n" + CALL,
    "KEY-PAIR": CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
    "KEY-THINK": "<think>\nThe user wants the weather.\n</think>\n\n" + CALL,
    "KEY-REASON": "<think>\nBlue is common.\n</think>\n\nBlue.",
    "KEY-BROKEN": '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
    "KEY-RESULT": "It is 21 degrees in Paris.",  # after a tool result
}


class ScriptRunner(BigramRunner):
    """Writes SCRIPTS[key] (then <eos>) for a prompt that holds the key;
    the bigram model's logits for any other prompt."""

    def execute(self, batch, rows):
        owners = []
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=False):
            c = seq.num_computed
            owners.extend((seq, p) for p in range(c, c + n))
        base = super().execute(batch, rows)
        for r, row in enumerate(rows):
            seq, pos = owners[row]
            prompt = bytes(t for t in seq.token_ids[: seq.num_prompt_tokens] if t < 256).decode("utf-8", "replace")
            # the latest key wins: a follow-up turn holds the first turn's key too
            found = [(prompt.rfind(k), k) for k in SCRIPTS if k in prompt]
            if not found:
                continue
            script = SCRIPTS[max(found)[1]].encode()
            i = pos + 1 - seq.num_prompt_tokens
            target = script[i] if i < len(script) else EOS
            base[r] = -30.0
            base[r, target] = 30.0
        return base


@pytest.fixture(scope="module")
def srv():
    engine = fake_engine()
    engine.engine.executor.runner = ScriptRunner(delay=0.0)
    with serve(engine, names=[MODEL], tool_call_parser="hermes", reasoning_parser="qwen3") as s:
        yield s
    engine.close()


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)


def user(text):
    return [{"role": "user", "content": text}]


def assemble(stream):
    """A streamed chat answer put together as the OpenAI client's users do."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert slot["id"] is None, "a call's id comes once"
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    assert slot["name"] is None, "a call's name comes once, first"
                    assert slot["arguments"] == ""
                    slot["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    assert slot["name"] is not None
                    slot["arguments"] += tc.function.arguments
            finish = c.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


# ---------------------------------------------------------------------------
# OpenAI chat: auto tool choice, parsed from the model's own format
# ---------------------------------------------------------------------------


def test_tool_call(oai):
    r = oai.chat.completions.create(model=MODEL, messages=user("KEY-CALL weather?"), tools=[WEATHER, TIME], max_tokens=200)
    (c,) = r.choices
    assert c.finish_reason == "tool_calls"
    assert c.message.content == "Let me look."
    (call,) = c.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


def test_tool_call_streamed_as_the_client_assembles_it(oai):
    stream = oai.chat.completions.create(
        model=MODEL, messages=user("KEY-CALL weather?"), tools=[WEATHER, TIME], max_tokens=200, stream=True
    )
    content, reasoning, calls, finish = assemble(stream)
    assert finish == "tool_calls" and reasoning == ""
    assert content.strip() == "Let me look."
    (call,) = calls
    assert call["id"].startswith("call_") and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris", "days": 2}


def test_arguments_arrive_in_pieces(srv):
    body = {"model": MODEL, "messages": user("KEY-CALL"), "tools": [WEATHER], "max_tokens": 200, "stream": True}
    pieces = []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    for tc in c["delta"].get("tool_calls") or []:
                        pieces.append(tc)
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    assert all("name" not in p["function"] and "id" not in p for p in pieces[1:])
    assert len(pieces) > 3  # the arguments streamed as they were written
    assert json.loads("".join(p["function"]["arguments"] for p in pieces)) == {"city": "Paris", "days": 2}


def test_parallel_pair(oai):
    for stream in (False, True):
        r = oai.chat.completions.create(model=MODEL, messages=user("KEY-PAIR"), tools=[WEATHER, TIME], max_tokens=300, stream=stream)
        if stream:
            content, _, calls, finish = assemble(r)
            got = [(c["name"], json.loads(c["arguments"]), c["id"]) for c in calls]
        else:
            content, finish = r.choices[0].message.content, r.choices[0].finish_reason
            got = [(c.function.name, json.loads(c.function.arguments), c.id) for c in r.choices[0].message.tool_calls]
        assert finish == "tool_calls" and not content
        assert [g[:2] for g in got] == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"})]
        assert len({g[2] for g in got}) == 2  # distinct ids


def test_tool_choice_none_leaves_calls_as_text(oai):
    r = oai.chat.completions.create(model=MODEL, messages=user("KEY-CALL"), tools=[WEATHER], tool_choice="none", max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert c.message.content == SCRIPTS["KEY-CALL"]


def test_malformed_call_is_text(oai):
    for stream in (False, True):
        r = oai.chat.completions.create(model=MODEL, messages=user("KEY-BROKEN"), tools=[WEATHER], max_tokens=200, stream=stream)
        if stream:
            content, _, calls, finish = assemble(r)
        else:
            content, calls, finish = r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert finish == "stop"
        assert content == SCRIPTS["KEY-BROKEN"]
        # unstreamed: no call at all; streamed: the pieces already sent cannot be
        # taken back (the stream ends "stop", with the text as content)
        assert not calls or stream


def test_tool_result_round_trip(oai, srv):
    first = oai.chat.completions.create(model=MODEL, messages=user("KEY-CALL"), tools=[WEATHER], max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    messages = user("KEY-CALL weather in Paris?") + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "KEY-RESULT 21C"},
    ]
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=100)
    assert r.choices[0].message.content == SCRIPTS["KEY-RESULT"] and r.choices[0].finish_reason == "stop"
    # the template got the call (as text: this template has no tool_calls of its own) and the result
    tok = httpx.post(srv.url + "/tokenize", json={"messages": messages, "return_token_strs": False}, timeout=30).json()
    text = bytes(t for t in tok["tokens"] if t < 256).decode()
    assert '"get_weather"' in text and "<|im_start|>tool\nKEY-RESULT 21C" in text


def test_reasoning_content(oai):
    r = oai.chat.completions.create(model=MODEL, messages=user("KEY-REASON"), max_tokens=100)
    m = r.choices[0].message
    assert m.content == "Blue." and m.model_extra["reasoning_content"] == "Blue is common."
    content, reasoning, calls, _ = assemble(oai.chat.completions.create(model=MODEL, messages=user("KEY-REASON"), max_tokens=100, stream=True))
    assert (content, reasoning.strip(), calls) == ("Blue.", "Blue is common.", [])


def test_reasoning_then_tool_call(oai):
    r = oai.chat.completions.create(model=MODEL, messages=user("KEY-THINK"), tools=[WEATHER], max_tokens=300)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "The user wants the weather."
    assert m.tool_calls[0].function.name == "get_weather" and not m.content


# ---------------------------------------------------------------------------
# required and named tool choices: enforced by the grammar
# ---------------------------------------------------------------------------


def _valid(call, tools=(WEATHER, TIME)):
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_named_tool_choice(oai, seed):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = oai.chat.completions.create(
        model=MODEL, messages=user("anything"), tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200, seed=seed
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    _valid(call)
    stream = oai.chat.completions.create(
        model=MODEL, messages=user("anything"), tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200, seed=seed, stream=True
    )
    _, _, calls, finish = assemble(stream)
    assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


#: the random model, free to add calls, would rarely stop: "]" is made likely where the grammar allows it
CLOSE = {str(ord("]")): 8}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice(oai, parallel):
    for seed in range(3):
        r = oai.chat.completions.create(
            model=MODEL, messages=user("anything"), tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=parallel, max_tokens=300, seed=seed, temperature=0.7, logit_bias=CLOSE,
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        if not parallel:
            assert len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            _valid(call)
        _, _, calls, finish = assemble(oai.chat.completions.create(
            model=MODEL, messages=user("anything"), tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=parallel, max_tokens=300, seed=seed, temperature=0.7, logit_bias=CLOSE, stream=True,
        ))
        assert [(x["name"], x["arguments"]) for x in calls] == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_bad_tool_requests_are_400(srv):
    url = srv.url + "/v1/chat/completions"
    cases = [
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required"},
        {"tools": [WEATHER], "tool_choice": "sometimes"},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
        {"tools": [WEATHER, WEATHER]},
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]},
        {"logit_bias": {"abc": 1}},
        {"logit_bias": {"65": 101}},
        {"logit_bias": {"99999": 1}},
    ]
    for extra in cases:
        body = {"model": MODEL, "messages": user("hi"), "max_tokens": 5, **extra}
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------
# logit_bias
# ---------------------------------------------------------------------------


def test_logit_bias(oai):
    r = oai.completions.create(model=MODEL, prompt="x", max_tokens=8, logit_bias={str(ord("A")): 100}, seed=0)
    assert r.choices[0].text == "A" * 8
    r = oai.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=8, logit_bias={str(ord("B")): 100})
    assert r.choices[0].message.content == "B" * 8
    banned = {str(t): -100 for t in range(ord("a"), ord("z") + 1)}
    r = oai.completions.create(model=MODEL, prompt="x", max_tokens=40, logit_bias=banned, seed=0, temperature=1.0)
    assert not any("a" <= ch <= "z" for ch in r.choices[0].text)


def test_sampler_adds_the_bias():
    from plinth.engine.sampler import Sampler, SampleRow
    from plinth.engine.sampling_params import SamplingParams

    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    rows = [
        SampleRow(SamplingParams(temperature=0, logit_bias={7: 10.0}), [1], [], None),
        SampleRow(SamplingParams(temperature=0), [1], [], None),
    ]
    tokens, _ = Sampler()(logits, rows)
    assert tokens == [7, 3]


# ---------------------------------------------------------------------------
# Anthropic messages
# ---------------------------------------------------------------------------

A_WEATHER = {"name": "get_weather", "description": "The weather", "input_schema": WEATHER["function"]["parameters"]}
A_TIME = {"name": "get_time", "input_schema": TIME["function"]["parameters"]}


def test_anthropic_tool_use(claude):
    msg = claude.messages.create(model=MODEL, max_tokens=200, tools=[A_WEATHER, A_TIME], messages=user("KEY-CALL"))
    assert msg.stop_reason == "tool_use"
    text, use = msg.content
    assert text.type == "text" and text.text == "Let me look."
    assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == {"city": "Paris", "days": 2}


def test_anthropic_tool_use_streamed(claude):
    with claude.messages.stream(model=MODEL, max_tokens=200, tools=[A_WEATHER, A_TIME], messages=user("KEY-PAIR")) as stream:
        kinds = [e.type for e in stream]
        msg = stream.get_final_message()
    assert "input_json" in kinds  # the client's event for an input_json_delta
    assert msg.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in msg.content] == [
        ("tool_use", "get_weather", {"city": "Paris", "days": 2}),
        ("tool_use", "get_time", {"tz": "CET"}),
    ]
    assert len({b.id for b in msg.content}) == 2


def test_anthropic_tool_result_round_trip(claude, srv):
    first = claude.messages.create(model=MODEL, max_tokens=200, tools=[A_WEATHER], messages=user("KEY-CALL"))
    use = first.content[-1]
    messages = user("KEY-CALL") + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "KEY-RESULT 21C"}]},
    ]
    msg = claude.messages.create(model=MODEL, max_tokens=100, tools=[A_WEATHER], messages=messages)
    assert msg.stop_reason == "end_turn" and msg.content[0].text == SCRIPTS["KEY-RESULT"]
    n = claude.messages.count_tokens(model=MODEL, tools=[A_WEATHER], messages=messages).input_tokens
    assert n == msg.usage.input_tokens


def test_anthropic_thinking(claude):
    msg = claude.messages.create(model=MODEL, max_tokens=100, messages=user("KEY-REASON"))
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "Blue is common." and msg.content[1].text == "Blue."
    with claude.messages.stream(model=MODEL, max_tokens=300, messages=user("KEY-THINK"), tools=[A_WEATHER]) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_message()
    assert "thinking" in kinds
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking.strip() == "The user wants the weather."
    assert final.content[1].input == {"city": "Paris", "days": 2} and final.stop_reason == "tool_use"


def test_anthropic_forced_tool(claude):
    for choice in ({"type": "tool", "name": "get_time"}, {"type": "any", "disable_parallel_tool_use": True}):
        for stream in (False, True):
            kwargs = dict(model=MODEL, max_tokens=200, tools=[A_WEATHER, A_TIME], tool_choice=choice, messages=user("anything"))
            if stream:
                with claude.messages.stream(**kwargs) as s:
                    msg = s.get_final_message()
            else:
                msg = claude.messages.create(**kwargs)
            assert msg.stop_reason == "tool_use"
            (use,) = msg.content
            if choice["type"] == "tool":
                assert use.name == "get_time"
            schema = (A_WEATHER if use.name == "get_weather" else A_TIME)["input_schema"]
            jsonschema.validate(use.input, schema)


def test_anthropic_bad_tools_are_400(srv):
    cases = [
        {"tool_choice": {"type": "tool", "name": "nope"}, "tools": [A_WEATHER]},
        {"tool_choice": {"type": "any"}},
        {"tool_choice": {"type": "sometimes"}, "tools": [A_WEATHER]},
        {"tools": [{"name": "f", "input_schema": {"type": 3}}]},
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "x", "name": 3, "input": {}}]}]},
    ]
    for extra in cases:
        body = {"model": MODEL, "max_tokens": 5, "messages": user("hi"), **extra}
        r = httpx.post(srv.url + "/v1/messages", json=body, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["type"] == "error"


# ---------------------------------------------------------------------------
# the Responses API
# ---------------------------------------------------------------------------

R_WEATHER = {"type": "function", **WEATHER["function"]}
R_TIME = {"type": "function", **TIME["function"]}


def test_responses_plain(oai):
    r = oai.responses.create(model=MODEL, input="KEY-RESULT please", instructions="Be brief.", max_output_tokens=100)
    assert r.id.startswith("resp_") and r.status == "completed" and r.object == "response"
    assert r.output_text == SCRIPTS["KEY-RESULT"]
    assert r.usage.input_tokens > 0 and r.usage.output_tokens == len(SCRIPTS["KEY-RESULT"]) + 1
    short = oai.responses.create(model=MODEL, input="KEY-RESULT please", max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.output_text == SCRIPTS["KEY-RESULT"][:3]


def test_responses_streamed(oai):
    kinds, text = [], ""
    with oai.responses.stream(model=MODEL, input=[{"role": "user", "content": "KEY-REASON"}], max_output_tokens=100) as stream:
        for e in stream:
            kinds.append(e.type)
            if e.type == "response.output_text.delta":
                text += e.delta
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and text == "Blue."
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "Blue."


def test_responses_function_call_round_trip(oai):
    r = oai.responses.create(model=MODEL, input="KEY-CALL", tools=[R_WEATHER, R_TIME], max_output_tokens=200)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert calls[0].call_id.startswith("call_")
    with oai.responses.stream(model=MODEL, input="KEY-PAIR", tools=[R_WEATHER, R_TIME], max_output_tokens=300) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert [(o.name, json.loads(o.arguments)) for o in final.output] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {"tz": "CET"}),
    ]
    follow = oai.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "KEY-CALL"}, calls[0].model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "KEY-RESULT 21C"}],
        tools=[R_WEATHER],
        max_output_tokens=100,
    )
    assert follow.output_text == SCRIPTS["KEY-RESULT"]


def test_responses_forced_and_json_schema(oai):
    r = oai.responses.create(model=MODEL, input="anything", tools=[R_WEATHER, R_TIME],
                             tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=100)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME["function"]["parameters"])
    schema = WEATHER["function"]["parameters"]
    r = oai.responses.create(model=MODEL, input="anything", max_output_tokens=100,
                             text={"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_responses_bad_input_is_400(srv):
    for body in (
        {"input": "hi", "previous_response_id": "resp_x"},
        {"input": [{"type": "image", "url": "x"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        {"input": "hi", "text": {"format": {"type": "xml"}}},
        {"input": "hi", "tool_choice": "required"},
        {"input": 3},
    ):
        r = httpx.post(srv.url + "/v1/responses", json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------
# choosing parsers: by name, or from the chat template
# ---------------------------------------------------------------------------


def test_parsers_are_registered_and_chosen_from_the_template():
    from plinth.errors import PluginError
    from plinth.plugins import PluginRegistry
    from plinth.server.tools import resolve_parser

    reg = PluginRegistry.discover()
    assert {"hermes", "qwen", "llama3_json", "mistral", "deepseek_v3", "kimi_k2"} <= set(reg.names("tool_parser"))
    assert {"qwen3", "deepseek_r1"} <= set(reg.names("reasoning_parser"))
    rows = {(r["category"], r["name"]): r for r in reg.report()}
    assert rows[("tool_parser", "hermes")]["status"] == "ok"  # what `platform plugins` lists

    qwen3_template = "{% if tools %}<tools>...</tools> <tool_call>{...}</tool_call>{% endif %}<think>\n\n</think>"
    assert resolve_parser(reg, "tool_parser", "auto", qwen3_template).__name__ == "HermesToolParser"
    assert resolve_parser(reg, "reasoning_parser", "auto", qwen3_template).__name__ == "ThinkReasoningParser"
    assert resolve_parser(reg, "tool_parser", "auto", "<|tool_calls_section_begin|>").__name__ == "KimiK2ToolParser"
    assert resolve_parser(reg, "tool_parser", "auto", "[TOOL_CALLS]").__name__ == "MistralToolParser"
    assert resolve_parser(reg, "tool_parser", "auto", "plain ChatML") is None
    assert resolve_parser(reg, "tool_parser", "none", qwen3_template) is None
    assert resolve_parser(reg, "tool_parser", "llama3_json", None).__name__ == "Llama3JsonToolParser"
    with pytest.raises(PluginError, match="hermes"):
        resolve_parser(reg, "tool_parser", "no_such_parser", None)


# ---------------------------------------------------------------------------
# the real default model (SmolLM2's template has no tool markers: forced calls)
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_forced_tool_calls(smollm2_async_engine):
    with serve(smollm2_async_engine, names=[MODEL]) as s:
        oai = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = oai.chat.completions.create(
            model=MODEL, messages=user("What is the weather in Paris for the next 2 days?"), tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0,
        )
        (call,) = r.choices[0].message.tool_calls
        _valid(call)
        claude = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0, timeout=300)
        with claude.messages.stream(
            model=MODEL, max_tokens=80, tools=[A_WEATHER, A_TIME], tool_choice={"type": "any", "disable_parallel_tool_use": True},
            messages=user("What time is it in Paris?"), extra_body={"temperature": 0},
        ) as stream:
            msg = stream.get_final_message()
        (use,) = msg.content
        assert msg.stop_reason == "tool_use"
        jsonschema.validate(use.input, (A_WEATHER if use.name == "get_weather" else A_TIME)["input_schema"])


def test_405_carries_allow(srv):
    r = httpx.get(srv.url + "/v1/responses", timeout=30)
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_openapi_describes_streams(srv):
    doc = httpx.get(srv.url + "/openapi.json", timeout=30).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(content), path
