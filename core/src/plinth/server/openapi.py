"""The OpenAPI document, as the server really answers.

FastAPI's generated document is corrected after the fact, because some of the
truth is only known at run time or lives outside the route signatures:

- errors: every route lists the 4xx/5xx statuses it can answer, each with its
  body (OpenAI's ``{"error": {...}}``, Anthropic's ``{"type": "error", ...}``
  under /v1/messages); FastAPI's 422 is never sent (it is answered as 400) and
  is dropped, with its schemas;
- this server's values: ``model`` takes the served names, token limits stop at
  the context length;
- /metrics is Prometheus text; GET and HEAD of one route get distinct
  operation ids.
"""

from __future__ import annotations

import warnings

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import JsonSchemaValue

from plinth.server.errors import ERROR_TYPES, is_anthropic_path

OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "enum": sorted(set(ERROR_TYPES.values()))},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        }
    },
}
ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string", "enum": sorted(set(ERROR_TYPES.values()))}, "message": {"type": "string"}},
        },
    },
}

WHY = {
    400: "Invalid request: malformed JSON, a field of the wrong type or out of range, a prompt or max_tokens beyond the context, an invalid schema",
    401: "Missing or wrong API key (when the server has one)",
    404: "A model this server does not serve",
    413: "The request body is larger than --max-request-body-size",
    500: "The engine failed while running the request",
    503: "Too many requests are waiting (Retry-After says when to retry)",
}

#: request fields that hold a model name, and those bounded by the context length
MODEL_FIELDS = ("model",)
TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")
#: request fields that hold token ids (bounded by the vocabulary)
TOKEN_ID_FIELDS = ("prompt", "tokens")


def _statuses(path: str, method: str) -> list[int]:
    """The error statuses one operation can answer with."""
    if path in ("/health", "/ready", "/version", "/metrics"):
        return []
    out = [401]  # every /v1/*, /tokenize and /detokenize route takes the key
    if method == "post":
        out += [400, 413]
    if path.startswith("/v1/models/") or method == "post":
        out.append(404)
    if path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
        out += [500, 503]
    return sorted(out)


def int_range_pattern(hi: int) -> str:
    """A regular expression for the decimal integers 0..hi (no leading zeros):
    logit_bias's keys, token ids as strings, bounded by the vocabulary."""
    s = str(hi)
    alts = ["0"] + [f"[1-9][0-9]{{{k - 1}}}" if k > 1 else "[1-9]" for k in range(1, len(s))]
    for i, c in enumerate(s):  # same length: hi's first i digits, then a smaller digit, then any
        lo, rest = (1 if i == 0 else 0), len(s) - i - 1
        if int(c) > lo:
            alts.append(s[:i] + f"[{lo}-{int(c) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    alts.append(s)
    return "^(" + "|".join(dict.fromkeys(alts)) + ")$"


def _bound_ids(node: object, vocab_size: int) -> None:
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = vocab_size - 1
        for v in node.values():
            _bound_ids(v, vocab_size)
    elif isinstance(node, list):
        for v in node:
            _bound_ids(v, vocab_size)


def _bound_fields(schema: JsonSchemaValue, names: list[str], max_model_len: int, vocab_size: int) -> None:
    props = schema.get("properties") or {}
    for field in TOKEN_ID_FIELDS:
        if field in props and schema.get("title", "").endswith("Request"):
            _bound_ids(props[field], vocab_size)
    bias = props.get("logit_bias")
    for branch in (bias or {}).get("anyOf", []):
        if "propertyNames" in branch:
            branch["propertyNames"] = {"pattern": int_range_pattern(vocab_size - 1)}
    for field in MODEL_FIELDS:
        if field in props:
            named = {"type": "string", "enum": list(names)}
            prop = props[field]
            if "anyOf" in prop:
                prop["anyOf"] = [named if b.get("type") == "string" else b for b in prop["anyOf"]]
            else:
                prop.pop("type", None)
                prop.update(named)
    for field in TOKEN_LIMIT_FIELDS:
        prop = props.get(field)
        if prop is None:
            continue
        for branch in prop.get("anyOf", [prop]):
            if branch.get("type") == "integer":
                branch["maximum"] = max_model_len


def install(app: FastAPI, served_model_names: list[str], max_model_len: int, vocab_size: int) -> None:
    """Make ``app.openapi()`` return the corrected document."""

    def openapi() -> JsonSchemaValue:
        if app.openapi_schema is not None:
            return app.openapi_schema
        with warnings.catch_warnings():  # GET and HEAD of one route share an id, made distinct below
            warnings.filterwarnings("ignore", "Duplicate Operation ID", UserWarning)
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas["OpenAIError"] = OPENAI_ERROR
        schemas["AnthropicError"] = ANTHROPIC_ERROR
        for schema in schemas.values():
            _bound_fields(schema, served_model_names, max_model_len, vocab_size)
        seen: set[str] = set()
        for path, ops in doc.get("paths", {}).items():
            body = {"$ref": "#/components/schemas/" + ("AnthropicError" if is_anthropic_path(path) else "OpenAIError")}
            for method, op in ops.items():
                if op.get("operationId") in seen:  # GET and HEAD of one function
                    op["operationId"] = f"{op['operationId']}_{method}"
                seen.add(op.get("operationId", ""))
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for param in op.get("parameters", []):
                    if param.get("name") == "model_id":
                        param["schema"] = {"type": "string", "enum": list(served_model_names)}
                for status in _statuses(path, method):
                    answer: JsonSchemaValue = {"description": WHY[status], "content": {"application/json": {"schema": body}}}
                    if status == 503:
                        answer["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
                    responses[str(status)] = answer
                if path in ("/health", "/ready"):
                    responses["503"] = {
                        "description": "The engine thread is not running (or, for /ready, the server is shutting down)",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/HealthResponse"}}},
                    }
                if path == "/metrics":
                    responses["200"] = {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}}
                    responses["404"] = {"description": "Metrics are disabled", "content": {"application/json": {"schema": body}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
