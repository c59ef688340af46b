"""schemathesis hooks for tests/test_server_openapi_fuzz.py (loaded by the
`st` CLI through SCHEMATHESIS_HOOKS).

They touch only requests generated as valid (positive), and keep them valid:
what they change is what the document cannot state or what would make a run
slow, never what it tests.

* tokens capped: max_tokens (and its other names) at most 8, n at most 2,
  min_tokens at most 4; a chat or Responses request without a limit gets 8
  (the default, the context's remainder, is up to max_model_len tokens);
* tool names unique, and a named tool_choice names one of the tools: JSON
  Schema cannot say that one field names an item of another (the server
  answers those with 400, tested in tests/test_server_tools.py).
"""

from __future__ import annotations

from typing import Any

import schemathesis

CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8, "n": 2, "min_tokens": 4}
#: the limit a route takes when none is given, and the field to give it in
DEFAULT_LIMIT = {"/v1/chat/completions": "max_completion_tokens", "/v1/responses": "max_output_tokens"}


def _names(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The dicts holding each tool's name (OpenAI's under "function"), and the one holding tool_choice's."""
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    holders = [t.get("function") if isinstance(t.get("function"), dict) else t for t in tools if isinstance(t, dict)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        choice = choice["function"]
    named = choice if isinstance(choice, dict) and isinstance(choice.get("name"), str) else None
    return [h for h in holders if isinstance(h.get("name"), str)], named


@schemathesis.hook
def before_call(ctx: Any, case: Any, **kwargs: Any) -> None:
    mode = case.meta.generation.mode if case.meta is not None else None
    if not isinstance(case.body, dict) or str(getattr(mode, "value", mode)) != "positive":
        return
    body = case.body
    for key, cap in CAPS.items():
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    limit = DEFAULT_LIMIT.get(case.path)
    if limit and body.get(limit) is None and body.get("max_tokens") is None:
        body[limit] = 8
    tools, named = _names(body)
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        while tool["name"] in seen:
            tool["name"] = f"{tool['name']}_{i}"
        seen.add(tool["name"])
    if named is not None and tools and named["name"] not in seen:
        named["name"] = tools[0]["name"]
