"""Tool-call and reasoning parser conformance: the contract's promises
(``plinth.api.ToolParser`` / ``ReasoningParser``), checked on the outputs a
plugin author names (its family's format, whole) and on their every prefix,
plus text that is no call at all."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from plinth.testing._report import Report
from plinth.testing.registration import discover_all

#: text every parser must survive (never raise; final: no call comes out)
NOISE = ("", "plain answer text.", "{", "}", "[", "<", "</", "{\"name\": ", "<|", "```json\n{", "\x00\ufffd", "  \n\t")


def check_tool_parser(name: str, samples: Sequence[str] | None = None, *, tools: Sequence[Any] = ()) -> Report:
    """The tool parser registered as ``name``. ``samples``: outputs in its
    format, each with at least one well-formed call (default: the class's
    ``examples``). Checks, for each sample
    fed whole and one character at a time: ``parse`` never raises; final calls
    are complete, named, with JSON-object arguments; streaming views only
    grow (content, each call's arguments; a call's name never changes; calls
    are never dropped) and end where the final parse does. Also: noise and
    random cuts of the samples never raise."""
    report = Report(f"tool_parser {name}")
    cls = discover_all().get("tool_parser", name).load()
    samples = tuple(cls.examples) if samples is None else samples
    report.expect(bool(samples), "samples were given", "give outputs in the parser's format (or set the class's examples)")
    for i, text in enumerate(samples):
        label = f"sample {i + 1}"
        try:
            final = cls(tools).parse(text, final=True)
        except Exception as exc:
            report.problem(f"{label}: parse(final=True) raised {type(exc).__name__}: {exc}")
            continue
        report.expect(bool(final.calls), f"{label}: a call is found", f"content {final.content!r}")
        for call in final.calls:
            report.expect(call.complete and bool(call.name), f"{label}: final call {call.name!r} is complete and named")
            report.expect(_is_json_object(call.arguments), f"{label}: {call.name} arguments are a JSON object", repr(call.arguments))
        _check_tool_stream(report, cls(tools), text, final, label)
    rand = random.Random(0)
    cuts = [s[: rand.randrange(len(s) + 1)] for s in samples for _ in range(8)]
    for text in (*NOISE, *cuts):
        for final_flag in (True, False):
            try:
                out = cls(tools).parse(text, final=final_flag)
            except Exception as exc:
                report.problem(f"parse({text!r}, final={final_flag}) raised {type(exc).__name__}: {exc}")
                continue
            if final_flag:
                bad = [c.name for c in out.calls if not (c.complete and _is_json_object(c.arguments))]
                report.expect(not bad, f"final parse of {text[:40]!r} returns only complete calls", ", ".join(bad))
    if not report.problems:
        report.ok(f"{len(NOISE) + len(cuts)} noisy or cut texts parsed without raising")
    return report.raise_for_problems()


def _check_tool_stream(report: Report, parser: Any, text: str, final: Any, label: str) -> None:
    content, calls = "", []
    for n in range(len(text) + 1):
        try:
            view = parser.parse(text[:n], final=False)
        except Exception as exc:
            report.problem(f"{label}: parse(final=False) raised {type(exc).__name__} at {n} characters: {exc}")
            return
        if not view.content.startswith(content):
            report.problem(f"{label}: streamed content shrank at {n} characters: {content!r} -> {view.content!r}")
            return
        content = view.content
        if len(view.calls) < len(calls):
            report.problem(f"{label}: a streamed call vanished at {n} characters")
            return
        for i, call in enumerate(view.calls):
            if i < len(calls):
                if call.name != calls[i][0] or not call.arguments.startswith(calls[i][1]):
                    report.problem(f"{label}: streamed call {i} changed at {n} characters: {calls[i]} -> {[call.name, call.arguments]}")
                    return
                calls[i][1] = call.arguments
            else:
                calls.append([call.name, call.arguments])
    got = [(c[0], c[1]) for c in calls]
    want = [(c.name, c.arguments) for c in final.calls]
    report.expect(got == want, f"{label}: the streamed calls are the final ones", f"{got} != {want}")
    report.expect(content.strip() == final.content.strip(), f"{label}: the streamed content is the final one", f"{content!r} != {final.content!r}")


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def check_reasoning_parser(name: str, samples: Sequence[tuple[str, str]] | None = None) -> Report:
    """The reasoning parser registered as ``name``. ``samples``: (prompt,
    output) pairs in its format, each with reasoning (default: the class's
    ``examples``). Checks: ``parse``
    never raises; the final parse finds reasoning; streamed views only grow
    in both parts and end where the final parse does (up to layout
    whitespace); noise never raises."""
    report = Report(f"reasoning_parser {name}")
    cls = discover_all().get("reasoning_parser", name).load()
    samples = tuple(cls.examples) if samples is None else samples
    report.expect(bool(samples), "samples were given", "give (prompt, output) pairs in the parser's format (or set the class's examples)")
    for i, (prompt, text) in enumerate(samples):
        label = f"sample {i + 1}"
        parser = cls(prompt)
        try:
            final = parser.parse(text, final=True)
        except Exception as exc:
            report.problem(f"{label}: parse(final=True) raised {type(exc).__name__}: {exc}")
            continue
        report.expect(bool(final.reasoning.strip()), f"{label}: reasoning is found", repr(final))
        reasoning = content = ""
        for n in range(len(text) + 1):
            try:
                view = parser.parse(text[:n], final=False)
            except Exception as exc:
                report.problem(f"{label}: parse(final=False) raised {type(exc).__name__} at {n} characters: {exc}")
                break
            if not (view.reasoning.startswith(reasoning) and view.content.startswith(content)):
                report.problem(f"{label}: a streamed part shrank at {n} characters: {(reasoning, content)} -> {(view.reasoning, view.content)}")
                break
            reasoning, content = view.reasoning, view.content
        else:
            report.expect(
                (reasoning.strip(), content.strip()) == (final.reasoning.strip(), final.content.strip()),
                f"{label}: the streamed parts are the final ones", f"{(reasoning, content)} != {(final.reasoning, final.content)}",
            )
    for text in NOISE:
        for final_flag in (True, False):
            try:
                cls("").parse(text, final=final_flag)
            except Exception as exc:
                report.problem(f"parse({text!r}, final={final_flag}) raised {type(exc).__name__}: {exc}")
    return report.raise_for_problems()
