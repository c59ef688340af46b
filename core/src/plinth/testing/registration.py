"""Registration checks: does a plugin distribution plug in correctly?

These hold for every category. They use the real discovery
(``PluginRegistry.discover``), on the installed distribution, exactly as
``platform`` does; nothing is patched.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from collections.abc import Iterable

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name

from plinth.contract import DESCRIPTOR_TYPES, IMPL_BASES, PLUGIN_API_VERSION, SelectionContext
from plinth.errors import PluginError
from plinth.hookspecs import ENTRY_POINT_GROUP
from plinth.plugins import FAILED, INCOMPATIBLE, PluginEntry, PluginRegistry, implementation_stubs
from plinth.testing._report import Report

#: Top-level modules an entry-point module (and the registration hooks it
#: holds) must not import: the entry point is loaded by every ``platform``
#: command, on every machine, for every installed plugin.
FORBIDDEN_AT_ENTRY_POINT: tuple[str, ...] = (
    "torch",
    "torch_npu",
    "torch_xla",
    "deep_ep",
    "mooncake",
    "dlinfer",
    "triton",
    "cupy",
    "pycuda",
    "cuda",
    "tensorrt",
    "nvidia",
)

#: Top-level modules that importing the implementation module and calling
#: ``check()`` with an empty context must not import. torch is allowed here
#: (a CUDA build has to be asked for its device count); vendor SDKs are not:
#: probe them with ``importlib.util.find_spec`` and import them after selection.
FORBIDDEN_AT_CHECK: tuple[str, ...] = (
    "torch_npu",
    "torch_xla",
    "deep_ep",
    "mooncake",
    "dlinfer",
    "cupy",
    "pycuda",
    "tensorrt",
)

PREFIX = "plinth-plugin-"


def discover_all() -> PluginRegistry:
    """The real discovery, ignoring $PLINTH_PLUGINS_ALLOW / $PLINTH_PLUGINS_BLOCK
    (the kit checks the plugin, not this shell's lists)."""
    return PluginRegistry.discover(allow="", block="")


def _dist_entries(registry: PluginRegistry, distribution: str) -> list[PluginEntry]:
    want = canonicalize_name(distribution)
    return [e for es in registry.entries.values() for e in es if canonicalize_name(e.distribution) == want]


def expected_names(distribution: str) -> tuple[str, str] | None:
    """(entry-point name, import package) that the naming rule gives a
    distribution ``plinth-plugin-<name>``; None for other names."""
    canon = canonicalize_name(distribution)
    if not canon.startswith(PREFIX) or canon == PREFIX:
        return None
    name = canon[len(PREFIX) :]
    return name, "plinth_plugin_" + name.replace("-", "_")


def check_registration(
    distribution: str,
    *,
    naming: bool = True,
    cheap_import: bool = True,
    registry: PluginRegistry | None = None,
    raise_on_problem: bool = True,
) -> Report:
    """Check that an installed plugin distribution registers correctly.

    - it is installed and declares entry points in the group ``plinth.plugins``;
    - (``naming``) the naming rule holds: distribution ``plinth-plugin-<name>``,
      entry point ``<name>``, module inside the package ``plinth_plugin_<name>``;
    - the real discovery loads each entry point (no import error, valid
      ``@hookimpl`` signatures, only plinth hooks, descriptors of the right type);
    - it registers at least one plugin; each descriptor has a version, an
      integer priority, a description, a valid API range that includes the
      core's ``PLUGIN_API_VERSION``, and a name no other distribution uses;
    - each ``impl`` path imports, names a subclass of the category's base class,
      defines no method that only raises ``NotImplementedError`` (a scaffold's
      stub: each is named), and its ``check(SelectionContext())`` returns a
      list of non-empty strings;
    - (``cheap_import``) see ``check_cheap_import``.

    Returns the ``Report``; raises ``ConformanceError`` listing every problem
    (unless ``raise_on_problem=False``).
    """
    report = Report(f"distribution {distribution}")
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        report.problem(f"{distribution} is not installed in this environment ({sys.prefix})")
        return report.raise_for_problems() if raise_on_problem else report
    eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
    report.expect(bool(eps), f"declares entry points in the group {ENTRY_POINT_GROUP!r}", "it declares none")

    if naming:
        expected = expected_names(distribution)
        if expected is None:
            report.problem(
                f"naming rule: a plinth plugin distribution is named '{PREFIX}<name>' "
                f"(pass naming=False to check one named otherwise)"
            )
        else:
            ep_name, package = expected
            for ep in eps:
                module = ep.value.partition(":")[0]
                report.expect(
                    ep.name in (ep_name, ep_name.replace("-", "_")),
                    f"naming rule: entry point {ep.name!r} is named after the distribution",
                    f"expected {ep_name!r}",
                )
                report.expect(
                    module == package or module.startswith(package + "."),
                    f"naming rule: entry point module {module!r} is in package {package!r}",
                    f"expected {package}.<module>",
                )

    registry = registry or discover_all()
    want = canonicalize_name(distribution)
    infos = [i for i in registry.entry_points if canonicalize_name(i.distribution) == want]
    for info in infos:
        report.expect(
            info.status != FAILED,
            f"entry point {info.name} = {info.value} loads through discovery",
            info.error,
        )
    entries = _dist_entries(registry, distribution)
    report.expect(bool(entries), "registers at least one plugin", "every plinth_register_* hook returned nothing")
    for entry in entries:
        _check_entry(report, registry, entry)

    if cheap_import and eps:
        check_cheap_import(distribution, _report=report)
    return report.raise_for_problems() if raise_on_problem else report


def _check_entry(report: Report, registry: PluginRegistry, entry: PluginEntry) -> None:
    d = entry.descriptor
    label = f"{entry.category} {d.name}"
    report.expect(isinstance(d, DESCRIPTOR_TYPES[entry.category]), f"{label}: descriptor type")
    report.expect(bool(entry.version), f"{label}: has a version", "empty")
    report.expect(isinstance(d.priority, int), f"{label}: priority is an int", repr(d.priority))
    report.expect(bool(d.description.strip()), f"{label}: has a one-line description", "empty")
    try:
        SpecifierSet(d.api)
        report.ok(f"{label}: api range {d.api!r} is a PEP 440 specifier")
    except InvalidSpecifier:
        report.problem(f"{label}: api range {d.api!r} is not a PEP 440 specifier")
    report.expect(
        entry.status != INCOMPATIBLE,
        f"{label}: api range {d.api!r} includes the core's plugin API {PLUGIN_API_VERSION}",
        "; ".join(entry.reasons),
    )
    others = [o for o in registry.entries[entry.category] if o.name == d.name and o is not entry]
    report.expect(
        not others,
        f"{label}: name is unique in its category",
        "also registered by " + ", ".join(f"{o.distribution} {o.version}" for o in others),
    )
    try:
        impl = entry.load()
    except PluginError as exc:
        report.problem(f"{label}: impl {d.impl}: {exc}")
        return
    base = IMPL_BASES[entry.category]
    report.ok(f"{label}: impl {d.impl} imports and subclasses plinth.api.{base.__name__}")
    try:
        reasons = impl.check(SelectionContext())
    except Exception as exc:
        report.problem(f"{label}: check(SelectionContext()) raised {type(exc).__name__}: {exc}")
        return
    report.expect(
        isinstance(reasons, (list, tuple)) and all(isinstance(r, str) and r.strip() for r in reasons),
        f"{label}: check() returns a list of reasons (strings)",
        f"returned {reasons!r}",
    )
    try:
        stubs = implementation_stubs(impl, SelectionContext(), checked=not reasons)
    except Exception as exc:
        report.problem(f"{label}: naming its classes raised {type(exc).__name__}: {exc}")
        return
    report.expect(
        not stubs,
        f"{label}: every method it defines is implemented",
        f"not implemented yet: {', '.join(stubs)} (only raise NotImplementedError)",
    )


_PROBE = r"""
import json, sys
from plinth.api import SelectionContext
from plinth.plugins import PluginRegistry
from packaging.utils import canonicalize_name
dist, at_ep, at_check = sys.argv[1], set(json.loads(sys.argv[2])), set(json.loads(sys.argv[3]))
def loaded(names):
    return sorted(m for m in sys.modules if m.split(".")[0] in names)
before_ep = set(loaded(at_ep))
registry = PluginRegistry.discover(allow=dist, block="")
out = {"entry_point": sorted(set(loaded(at_ep)) - before_ep)}
before_check = set(loaded(at_check))
for entries in registry.entries.values():
    for e in entries:
        if canonicalize_name(e.distribution) == canonicalize_name(dist):
            e.evaluate(SelectionContext())
out["check"] = sorted(set(loaded(at_check)) - before_check)
print("PLINTH-PROBE " + json.dumps(out))
"""


def check_cheap_import(
    distribution: str,
    *,
    forbidden_at_entry_point: Iterable[str] = FORBIDDEN_AT_ENTRY_POINT,
    forbidden_at_check: Iterable[str] = FORBIDDEN_AT_CHECK,
    raise_on_problem: bool = True,
    _report: Report | None = None,
) -> Report:
    """Check, in a fresh interpreter, that a distribution's entry points are cheap.

    The subprocess runs the real discovery restricted to this distribution
    (``allow=distribution``), which imports its entry-point modules and calls
    the registration hooks: none of ``forbidden_at_entry_point`` (torch,
    torch_npu, torch_xla, deep_ep, mooncake, dlinfer, triton, CUDA libraries)
    may be imported by then. Then it imports each ``impl`` and calls
    ``check()`` with an empty context: none of ``forbidden_at_check`` (the
    vendor SDKs) may be imported by then.
    """
    report = _report or Report(f"distribution {distribution}")
    try:  # the allow list matches the name as the metadata spells it
        distribution = importlib.metadata.distribution(distribution).metadata["Name"]
    except importlib.metadata.PackageNotFoundError:
        report.problem(f"{distribution} is not installed in this environment ({sys.prefix})")
        return report.raise_for_problems() if _report is None and raise_on_problem else report
    at_ep, at_check = sorted(set(forbidden_at_entry_point)), sorted(set(forbidden_at_check))
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, distribution, json.dumps(at_ep), json.dumps(at_check)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PLINTH-PROBE ")), None)
    if proc.returncode != 0 or line is None:
        report.problem(f"cheap-import probe failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    else:
        out = json.loads(line[len("PLINTH-PROBE ") :])
        report.expect(
            not out["entry_point"],
            "entry-point modules and registration hooks import none of " + ", ".join(at_ep),
            "they imported " + ", ".join(out["entry_point"]),
        )
        report.expect(
            not out["check"],
            "impl modules and check() import no vendor SDK (" + ", ".join(at_check) + ")",
            "they imported " + ", ".join(out["check"]) + " (probe with importlib.util.find_spec instead)",
        )
    if _report is None and raise_on_problem:
        report.raise_for_problems()
    return report
