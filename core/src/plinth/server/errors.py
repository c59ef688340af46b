"""Errors as HTTP answers: one exception type, two body styles.

Every failure the server answers on purpose is an :class:`APIError`. Routes
under ``/v1/messages`` answer in Anthropic's shape, every other route in
OpenAI's::

    OpenAI:    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
    Anthropic: {"type": "error", "error": {"type": ..., "message": ...}}

Status codes follow vLLM: request validation failures (FastAPI's 422) are
answered as 400, an unknown model as 404, a missing or wrong key as 401, a
body over the size limit as 413 and a full queue as 503 with Retry-After.
The ``type`` names are Anthropic's (which OpenAI's clients accept as well),
so both APIs use the same vocabulary.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic_core import ErrorDetails

from plinth.errors import RequestError

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse

log = logging.getLogger("plinth.server")

#: status -> the error type both APIs report
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",  # a front (proxy, router) whose instances could not take the request
    503: "overloaded_error",
}


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI- or Anthropic-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    @classmethod
    def bad_request(cls, message: str, *, param: str | None = None, code: str | None = None) -> APIError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def from_request_error(cls, exc: RequestError) -> APIError:
        return cls(400, str(exc), param=exc.param, code=exc.code or "invalid_value")

    def openai_body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, object]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, err: APIError) -> dict[str, object]:
    return err.anthropic_body() if is_anthropic_path(path) else err.openai_body()


def error_bytes(path: str, err: APIError) -> bytes:
    return json.dumps(error_body(path, err)).encode()


def error_response(path: str, err: APIError) -> JSONResponse:
    """``err`` as a response (a FastAPI ``JSONResponse``): the body for the
    route, its status and headers; the server's and the fronts' one way to
    answer an error."""
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(path, err), status_code=err.status, headers=err.headers or None)


def engine_exception(exc: BaseException) -> APIError:
    """Map what ``AsyncLLM.generate`` raises to an answer."""
    from plinth.engine.interfaces import EngineDraining, EngineError, EngineOverloaded

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError.from_request_error(exc)
    if isinstance(exc, EngineOverloaded):
        return APIError(503, str(exc), code="overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDraining):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), code="engine_error")
    log.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def validation_message(errors: Sequence[ErrorDetails]) -> tuple[str, str | None, str]:
    """A readable message, the offending parameter and a code from pydantic's
    validation errors (FastAPI's RequestValidationError)."""
    if not errors:
        return "invalid request", None, "invalid_request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error") or first.get("msg", "")
        return f"the request body is not valid JSON: {detail}", None, "invalid_json"
    parts = []
    param = None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # drop pydantic's union-branch tags (e.g. "str", "list[int]", "function-after[...]")
        loc = [x for x in loc if not (("[" in x and x.endswith("]")) or x in {"str", "int", "float", "bool", "list", "dict"})]
        where = ".".join(loc)
        # the first field at fault; of a union's branches, the one that got furthest into it
        if where and (param is None or (where.startswith(param + ".") and len(where) > len(param))):
            param = where
        parts.append(f"{where}: {e.get('msg', 'invalid')}" if where else str(e.get("msg", "invalid")))
    if len(errors) > 5:
        parts.append(f"... and {len(errors) - 5} more")
    if first.get("type") == "missing" and first.get("loc") == ("body",):
        return "the request body is missing (send a JSON object)", None, "invalid_request"
    kind = str(first.get("type", ""))
    if kind == "missing":
        code = "missing_required_parameter"
    elif "_type" in kind or "parsing" in kind or kind.endswith("type"):
        code = "invalid_type"
    else:
        code = "invalid_value"
    return "; ".join(parts), param, code
