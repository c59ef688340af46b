"""Structured output, without a server: request forms -> (kind, spec), the
grammar cache, and the GrammarState the engine drives (mask, accept, fork,
padding ids beyond the tokenizer's vocabulary)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")

from plinth.errors import RequestError  # noqa: E402
from plinth.server.structured import GrammarCompiler, normalize  # noqa: E402
from server_fixtures import EOS, FAKE_LOGITS, FAKE_VOCAB, ByteTokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(ByteTokenizer(), FAKE_LOGITS, [EOS])


def test_normalize_forms():
    assert normalize(None) is None
    assert normalize({"type": "text"}) is None
    assert normalize({"type": "json_object"}) == ("json_object", None)
    assert normalize({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}) == ("json_schema", SCHEMA)
    assert normalize(guided_json=json.dumps(SCHEMA)) == ("json_schema", SCHEMA)
    assert normalize(guided_regex="[a-z]+") == ("regex", "[a-z]+")
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
        "triggers": ["<f"],
    }
    kind, spec = normalize(legacy)
    assert kind == "structural_tag"
    assert spec["format"]["type"] == "triggered_tags"
    assert spec["format"]["tags"][0] == {
        "type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</f>",
    }  # fmt: skip
    new = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    assert normalize(new) == ("structural_tag", new)


@pytest.mark.parametrize(
    "fmt, param",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}}, "response_format.json_schema.schema"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "structural_tag"}, "response_format"),
        ({"type": "structural_tag", "structures": [], "triggers": ["<f"]}, "response_format.structures"),
        ({"type": "structural_tag", "structures": [{"begin": "<f>"}], "triggers": ["<f"]}, "response_format.structures.0"),
        ({"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}]}, "response_format.triggers"),
        ({"type": "yaml"}, "response_format.type"),
    ],
)
def test_normalize_rejects(fmt, param):
    with pytest.raises(RequestError) as err:
        normalize(fmt)
    assert err.value.param == param


@pytest.mark.parametrize(
    "kind, spec",
    [
        ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
        ("structural_tag", {"type": "structural_tag", "format": {"type": "bogus"}}),
        (
            "structural_tag",
            {
                "type": "structural_tag",
                "format": {"type": "triggered_tags", "triggers": ["<x"], "tags": [{"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": {}}, "end": "</f>"}]},
            },
        ),
        ("regex", "(unclosed"),
    ],
)
def test_compile_errors_are_request_errors(compiler, kind, spec):
    with pytest.raises(RequestError) as err:
        compiler.compile(kind, spec)
    assert "invalid" in str(err.value)
    assert "/project/cpp" not in str(err.value)  # xgrammar's source locations are cleaned off


def test_cache_by_spec(compiler):
    misses = compiler.misses
    a = compiler.compile("json_schema", SCHEMA)
    b = compiler.compile("json_schema", json.loads(json.dumps(SCHEMA)))
    assert a is b
    assert compiler.misses == misses + 1
    reordered = dict(reversed(list(SCHEMA.items())))  # same keys, another order: cached separately
    compiler.compile("json_schema", reordered)
    assert compiler.hits >= 1


def _drive(state, tok, text: str) -> None:
    for tid in tok.encode(text, add_special_tokens=False):
        row = torch.zeros(FAKE_LOGITS)
        state.mask_logits(row)
        assert row[tid] == 0, f"the grammar forbids {chr(tid)!r}"
        assert state.accept(tid)


def test_state_masks_accepts_forks_and_pads(compiler):
    tok = ByteTokenizer()
    state = compiler.state("json_schema", SCHEMA)
    row = torch.zeros(FAKE_LOGITS)
    state.mask_logits(row)
    allowed = (row == 0).nonzero().flatten().tolist()
    assert allowed == [ord("{")]
    assert torch.isinf(row[FAKE_VOCAB:]).all()  # padding ids beyond the tokenizer: never
    _drive(state, tok, '{"name": "ab"')
    fork = state.fork()
    _drive(state, tok, ', "n": 12}')
    # the fork stayed where it was
    row = torch.zeros(FAKE_LOGITS)
    fork.mask_logits(row)
    assert row[ord(",")] == 0 and torch.isinf(row[ord("}")])
    # complete: only EOS is left, and accepting it terminates
    row = torch.zeros(FAKE_LOGITS)
    state.mask_logits(row)
    assert (row == 0).nonzero().flatten().tolist() == [EOS]
    assert not state.is_terminated()
    assert state.accept(EOS)
    assert state.is_terminated()
    assert not fork.is_terminated()
    assert not fork.accept(ord("}"))  # rejected: "n" is required


def test_strings_are_strict_json(compiler):
    """No raw control characters in strings, bounded (maxLength) or not:
    xgrammar's own grammar admits them in bounded strings."""
    tok = ByteTokenizer()
    for schema in (SCHEMA, {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}):
        state = compiler.state("json_schema", schema)
        _drive(state, tok, '{"name": "')
        row = torch.zeros(FAKE_LOGITS)
        state.mask_logits(row)
        allowed = set((row == 0).nonzero().flatten().tolist())
        assert not allowed & set(range(32)), sorted(allowed & set(range(32)))
        assert ord("a") in allowed and 0xC3 in allowed  # ASCII, and the first byte of "é"


def test_mask_on_a_row_view_of_a_batch(compiler):
    """The sampler hands the grammar a row view of [rows, vocab] logits."""
    state = compiler.state("regex", "ab+")
    logits = torch.randn(3, FAKE_LOGITS)
    before = logits.clone()
    state.mask_logits(logits[1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert (~torch.isinf(logits[1])).nonzero().flatten().tolist() == [ord("a")]


def test_logits_narrower_than_the_vocabulary():
    c = GrammarCompiler(ByteTokenizer(), FAKE_VOCAB, [EOS])
    state = c.state("json_object", None)
    row = torch.zeros(FAKE_VOCAB)
    state.mask_logits(row)
    assert row[ord("{")] == 0


@pytest.mark.slow
def test_padded_vocabulary_end_to_end(tiny_root, caplog):
    """A real model whose logits (300) are wider than its tokenizer (264):
    structured output through the server never picks a padding id."""
    import jsonschema
    import openai
    from server_fixtures import serve, smollm2_missing
    from tiny_models import VOCAB, tiny_model_dir

    if smollm2_missing():
        pytest.skip(smollm2_missing())
    from plinth.engine.async_engine import AsyncLLM
    from plinth.engine.config import EngineConfig

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    path = tiny_model_dir("llama", tiny_root)
    engine = AsyncLLM.from_config(EngineConfig.from_kwargs(model=path, dtype="float32", num_pages=256, load_progress=False))
    try:
        assert engine.model_config.vocab_size == VOCAB > engine.tokenizer.vocab_size
        with serve(engine, names=["tiny"]) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
            r = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "json"}],
                n=8,
                temperature=1.0,
                seed=0,
                max_tokens=40,
                response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
            )
            for c in r.choices:
                assert c.finish_reason == "stop", c.message.content
                jsonschema.validate(json.loads(c.message.content), schema)
        assert "grammar rejected" not in caplog.text
    finally:
        engine.close()
