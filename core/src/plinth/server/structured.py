"""Structured output: request formats -> compiled xgrammar grammars -> one
:class:`plinth.engine.grammar.GrammarState` per request.

What a request may ask for (all normalized to a ``(kind, spec)`` pair):

- ``response_format: {"type": "json_object"}``: a JSON object (not any value);
- ``response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
  (and vLLM's ``guided_json``): JSON that validates against the schema;
- vLLM's ``guided_regex``: text matching a regular expression;
- ``response_format: {"type": "structural_tag", ...}`` in both forms vLLM and
  LMDeploy accept: the legacy ``{"structures": [{"begin", "schema", "end"}],
  "triggers": [...]}`` and xgrammar's ``{"format": {...}}`` (for example
  ``{"type": "triggered_tags", "triggers": [...], "tags": [...]}``): free text
  in which each tag's content, once a trigger appears, follows its schema.

Each grammar is compiled once and cached by ``(kind, compact JSON of the
spec)``; every request then gets a fresh matcher over the shared compiled
grammar. An invalid schema, regex or tag is a :class:`RequestError` (400).

The model's logits may be wider than the tokenizer's vocabulary (padded
embeddings): the grammar's vocabulary is sized to the logits, so the padding
ids are never allowed.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import TYPE_CHECKING

from pydantic import JsonValue

from plinth.errors import RequestError

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

    from plinth.tokenizer import Tokenizer

log = logging.getLogger("plinth.server.structured")

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _clean(msg: str) -> str:
    """xgrammar's C++ messages, without their timestamp and source location."""
    return _XGR_PREFIX.sub("", str(msg).strip()).strip()


def canonical(spec: JsonValue) -> str:
    """The cache key of a spec: compact JSON. Key order is kept, not sorted:
    a schema's property order is the order the output must follow."""
    return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)


# ---------------------------------------------------------------------------
# request fields -> (kind, spec)
# ---------------------------------------------------------------------------


def _load_json(value: JsonValue, param: str) -> JsonValue:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise RequestError(f"{param} is not valid JSON: {exc}", param=param, code="invalid_json_schema") from None
    return value


def check_json_schema(schema: JsonValue, param: str) -> None:
    """A schema must be an object (or a boolean) that is valid against its
    metaschema (when jsonschema is installed; xgrammar checks the rest)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise RequestError(f"{param} must be a JSON object, got {type(schema).__name__}", param=param, code="invalid_json_schema")
    try:
        import jsonschema
        import jsonschema.validators
    except ImportError:  # pragma: no cover - jsonschema is optional
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise RequestError(
            f"{param} is not a valid JSON schema: {exc.message}" + (f" (at {where})" if where else ""),
            param=param,
            code="invalid_json_schema",
        ) from None


def _structural_tag(fmt: dict[str, JsonValue], param: str) -> dict[str, JsonValue]:
    """Both structural-tag forms, as xgrammar's current one."""
    if "format" in fmt:
        tag = {"type": "structural_tag", "format": fmt["format"]}
    elif "structures" in fmt:
        structures = fmt.get("structures")
        triggers = fmt.get("triggers")
        if not isinstance(structures, list) or not structures:
            raise RequestError(f"{param}.structures must be a non-empty list", param=f"{param}.structures", code="invalid_structural_tag")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise RequestError(
                f"{param}.triggers must be a non-empty list of strings", param=f"{param}.triggers", code="invalid_structural_tag"
            )
        tags = []
        for i, s in enumerate(structures):
            where = f"{param}.structures.{i}"
            if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
                raise RequestError(f"{where} needs string fields begin and end, and a schema", param=where, code="invalid_structural_tag")
            schema = _load_json(s.get("schema", {}), f"{where}.schema")
            check_json_schema(schema, f"{where}.schema")
            tags.append(
                {"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": schema}, "end": s["end"]}
            )
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": list(triggers), "tags": tags}}
    else:
        raise RequestError(
            f"{param}: a structural_tag needs either `format` or `structures` and `triggers`",
            param=param,
            code="invalid_structural_tag",
        )
    if not isinstance(tag["format"], dict):
        raise RequestError(f"{param}.format must be an object", param=f"{param}.format", code="invalid_structural_tag")
    return tag


def normalize(
    response_format: dict[str, JsonValue] | None = None,
    guided_json: JsonValue = None,
    guided_regex: str | None = None,
) -> tuple[str, JsonValue] | None:
    """The structured-output request as ``(kind, spec)``, or None for free text."""
    if guided_json is not None:
        schema = _load_json(guided_json, "guided_json")
        check_json_schema(schema, "guided_json")
        return ("json_schema", schema)
    if guided_regex is not None:
        if not isinstance(guided_regex, str) or not guided_regex:
            raise RequestError("guided_regex must be a non-empty string", param="guided_regex")
        return ("regex", guided_regex)
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return ("json_object", None)
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if js is None:
            raise RequestError(
                "response_format.json_schema is required when type is json_schema",
                param="response_format.json_schema",
                code="invalid_json_schema",
            )
        if not isinstance(js, dict):
            raise RequestError("response_format.json_schema must be an object", param="response_format.json_schema")
        # OpenAI puts the schema under "schema"; some clients send it bare
        schema = js.get("schema", js.get("json_schema")) if ("schema" in js or "json_schema" in js) else None
        if schema is None:
            return ("json_object", None)
        schema = _load_json(schema, "response_format.json_schema.schema")
        check_json_schema(schema, "response_format.json_schema.schema")
        return ("json_schema", schema)
    if kind == "regex":
        pattern = response_format.get("regex", response_format.get("pattern"))
        if not isinstance(pattern, str) or not pattern:
            raise RequestError("response_format.regex must be a non-empty string", param="response_format.regex")
        return ("regex", pattern)
    if kind == "structural_tag":
        return ("structural_tag", _structural_tag(response_format, "response_format"))
    raise RequestError(
        f"response_format.type {kind!r} is not supported (text, json_object, json_schema, structural_tag)",
        param="response_format.type",
    )


# ---------------------------------------------------------------------------
# compiling
# ---------------------------------------------------------------------------


def _vocab_type(value: object) -> xgr.VocabType:
    import xgrammar as xgr

    if isinstance(value, xgr.VocabType):
        return value
    name = str(value or "raw").lower().replace("-", "_")
    return {
        "raw": xgr.VocabType.RAW,
        "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
        "bytefallback": xgr.VocabType.BYTE_FALLBACK,
        "byte_level": xgr.VocabType.BYTE_LEVEL,
        "bytelevel": xgr.VocabType.BYTE_LEVEL,
    }[name]


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of our tokenizer, sized to the model's logits."""
    import xgrammar as xgr

    raw = tokenizer.raw_vocab()
    if isinstance(raw, dict):  # token -> id
        vocab: list[bytes] | list[str] = [""] * (max(raw.values()) + 1 if raw else 0)
        for tok, i in raw.items():
            vocab[i] = tok
    else:
        vocab = list(raw)
    vocab = vocab[:vocab_size]
    kwargs = {}
    if getattr(tokenizer, "add_prefix_space", None) is not None:
        kwargs["add_prefix_space"] = bool(tokenizer.add_prefix_space)
    return xgr.TokenizerInfo(
        vocab,  # type: ignore[arg-type]  # one kind of entry, whichever the tokenizer has
        _vocab_type(getattr(tokenizer, "vocab_type", "raw")),
        vocab_size=vocab_size,
        stop_token_ids=[t for t in stop_token_ids if 0 <= t < vocab_size],
        **kwargs,
    )


#: string characters in xgrammar's JSON grammars: its length-bounded strings
#: admit raw control characters (invalid JSON), and all its strings admit
#: UTF-16 surrogates encoded as UTF-8 (invalid UTF-8)
_BOUNDED_CHAR = r'[^\"\\\r\n]'
_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_STRICT_CHAR = r'[^\0-\x1f\"\\\ud800-\udfff]'


def json_schema_grammar(schema_json: str) -> xgr.Grammar:
    """xgrammar's grammar for a JSON schema (compact separators, no runs of
    whitespace), with string characters as strict JSON has them."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema_json, any_whitespace=False))
    fixed = ebnf.replace(_BOUNDED_CHAR, _STRICT_CHAR).replace(_STRING_CHAR, _STRICT_CHAR)
    if fixed == ebnf:
        return xgr.Grammar.from_json_schema(schema_json, any_whitespace=False)
    return xgr.Grammar.from_ebnf(fixed)


class GrammarCompiler:
    """Compiles and caches grammars for one model's vocabulary.

    Built lazily: xgrammar is imported, and the vocabulary converted, on the
    first structured request. ``compile`` is thread-safe (the server runs it
    off the event loop).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int], *, max_cached: int = 512) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_cached = max_cached
        self._info: xgr.TokenizerInfo | None = None
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: dict[tuple[str, str], xgr.CompiledGrammar] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _ensure(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError:  # pragma: no cover - xgrammar is the `structured` extra
                raise RequestError(
                    "structured output needs xgrammar, which is not installed (pip install 'plinth-core[structured]')",
                    param="response_format",
                ) from None
            self._info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(self._info, max_threads=2)
        return self._compiler

    def compile(self, kind: str, spec: JsonValue) -> xgr.CompiledGrammar:
        key = (kind, canonical(spec))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self.hits += 1
                return hit
            compiler = self._ensure()
            self.misses += 1
            param = "response_format"
            try:
                if kind in ("json_object", "json_schema"):
                    # json_object: an object (xgrammar's builtin JSON grammar takes any value)
                    schema = '{"type": "object"}' if kind == "json_object" else canonical(spec)
                    grammar = compiler.compile_grammar(json_schema_grammar(schema))
                elif kind == "regex":
                    param = "guided_regex"
                    grammar = compiler.compile_regex(str(spec))
                elif kind == "structural_tag":
                    grammar = compiler.compile_structural_tag(spec if isinstance(spec, (str, dict)) else canonical(spec))
                else:
                    raise RequestError(f"unknown structured output kind {kind!r}", param=param)
            except RequestError:
                raise
            except Exception as exc:  # xgrammar raises RuntimeError / its own errors
                what = {"json_schema": "JSON schema", "regex": "regex", "structural_tag": "structural tag"}.get(kind, kind)
                raise RequestError(
                    f"invalid {what}: {_clean(str(exc))}", param=param, code=f"invalid_{kind}"
                ) from None
            if len(self._cache) >= self.max_cached:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = grammar
            return grammar

    def state(self, kind: str, spec: JsonValue) -> XGrammarState:
        return XGrammarState(self.compile(kind, spec), self.vocab_size)


class XGrammarState:
    """One sequence's position in a grammar (implements ``GrammarState``)."""

    __slots__ = ("matcher", "vocab_size", "bitmask")

    def __init__(self, compiled: xgr.CompiledGrammar | None, vocab_size: int, matcher: xgr.GrammarMatcher | None = None) -> None:
        import xgrammar as xgr

        if matcher is None:
            assert compiled is not None, "a state needs its grammar or a matcher to fork"
            matcher = xgr.GrammarMatcher(compiled)
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask_logits(self, logits: torch.Tensor) -> None:
        import xgrammar as xgr

        if self.matcher.is_terminated():
            # asked again after the grammar ended (a sequence that did not stop on it, e.g. under
            # ignore_eos or min_tokens): xgrammar raises, which would fail the whole engine step;
            # only a stop token is left to say, and the engine ends the sequence on it
            keep = logits[list(self.matcher.stop_token_ids)].clone()
            logits.fill_(float("-inf"))
            logits[list(self.matcher.stop_token_ids)] = keep
            return
        self.matcher.fill_next_token_bitmask(self.bitmask)
        width = logits.shape[-1]
        row = logits.unsqueeze(0)
        # the logits stay on the model's device; the matcher fills a host bitmask
        xgr.apply_token_bitmask_inplace(row, self.bitmask.to(row.device), vocab_size=min(width, self.vocab_size))
        if width > self.vocab_size:
            row[0, self.vocab_size :] = float("-inf")

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fork(self) -> XGrammarState:
        return XGrammarState(None, self.vocab_size, matcher=self.matcher.fork())
