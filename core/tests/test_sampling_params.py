"""SamplingParams' bounds are stated once (``BOUNDS``): SamplingParams checks
them, and the server's request models publish the same numbers in the OpenAPI
document. max_tokens None is what the context leaves, resolved by the engine."""

from __future__ import annotations

import math

import pytest
from plinth.engine.sampling_params import BOUNDS, SamplingParams, check_option
from plinth.errors import RequestError
from toy_engine import reference, run_all, toy_engine


def _inside_and_outside(name: str) -> tuple[list[object], list[object]]:
    """Values at each edge of ``name``'s bound (accepted) and just past it (refused)."""
    b = BOUNDS[name]
    integer = isinstance(b.lo, int) and isinstance(b.hi, (int, type(None))) and name not in ("temperature", "top_p", "min_p")
    step = 1 if integer else 1e-6
    ok: list[object] = []
    bad: list[object] = []
    if b.lo is not None:
        (bad if b.lo_open else ok).append(b.lo)
        bad.append(b.lo - step)
        if b.lo_open:
            ok.append(b.lo + step)
    if b.hi is not None:
        (bad if b.hi_open else ok).append(b.hi)
        bad.append(b.hi + step if b.hi < 1e30 else math.inf)
    bad += list(b.excluded) + [math.nan]
    if integer:
        bad += [1.0 * ((b.lo or 0) + 1), True]  # a float or a bool is not an integer here
    return ok, bad


def _params(name: str, v: object) -> SamplingParams:
    if name == "stop_token_ids":
        return SamplingParams(stop_token_ids=[v])  # type: ignore[list-item]
    if name == "logit_bias":
        return SamplingParams(logit_bias={1: v})  # type: ignore[dict-item]
    return SamplingParams(**{name: v})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_every_bound_holds_at_its_edges(name):
    ok, bad = _inside_and_outside(name)
    for v in ok:
        _params(name, v)
    for v in bad:
        with pytest.raises(RequestError) as err:
            _params(name, v)
        assert err.value.param == name, (v, err.value)


def test_the_document_states_the_same_bounds():
    from plinth.server.protocol import ChatCompletionRequest, CompletionRequest, MessagesRequest
    from plinth.server.responses_api import ResponsesRequest

    def number_branch(prop: dict) -> dict:
        return next((b for b in prop.get("anyOf", [prop]) if b.get("type") in ("integer", "number")), prop)

    fields = {  # request field -> the option whose bound it has
        CompletionRequest: {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "n": "n",
                            "seed": "seed", "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty",
                            "min_tokens": "min_tokens", "max_tokens": "max_tokens", "logprobs": "logprobs"},
        ChatCompletionRequest: {"top_logprobs": "logprobs", "max_completion_tokens": "max_tokens", "frequency_penalty": "frequency_penalty"},
        MessagesRequest: {"max_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k"},
        ResponsesRequest: {"max_output_tokens": "max_tokens", "seed": "seed", "top_p": "top_p"},
    }  # fmt: skip
    checked = 0
    for model, names in fields.items():
        props = model.model_json_schema()["properties"]
        for field, option in names.items():
            stated = number_branch(props[field])
            for key, value in BOUNDS[option].json_schema().items():
                assert stated.get(key) == value, (model.__name__, field, key, stated)
                checked += 1
    items = CompletionRequest.model_json_schema()["properties"]["stop_token_ids"]["anyOf"][0]["items"]
    assert items["minimum"] == BOUNDS["stop_token_ids"].lo
    bias = CompletionRequest.model_json_schema()["properties"]["logit_bias"]["anyOf"][0]["additionalProperties"]
    assert (bias["minimum"], bias["maximum"]) == (BOUNDS["logit_bias"].lo, BOUNDS["logit_bias"].hi)
    assert checked > 30


def test_check_option_names_the_option():
    check_option("max_tokens", None)  # optional: left to the context
    with pytest.raises(RequestError) as err:
        check_option("max_tokens", 0)
    assert err.value.param == "max_tokens" and ">= 1" in str(err.value)


def test_max_tokens_none_is_what_the_context_leaves():
    engine = toy_engine(max_model_len=40, num_pages=64)
    prompt = [5, 6, 7]
    engine.add_request("a", prompt, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    out = run_all(engine)["a"].outputs[0]
    assert len(out.token_ids) == 40 - len(prompt)
    assert out.token_ids == reference(prompt, 40 - len(prompt), eos=False)


def test_the_engine_refuses_what_only_it_can_judge():
    engine = toy_engine(max_model_len=40)
    for params, param in ((SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"), (SamplingParams(min_tokens=41), "min_tokens"),
                          (SamplingParams(max_tokens=38), "max_tokens")):  # fmt: skip
        with pytest.raises(RequestError) as err:
            engine.add_request("x", [1, 2, 3], params)
        assert err.value.param == param
