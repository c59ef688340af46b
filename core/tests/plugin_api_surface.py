"""What a plugin can see of the core, as flat text: every public name of
``plinth.api`` (and each public member of its classes) and every hook's
arguments. ``test_plugin_api_version.py`` compares it with the surfaces
recorded per plugin API version in ``plugin_api_surface.json``.

After a change to the contract (and a bump of ``PLUGIN_API_VERSION`` with
its entry in docs/plugins.md's changelog), record the new surface:

    .venv/bin/python core/tests/plugin_api_surface.py record

It refuses to overwrite the surface of a version already recorded.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RECORD = Path(__file__).with_name("plugin_api_surface.json")
PLUGINS_MD = ROOT / "docs" / "plugins.md"
CHANGELOG_HEADING = "### Changelog of the plugin API"
#: members every class has that say nothing about the contract
_SKIP_MEMBERS = {"__init__", "__call__"}


def _value(v: Any) -> str:
    """A stable text for a constant or default (no addresses)."""
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return repr(v)
    if isinstance(v, re.Pattern):
        return f"re.compile({v.pattern!r})"
    if isinstance(v, enum.Enum):
        return f"{type(v).__name__}.{v.name}"
    if isinstance(v, type):
        return v.__qualname__
    if isinstance(v, (tuple, list)):
        items = ", ".join(_value(x) for x in v)
        return f"({items})" if isinstance(v, tuple) else f"[{items}]"
    if isinstance(v, (set, frozenset)):
        return "{" + ", ".join(sorted(_value(x) for x in v)) + "}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_value(k)}: {_value(x)}" for k, x in v.items()) + "}"
    if callable(v):
        return f"<{type(v).__name__} {getattr(v, '__qualname__', '?')}>"
    return f"<{type(v).__name__}>"


def _signature(fn: Any) -> str:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "(?)"
    params = []
    for p in sig.parameters.values():
        text = p.name
        if p.kind is p.VAR_POSITIONAL:
            text = "*" + text
        elif p.kind is p.VAR_KEYWORD:
            text = "**" + text
        if p.annotation is not p.empty:
            text += f": {p.annotation if isinstance(p.annotation, str) else _value(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {_value(p.default)}"
        params.append((p.kind, text))
    out, star = [], False
    for kind, text in params:
        if kind is inspect.Parameter.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        if kind is inspect.Parameter.VAR_POSITIONAL:
            star = True
        out.append(text)
        if kind is inspect.Parameter.POSITIONAL_ONLY and (len(out) == len(params) or params[len(out)][0] is not kind):
            out.append("/")
    ret = ""
    if sig.return_annotation is not sig.empty:
        r = sig.return_annotation
        ret = f" -> {r if isinstance(r, str) else _value(r)}"
    return f"({', '.join(out)}){ret}"


def _class_members(cls: type) -> dict[str, str]:
    out: dict[str, str] = {}
    abstract = set(getattr(cls, "__abstractmethods__", ()))
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    annotations: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        annotations.update(getattr(klass, "__annotations__", {}))
    for name, f in fields.items():
        default = (
            _value(f.default) if f.default is not dataclasses.MISSING
            else "<factory>" if f.default_factory is not dataclasses.MISSING else None
        )  # fmt: skip
        kw = ", keyword-only" if getattr(f, "kw_only", False) is True else ""
        out[name] = f"field: {f.type}" + (f" = {default}" if default is not None else "") + kw
    names = {n for n in dir(cls) if not n.startswith("_")}
    names |= {n for n in _SKIP_MEMBERS if n in vars(cls) or any(n in vars(k) for k in cls.__mro__[1:-1] if _ours(k))}
    if fields:
        names.discard("__init__")  # the fields say it
    for name in sorted(names - set(fields)):
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None or not _ours(owner):  # what Exception or Protocol bring varies with Python's version
            continue
        raw = vars(owner)[name]
        prefix = "abstract " if name in abstract else ""
        if isinstance(raw, classmethod):
            out[name] = f"{prefix}classmethod{_signature(getattr(cls, name))}"
        elif isinstance(raw, staticmethod):
            out[name] = f"{prefix}staticmethod{_signature(raw.__func__)}"
        elif isinstance(raw, property):
            out[name] = f"{prefix}property{_signature(raw.fget).split(')', 1)[-1] if raw.fget else ''}"
        elif inspect.isfunction(raw):
            if not _ours(raw):  # a Protocol's __init__ is typing's
                continue
            out[name] = f"{prefix}method{_signature(raw)}"
        elif isinstance(raw, type):
            out[name] = f"class {raw.__qualname__}"
        else:
            ann = annotations.get(name)
            out[name] = f"attribute{': ' + str(ann) if ann is not None else ''} = {_value(raw)}"
    return out


def _ours(obj: Any) -> bool:
    return str(getattr(obj, "__module__", "")).split(".")[0] == "plinth"


def surface() -> dict[str, str]:
    """qualified name -> what a plugin sees of it."""
    import plinth.api as api
    from plinth.hookspecs import PlinthHookSpec

    out: dict[str, str] = {}
    for name in sorted(api.__all__):
        if name == "PLUGIN_API_VERSION":  # the version itself
            continue
        obj = getattr(api, name)
        key = f"plinth.api.{name}"
        if isinstance(obj, type):
            bases = ", ".join(b.__qualname__ for b in obj.__bases__ if b is not object)
            out[key] = f"class({bases})" + (" dataclass" if dataclasses.is_dataclass(obj) else "")
            for member, text in _class_members(obj).items():
                out[f"{key}.{member}"] = text
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            out[key] = f"function{_signature(obj)}"
        elif callable(obj) and not isinstance(obj, (tuple, list, dict)):  # hookimpl: pluggy's marker, whose signature is pluggy's
            out[key] = f"callable {type(obj).__module__.split('.')[0]}.{type(obj).__name__}"
        else:
            out[key] = f"constant {_value(obj)}"
    for name, fn in sorted(vars(PlinthHookSpec).items()):
        if not name.startswith("plinth_"):
            continue
        sig = inspect.signature(fn)
        out[f"hook {name}"] = f"returns {sig.return_annotation}"
        for p in list(sig.parameters.values())[1:]:  # pluggy passes them by keyword: each is its own promise
            out[f"hook {name}({p.name})"] = f"argument {p.annotation}"
    return out


def recorded() -> dict[str, dict[str, str]]:
    """version -> the surface recorded for it (oldest first)."""
    data = json.loads(RECORD.read_text())
    return data["versions"]


def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def changelog() -> dict[str, str]:
    """version -> its entry in docs/plugins.md's changelog, in the page's order."""
    text = PLUGINS_MD.read_text()
    start = text.find(CHANGELOG_HEADING)
    if start < 0:
        return {}
    body = text[start + len(CHANGELOG_HEADING) :]
    end = re.search(r"^#{1,3} ", body, re.MULTILINE)
    body = body[: end.start()] if end else body
    entries: dict[str, str] = {}
    for m in re.finditer(r"^\* \*\*(\d+\.\d+)\*\*:?(.*?)(?=^\* \*\*|\Z)", body, re.MULTILINE | re.DOTALL):
        entries[m.group(1)] = " ".join(m.group(2).split())
    return entries


def diff(old: dict[str, str], new: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(added, removed, changed) keys from old to new."""
    added = sorted(set(new) - set(old))
    removed = sorted(set(old) - set(new))
    changed = sorted(k for k in set(old) & set(new) if old[k] != new[k])
    return added, removed, changed


def breaking(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """What breaks a plugin written against ``old``: a name or hook argument
    gone, a method turned abstract, a new abstract method to implement."""
    added, removed, changed = diff(old, new)
    out = [f"removed {k}" for k in removed]
    out += [f"now abstract: {k}" for k in changed if new[k].startswith("abstract ") and not old[k].startswith("abstract ")]
    out += [f"new abstract method {k}" for k in added if new[k].startswith("abstract ")]
    return out


def top_name(key: str) -> str:
    """The name a changelog entry must mention for a changed key."""
    if key.startswith("hook "):
        return key[len("hook ") :].split("(")[0]
    return key.removeprefix("plinth.api.").split(".")[0]


def named(key: str, text: str) -> bool:
    """Whether a changelog entry names a changed key: its top-level name as a
    word, or, for a member, the member in backticks (`validate` or
    `PluginImpl.validate` for every class that inherits it)."""
    if re.search(rf"\b{re.escape(top_name(key))}\b", text):
        return True
    member = key.removeprefix("plinth.api.").split(".", 1)[1] if key.count(".") > 2 else None
    if key.startswith("hook ") and "(" in key:
        member = key.split("(")[1].rstrip(")")
    return member is not None and re.search(rf"`(?:[\w.]+\.)?{re.escape(member)}(?:\(\))?`", text) is not None


def describe(old: dict[str, str], new: dict[str, str]) -> str:
    added, removed, changed = diff(old, new)
    lines = [f"  added    {k}: {new[k]}" for k in added]
    lines += [f"  removed  {k}: {old[k]}" for k in removed]
    lines += [f"  changed  {k}: {old[k]}  ->  {new[k]}" for k in changed]
    return "\n".join(lines)


def problems(now: dict[str, str], version: str, versions: dict[str, dict[str, str]], entries: dict[str, str]) -> list[str]:
    """Why the contract as it is (``now`` at plugin API ``version``) is not
    what the record (``versions``) and the changelog (``entries``) say."""
    out: list[str] = []
    how = (
        "bump PLUGIN_API_VERSION (plinth/contract/base.py: the minor for additions, the major for what breaks a "
        "plugin), add its entry at the top of docs/plugins.md's changelog naming what changed, then run "
        "`python core/tests/plugin_api_surface.py record`"
    )
    if version not in versions:
        latest = max(versions, key=version_key) if versions else None
        out.append(
            f"plugin API {version} is not recorded"
            + (f"; since {latest}:\n{describe(versions[latest], now)}\n" if latest else "; ")
            + "run `python core/tests/plugin_api_surface.py record`"
        )
    elif versions[version] != now:
        out.append(f"the plugin API changed without a new version (still {version}):\n{describe(versions[version], now)}\n{how}")
    order = sorted(versions, key=version_key)
    if order and order[-1] != version:
        out.append(f"plugin API {version} is older than the recorded {order[-1]}")
    listed = list(entries)
    if not listed or listed[0] != version:
        out.append(
            f"docs/plugins.md's changelog ({CHANGELOG_HEADING!r}) must open with an entry for {version}, "
            f"'* **{version}**: what changed'; it opens with {listed[0] if listed else 'nothing'}"
        )
    if listed != sorted(listed, key=version_key, reverse=True):
        out.append(f"docs/plugins.md's changelog is not newest first: {', '.join(listed)}")
    for v in order:
        if v not in entries:
            out.append(f"docs/plugins.md's changelog has no entry for plugin API {v}")
    for old_v, new_v in zip(order, order[1:]):
        old, new = versions[old_v], versions[new_v]
        broken = breaking(old, new)
        if broken and version_key(new_v)[0] == version_key(old_v)[0]:
            out.append(f"{old_v} -> {new_v} breaks plugins, which needs a new major version: " + "; ".join(broken))
        text = entries.get(new_v, "")
        unnamed = sorted({top_name(k) for k in sum(diff(old, new), []) if not named(k, text)})
        if text and unnamed:
            out.append(f"the changelog entry for {new_v} does not name what changed since {old_v}: {', '.join(unnamed)}")
    return out


def record() -> int:
    from plinth.api import PLUGIN_API_VERSION

    data = json.loads(RECORD.read_text()) if RECORD.exists() else {"versions": {}}
    versions: dict[str, dict[str, str]] = data["versions"]
    now = surface()
    if PLUGIN_API_VERSION in versions:
        if versions[PLUGIN_API_VERSION] == now:
            print(f"plugin API {PLUGIN_API_VERSION}: the recorded surface is current")
            return 0
        print(
            f"plugin API {PLUGIN_API_VERSION} is already recorded with another surface; bump PLUGIN_API_VERSION "
            f"(plinth/contract/base.py) and add its entry to docs/plugins.md's changelog first. What changed:\n"
            + describe(versions[PLUGIN_API_VERSION], now),
            file=sys.stderr,
        )
        return 1
    if versions and version_key(PLUGIN_API_VERSION) < max(version_key(v) for v in versions):
        print(f"plugin API {PLUGIN_API_VERSION} is older than one already recorded", file=sys.stderr)
        return 1
    previous = versions[max(versions, key=version_key)] if versions else None
    versions[PLUGIN_API_VERSION] = now
    data["versions"] = dict(sorted(versions.items(), key=lambda kv: version_key(kv[0])))
    RECORD.write_text(json.dumps(data, indent=1) + "\n")
    print(f"recorded plugin API {PLUGIN_API_VERSION}")
    if previous is not None:
        print("its changelog entry must name: " + ", ".join(sorted({top_name(k) for k in sum(diff(previous, now), [])})))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["record"]:
        print(__doc__)
        sys.exit(2)
    sys.exit(record())
