"""Plugin discovery and selection.

Who does what:
  * importlib.metadata lists the entry points of the group ``plinth.plugins``
    with the distribution (name, version) that declares each: the inventory,
    read before anything is imported, so allow/block lists act before import.
  * stevedore (``NamedExtensionManager``) imports the allowed entry-point
    modules by name, from its on-disk entry-point cache, and reports each
    import failure through its load-failure callback.
  * pluggy registers those modules against ``plinth.hookspecs``, validates
    every ``@hookimpl`` signature, and calls the hooks (keyword-only, opt-in
    arguments).

Selection happens once at startup; the result is plain classes and objects,
so nothing here is on the hot path.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib
import importlib.metadata
import inspect
import logging
import os
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from plinth import hookspecs
from plinth.contract import (
    DESCRIPTOR_TYPES,
    IMPL_BASES,
    PLUGIN_API_VERSION,
    Backend,
    PluginDescriptor,
    SelectionContext,
    descriptor_fields,
    missing_methods,
)
from plinth.errors import PluginError
from plinth.hookspecs import ENTRY_POINT_GROUP, REGISTRATION_HOOKS

log = logging.getLogger("plinth.plugins")

ALLOW_ENV = "PLINTH_PLUGINS_ALLOW"
BLOCK_ENV = "PLINTH_PLUGINS_BLOCK"

CATEGORIES: tuple[str, ...] = tuple(REGISTRATION_HOOKS)
#: where each category's plugins live in a checkout: plugins/<folder>/<name>/
#: (parsers come with model plugins)
CATEGORY_FOLDERS = {
    "accelerator": "accelerators", "backend": "backends", "model": "models", "a2a": "a2a",
    "kv_connector": "kv_connectors", "tool_parser": "models", "reasoning_parser": "models",
    "proposer": "proposers",
}  # fmt: skip

# statuses shown by `platform plugins`
OK, UNAVAILABLE, INCOMPATIBLE, FAILED, BLOCKED = "ok", "unavailable", "incompatible", "failed", "blocked"


@dataclass
class EntryPointInfo:
    """One entry point of the group, and the distribution that declares it."""

    name: str
    value: str
    distribution: str
    version: str
    status: str = OK  # ok | failed | blocked
    error: str = ""
    module: Any = None


@dataclass
class PluginEntry:
    """One descriptor, from one distribution, with what is known about it."""

    descriptor: PluginDescriptor
    source: EntryPointInfo
    status: str = OK
    reasons: list[str] = field(default_factory=list)
    _impl: Any = None

    @property
    def category(self) -> str:
        return self.descriptor.category

    @property
    def name(self) -> str:
        return self.descriptor.name

    @property
    def distribution(self) -> str:
        return self.source.distribution

    @property
    def version(self) -> str:
        return self.descriptor.version or self.source.version

    def label(self) -> str:
        return f"{self.name} ({self.distribution} {self.version})"

    def load(self) -> type:
        """Import the implementation class (cached); raises PluginError."""
        if self._impl is None:
            module_name, _, attr = self.descriptor.impl.partition(":")
            try:
                obj: Any = importlib.import_module(module_name)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except Exception as exc:  # any import error is this plugin's failure
                self.status, self.reasons = FAILED, [f"cannot import {self.descriptor.impl}: {type(exc).__name__}: {exc}"]
                raise PluginError(f"{self.category} {self.label()}: {self.reasons[0]}") from exc
            base = IMPL_BASES[self.category]
            if not (isinstance(obj, type) and issubclass(obj, base)):
                self.status = FAILED
                self.reasons = [f"{self.descriptor.impl} is not a subclass of plinth.api.{base.__name__}"]
                raise PluginError(f"{self.category} {self.label()}: {self.reasons[0]}")
            missing = missing_methods(obj)
            if missing:  # caught here, at load, rather than at the method's first call
                self.status = FAILED
                self.reasons = [f"{self.descriptor.impl} does not implement {', '.join(missing)} (required by plinth.api.{base.__name__})"]
                raise PluginError(f"{self.category} {self.label()}: {self.reasons[0]}")
            self._impl = obj
        return self._impl

    def evaluate(self, ctx: SelectionContext) -> list[str]:
        """Reasons this entry cannot serve ctx (and update status); [] = usable."""
        if self.status in (INCOMPATIBLE, BLOCKED) or (self.status == FAILED and self._impl is None and self.reasons):
            return list(self.reasons)
        try:
            impl = self.load()
        except PluginError:
            return list(self.reasons)
        try:
            reasons = [str(r) for r in impl.validate(ctx)]
        except Exception as exc:
            self.status, self.reasons = FAILED, [f"check() raised {type(exc).__name__}: {exc}"]
            return list(self.reasons)
        stubs = implementation_stubs(impl, ctx, checked=not reasons)
        if stubs:  # a scaffold (`platform plugins new`) not filled in yet: never chosen
            reasons = [f"not implemented yet: {', '.join(stubs)} (only raise NotImplementedError)", *reasons]
        self.status, self.reasons = (UNAVAILABLE, reasons) if reasons else (OK, [])
        return reasons

    def as_dict(self) -> dict[str, Any]:
        d = descriptor_fields(self.descriptor)
        d.update(
            distribution=self.distribution,
            version=self.version,
            entry_point=self.source.name,
            status=self.status,
            reasons=list(self.reasons),
        )
        return d


def stub_methods(cls: type) -> list[str]:
    """The methods a plugin's class defines whose body (past a docstring) is
    only ``raise NotImplementedError(...)``: what ``platform plugins new``
    generates for the contract's methods, so a scaffold shows as unavailable,
    naming them, until each is written. Methods of plinth's own classes are
    not the plugin's and are never listed."""
    out: list[str] = []
    seen: set[str] = set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__.split(".")[0] == "plinth":
            seen.update(vars(klass))
            continue
        for name, raw in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
            if inspect.isfunction(fn) and _only_raises_not_implemented(fn):
                out.append(f"{cls.__name__}.{name}")
    return sorted(out)


def implementation_stubs(impl: type, ctx: SelectionContext, *, checked: bool) -> list[str]:
    """``stub_methods`` of a plugin's class and, once its check passed
    (``checked``: the module may import what a failed check found missing),
    of the class it names for ``ctx``: a backend's attention backend."""
    stubs = stub_methods(impl)
    if checked and issubclass(impl, Backend):
        attention = impl.attention_backend(ctx)
        if attention is not None:
            stubs += stub_methods(attention)
    return stubs


@functools.cache
def _only_raises_not_implemented(fn: Any) -> bool:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):  # no source to read (a compiled module): taken as written
        return False
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def _split_patterns(text: str | Sequence[str] | None) -> list[str]:
    if not text:
        return []
    items = text.split(",") if isinstance(text, str) else [p for t in text for p in t.split(",")]
    return [p.strip() for p in items if p.strip()]


def _matches(patterns: list[str], *names: str) -> bool:
    return any(fnmatch.fnmatchcase(n, p) for p in patterns for n in names if n)


def _api_compatible(spec: str) -> tuple[bool, str]:
    try:
        ok = SpecifierSet(spec).contains(Version(PLUGIN_API_VERSION), prereleases=True)
    except InvalidSpecifier:
        return False, f"invalid plugin API range {spec!r}"
    return ok, "" if ok else f"supports plugin API {spec}, core provides {PLUGIN_API_VERSION}"


class PluginRegistry:
    """Every installed plugin, by category. Build one per process with
    ``PluginRegistry.discover()``; ``select`` resolves a choice once."""

    def __init__(self) -> None:
        self.entry_points: list[EntryPointInfo] = []
        self.entries: dict[str, list[PluginEntry]] = {c: [] for c in CATEGORIES}
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs.PlinthHookSpec)

    # ---- discovery -------------------------------------------------------

    @classmethod
    def discover(
        cls,
        allow: str | Sequence[str] | None = None,
        block: str | Sequence[str] | None = None,
        *,
        group: str = ENTRY_POINT_GROUP,
    ) -> "PluginRegistry":
        """Find, filter, import and register every plugin.

        allow / block: comma-separated names or glob patterns, matched against
        the entry-point name, the distribution name, the descriptor name and
        ``category:name``; default from $PLINTH_PLUGINS_ALLOW / $PLINTH_PLUGINS_BLOCK.
        """
        from stevedore import NamedExtensionManager

        allow_p = _split_patterns(allow if allow is not None else os.environ.get(ALLOW_ENV))
        block_p = _split_patterns(block if block is not None else os.environ.get(BLOCK_ENV))
        reg = cls()

        for ep in importlib.metadata.entry_points(group=group):
            dist = ep.dist
            info = EntryPointInfo(
                ep.name,
                ep.value,
                dist.metadata["Name"] if dist else "?",
                dist.version if dist else "?",
            )
            if _matches(block_p, info.name, info.distribution):
                info.status, info.error = BLOCKED, "blocked by the plugin block list"
            elif allow_p and not (
                _matches(allow_p, info.name, info.distribution) or any(":" in p for p in allow_p)
            ):
                info.status, info.error = BLOCKED, "not in the plugin allow list"
            reg.entry_points.append(info)

        wanted = [i for i in reg.entry_points if i.status == OK]
        by_key = {(i.name, i.value): i for i in wanted}

        def on_failure(_manager: Any, ep: Any, exc: BaseException) -> None:
            for info in wanted:
                if info.name == ep.name and info.value == ep.value:
                    info.status, info.error = FAILED, f"{type(exc).__name__}: {exc}"

        # stevedore loads every entry point with a given name, so a name that a
        # blocked entry point shares is imported directly below instead: a
        # blocked plugin is never imported.
        shared = {i.name for i in reg.entry_points if i.status != OK}
        names = sorted({i.name for i in wanted} - shared)
        if names:
            manager = NamedExtensionManager(
                group,
                names=names,
                on_load_failure_callback=on_failure,
                on_missing_entrypoints_callback=lambda names: None,
            )
            for ext in manager.extensions:
                info = by_key.get((ext.name, ext.entry_point.value))
                if info is not None:
                    info.module = ext.plugin
        for info in wanted:
            if info.status == OK and info.module is None:
                # stevedore's cache did not know it: import it directly
                try:
                    info.module = importlib.import_module(info.value.partition(":")[0])
                except Exception as exc:
                    info.status, info.error = FAILED, f"{type(exc).__name__}: {exc}"
            if info.status == OK:
                reg._register(info)
        reg._collect(allow_p, block_p)
        return reg

    def _register(self, info: EntryPointInfo) -> None:
        try:
            self.pm.register(info.module, name=f"{info.distribution}:{info.name}")
        except Exception as exc:  # pluggy.PluginValidationError and name clashes
            info.status, info.error = FAILED, f"invalid hook implementation: {exc}"
            return
        for caller in self.pm.get_hookcallers(info.module) or []:
            if not caller.has_spec():
                self.pm.unregister(info.module)
                info.status, info.error = FAILED, f"implements {caller.name!r}, which is not a plinth hook"
                return

    def _collect(self, allow_p: list[str], block_p: list[str]) -> None:
        registered = [i for i in self.entry_points if i.status == OK]
        for category, hook_name in REGISTRATION_HOOKS.items():
            expected = DESCRIPTOR_TYPES[category]
            for info in registered:
                if info.status != OK:
                    continue
                others = [self.pm.get_plugin(f"{o.distribution}:{o.name}") for o in registered if o is not info]
                caller = self.pm.subset_hook_caller(hook_name, remove_plugins=[p for p in others if p is not None])
                try:
                    results = caller()
                except Exception as exc:
                    info.status, info.error = FAILED, f"{hook_name}() raised {type(exc).__name__}: {exc}"
                    continue
                for desc in (d for batch in results for d in (batch or ())):
                    if not isinstance(desc, expected):
                        info.status = FAILED
                        info.error = f"{hook_name}() returned {type(desc).__name__}, expected {expected.__name__}"
                        break
                    entry = PluginEntry(desc, info)
                    qualified = f"{category}:{desc.name}"
                    if _matches(block_p, desc.name, qualified):
                        entry.status, entry.reasons = BLOCKED, ["blocked by the plugin block list"]
                    elif allow_p and not _matches(allow_p, info.name, info.distribution, desc.name, qualified):
                        entry.status, entry.reasons = BLOCKED, ["not in the plugin allow list"]
                    else:
                        ok, why = _api_compatible(desc.api)
                        if not ok:
                            entry.status, entry.reasons = INCOMPATIBLE, [why]
                    self.entries[category].append(entry)
        # drop descriptors of entry points that failed part way
        for category in CATEGORIES:
            self.entries[category] = [e for e in self.entries[category] if e.source.status == OK]

    # ---- queries -----------------------------------------------------------

    def names(self, category: str) -> list[str]:
        """Every registered name in a category (CLI choices come from here)."""
        return sorted({e.name for e in self.entries[category]})

    def get(self, category: str, name: str) -> PluginEntry:
        """The single entry registered under name; PluginError if none or two."""
        found = [e for e in self.entries[category] if e.name == name]
        if len(found) > 1:
            dists = " and ".join(f"{e.distribution} {e.version}" for e in found)
            raise PluginError(f"{category} name {name!r} is registered by more than one distribution: {dists}")
        if not found:
            raise PluginError(self._not_found(category, name))
        return found[0]

    def duplicates(self) -> list[str]:
        """One message per name registered twice in a category."""
        out = []
        for category, entries in self.entries.items():
            seen: dict[str, list[PluginEntry]] = {}
            for e in entries:
                seen.setdefault(e.name, []).append(e)
            for name, group in seen.items():
                if len(group) > 1:
                    dists = " and ".join(f"{e.distribution} {e.version}" for e in group)
                    out.append(f"duplicate {category} name {name!r}: registered by {dists}")
        return out

    def failed_entry_points(self) -> list[EntryPointInfo]:
        return [i for i in self.entry_points if i.status == FAILED]

    def _not_found(self, category: str, name: str) -> str:
        for info in self.entry_points:
            if info.name == name and info.status in (FAILED, BLOCKED):
                return (
                    f"{category} {name!r}: plugin {info.name} ({info.distribution} {info.version}) "
                    f"{'failed to load' if info.status == FAILED else 'is blocked'}: {info.error}"
                )
        described = self.describe_candidates(category)  # evaluates each candidate
        usable = sorted(e.name for e in self.entries[category] if e.status == OK)
        return f"no {category} named {name!r} (usable here: {', '.join(usable) or 'none'}). " + described

    def describe_candidates(
        self, category: str, ctx: SelectionContext | None = None, *, judge: Callable[[PluginEntry], SelectionContext] | None = None
    ) -> str:
        """Every candidate of a category with its status and reasons (each
        judged in ``judge(entry)`` where given, else in ``ctx``)."""
        entries = self.entries[category]
        failed = [i for i in self.failed_entry_points()]
        if not entries and not failed:
            return f"No {category} plugins are installed ({install_hint(category)})."
        lines = [f"Installed {category} plugins:"]
        for e in sorted(entries, key=lambda e: e.name):
            judged = judge(e) if judge is not None else ctx or SelectionContext()
            reasons = e.evaluate(judged) if e.status not in (INCOMPATIBLE, BLOCKED) else e.reasons
            lines.append(f"  {e.label()}: {e.status}" + (f": {'; '.join(reasons)}" if reasons else ""))
        for info in failed:
            lines.append(f"  plugin {info.name} ({info.distribution} {info.version}): failed to load: {info.error}")
        return "\n".join(lines)

    # ---- selection -----------------------------------------------------------

    def select(
        self,
        category: str,
        name: str | None,
        ctx: SelectionContext,
        *,
        prefer: Iterable[str] = (),
        judge: Callable[[PluginEntry], SelectionContext] | None = None,
    ) -> PluginEntry:
        """Resolve ``name`` (or ``auto``/None) in a category, once, at startup.

        A named plugin validates against ctx or raises PluginError with every
        candidate's reasons. ``auto`` takes the first preferred name that
        validates, then the rest by priority; the choice is logged.
        ``judge(entry)``: the context each candidate is judged in, where it
        depends on the candidate (a backend's own deterministic default).
        """
        context = judge or (lambda _e: ctx)
        if name and name != "auto":
            entry = self.get(category, name)
            reasons = entry.evaluate(context(entry))
            if reasons:
                raise PluginError(
                    f"{category} {entry.label()} cannot be used: {'; '.join(reasons)}\n"
                    + self.describe_candidates(category, ctx, judge=judge)
                )
            log.info("%s: using %s", category, entry.label())
            return entry
        for dup in self.duplicates():
            if dup.split("'")[0].startswith(f"duplicate {category} "):
                raise PluginError(dup)
        prefer = list(prefer)
        rank = {n: i for i, n in enumerate(prefer)}
        candidates = sorted(
            self.entries[category],
            key=lambda e: (rank.get(e.name, len(rank)), -e.descriptor.priority, e.name),
        )
        skipped = []
        for entry in candidates:
            reasons = entry.evaluate(context(entry))
            if not reasons:
                log.info(
                    "%s: auto chose %s%s",
                    category,
                    entry.label(),
                    f" (skipped {'; '.join(skipped)})" if skipped else "",
                )
                return entry
            skipped.append(f"{entry.name}: {'; '.join(reasons)}")
        for info in self.failed_entry_points():
            log.warning("plugin %s (%s) failed to load: %s", info.name, info.distribution, info.error)
        raise PluginError(f"no usable {category} plugin. " + self.describe_candidates(category, ctx, judge=judge))

    # ---- hooks -----------------------------------------------------------------

    @property
    def hook(self) -> Any:
        """pluggy's hook relay, for the lifecycle hooks."""
        return self.pm.hook

    def report(
        self, ctx: SelectionContext | None = None, contexts: Mapping[str, SelectionContext] | None = None
    ) -> list[dict[str, Any]]:
        """Rows for `platform plugins`: every descriptor and every failed or
        blocked entry point, each with status and reasons. ``contexts`` gives
        some categories a context of their own (backends are judged with the
        accelerator ``auto`` takes, whose instruction sets they read)."""
        ctx = ctx or SelectionContext()
        contexts = contexts or {}
        rows: list[dict[str, Any]] = []
        dups = {(c, n) for c, es in self.entries.items() for n in {e.name for e in es} if sum(e.name == n for e in es) > 1}
        for category in CATEGORIES:
            for e in sorted(self.entries[category], key=lambda e: (e.name, e.distribution)):
                cctx = contexts.get(category, ctx)
                if e.status in (OK, UNAVAILABLE):  # an earlier report may have judged it in another context
                    e.evaluate(cctx)
                row = e.as_dict()
                if (category, e.name) in dups:
                    others = [o for o in self.entries[category] if o.name == e.name and o is not e]
                    row["status"] = FAILED
                    row["reasons"] = [
                        f"duplicate name: also registered by {', '.join(f'{o.distribution} {o.version}' for o in others)}"
                    ] + row["reasons"]
                rows.append(row)
        for info in self.entry_points:
            if info.status in (FAILED, BLOCKED):
                rows.append(
                    {
                        "category": "?",
                        "name": info.name,
                        "distribution": info.distribution,
                        "version": info.version,
                        "entry_point": info.name,
                        "status": info.status,
                        "reasons": [info.error],
                        "priority": 0,
                        "description": "",
                    }
                )
        return rows


def install_hint(category: str | None = None) -> str:
    where = f"plugins/{CATEGORY_FOLDERS.get(category or '', '<category>')}/<name>"
    return f"install one with `pip install plinth-plugin-<name>`, or from a checkout `pip install ./{where}`"
