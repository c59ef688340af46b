"""``platform plugins check``: the conformance kit for every plugin a
distribution registers, on this machine, as a report a vendor can publish.

It installs nothing: the plugin is found through the real discovery, as
``platform serve`` would find it. The report names the plinth and plugin
versions, the machine (device, instruction sets or compute capability),
and each check as pass, fail or skipped with why; any failure fails it.

    from plinth.testing.certify import certify
    report = certify("plinth-plugin-mychip")      # or a folder, or a plugin name
    print(report.text()); assert report.passed
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from plinth.errors import PlinthError
from plinth.plugins import PluginEntry, PluginRegistry, implementation_stubs
from plinth.testing._report import ConformanceError, Report
from plinth.testing.accelerator import DEFAULT_UTILIZATION

PASS, FAIL, SKIP = "pass", "fail", "skip"
#: the order categories are checked and shown in
ORDER = ("accelerator", "backend", "model", "a2a", "kv_connector", "proposer", "tool_parser", "reasoning_parser")


@dataclass
class Check:
    status: str  # pass | fail | skip
    what: str


@dataclass
class Section:
    title: str
    checks: list[Check] = field(default_factory=list[Check])
    #: what the plugin reported of itself (memory, declined ops), shown above the checks
    facts: dict[str, str] = field(default_factory=dict[str, str])

    def add(self, report: Report) -> None:
        self.checks += [Check(PASS, p) for p in report.passed]
        self.checks += [Check(SKIP, s) for s in report.skipped]
        self.checks += [Check(FAIL, p) for p in report.problems]

    def run(self, fn: Callable[..., Report], *args: Any, **kwargs: Any) -> Report | None:
        """Run a kit check into this section: its report whether it passes or
        raises ConformanceError; any other exception is one failed check."""
        try:
            report = fn(*args, **kwargs)
        except ConformanceError as exc:
            report = getattr(exc, "report", None)
            if report is None:
                self.checks.append(Check(FAIL, str(exc)))
                return None
        except Exception as exc:
            self.checks.append(Check(FAIL, f"{getattr(fn, '__name__', 'check')} raised {type(exc).__name__}: {exc}"))
            return None
        self.add(report)
        return report


@dataclass
class Certificate:
    """The report: header facts and one section per check run."""

    plinth: dict[str, str]
    plugin: dict[str, Any]
    machine: dict[str, str]
    sections: list[Section]
    date: str
    command: str

    def counts(self) -> dict[str, int]:
        out = {PASS: 0, FAIL: 0, SKIP: 0}
        for s in self.sections:
            for c in s.checks:
                out[c.status] += 1
        return out

    @property
    def passed(self) -> bool:
        c = self.counts()
        return c[FAIL] == 0 and c[PASS] > 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "result": PASS if self.passed else FAIL,
            "counts": self.counts(),
            "date": self.date,
            "command": self.command,
            "plinth": self.plinth,
            "plugin": self.plugin,
            "machine": self.machine,
            "sections": [
                {"title": s.title, "facts": s.facts, "checks": [{"status": c.status, "check": c.what} for c in s.checks]}
                for s in self.sections
            ],
        }

    def text(self) -> str:
        c = self.counts()

        def row(key: str, value: str) -> str:
            return f"{key:<12}{value}"

        plugin = self.plugin
        lines = [
            f"# plinth conformance report: {plugin['distribution']} {plugin.get('version', '')}".rstrip(),
            "",
            row("result", f"{'PASS' if self.passed else 'FAIL'} ({c[PASS]} passed, {c[FAIL]} failed, {c[SKIP]} skipped)"),
            row("plugin", f"{plugin['distribution']} {plugin.get('version', '?')}" + (f" from {plugin['location']}" if plugin.get("location") else "")),
        ]
        lines += [row("", f"{p['category']} {p['name']}: supports plugin API {p['api']}") for p in plugin.get("plugins", ())]
        lines.append(row("plinth", f"plinth-core {self.plinth['core']}, plugin API {self.plinth['plugin_api']}"))
        keys = ("host", "cpu", "python", "torch", "accelerator", "device", "capability", "isa")
        lines += [row(k, self.machine[k]) for k in keys if self.machine.get(k)]
        lines += [row("date", self.date), row("command", self.command)]
        if plugin.get("note"):
            lines.append(row("note", plugin["note"]))
        for s in self.sections:
            lines += ["", f"## {s.title}"]
            lines += [f"  {k}: {v}" for k, v in s.facts.items()]
            lines += [f"  {c.status.upper() if c.status == FAIL else c.status:<5} {c.what}" for c in s.checks]
            if not s.checks:
                lines.append("  (nothing was checked)")
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# what to check
# ---------------------------------------------------------------------------


def _project_name(folder: Path) -> str:
    text = (folder / "pyproject.toml").read_text()
    try:
        import tomllib

        return str(tomllib.loads(text)["project"]["name"])
    except ModuleNotFoundError:  # Python 3.10: the one key, read by hand
        m = re.search(r'^\[project\][^\[]*?^name\s*=\s*"([^"]+)"', text, re.MULTILINE | re.DOTALL)
        if not m:
            raise PlinthError(f"{folder}/pyproject.toml names no [project] name") from None
        return m.group(1)
    except KeyError:
        raise PlinthError(f"{folder}/pyproject.toml names no [project] name") from None


def _installed_from(dist: importlib.metadata.Distribution) -> str | None:
    """The folder a distribution was installed from (pip's direct_url.json), if any."""
    raw = dist.read_text("direct_url.json")
    if not raw:
        return None
    url = str(json.loads(raw).get("url", ""))
    return url.removeprefix("file://") if url.startswith("file://") else None


def resolve_distribution(target: str, registry: PluginRegistry) -> tuple[importlib.metadata.Distribution, str]:
    """(the installed distribution ``target`` means, a note about it): a
    source folder (its pyproject's name, which must be installed), a
    distribution name, or the name a plugin registers."""
    folder = Path(target)
    if folder.is_dir():
        if not (folder / "pyproject.toml").is_file():
            raise PlinthError(f"{folder} has no pyproject.toml: give a plugin's source folder, distribution or name")
        name = _project_name(folder)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise PlinthError(
                f"{name} (the project in {folder}) is not installed in this environment ({sys.prefix}); "
                f"`pip install -e {folder}` first: `platform plugins check` installs nothing"
            ) from None
        source = _installed_from(dist)
        note = ""
        if source is not None and Path(source).resolve() != folder.resolve():
            note = f"the installed {name} comes from {source}, not from {folder}"
        return dist, note
    try:
        dist = importlib.metadata.distribution(target)
        if any(ep.group == "plinth.plugins" for ep in dist.entry_points):
            return dist, ""
    except importlib.metadata.PackageNotFoundError:
        pass
    owners = sorted({e.distribution for es in registry.entries.values() for e in es if e.name == target})
    if not owners:
        raise PlinthError(f"no installed plugin, plugin distribution or source folder is named {target!r} (see `platform plugins`)")
    if len(owners) > 1:
        raise PlinthError(f"{target!r} is registered by {', '.join(owners)}: name the distribution")
    return importlib.metadata.distribution(owners[0]), ""


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine() -> dict[str, str]:
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    return {
        "host": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpu": f"{_cpu_name()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch_version,
    }


def certify(
    target: str,
    *,
    device: str = "auto",
    dtypes: list[str] | None = None,
    model: str | None = None,
    config: dict[str, Any] | None = None,
    command: str | None = None,
) -> Certificate:
    """Run the kit on every plugin the distribution ``target`` registers
    (see ``resolve_distribution``) and return the report. ``device``: the
    accelerator backends, models and a2a groups compute on; ``dtypes``:
    what backends and models are checked in (default: the accelerator's);
    ``model``: a checkpoint for a model loader; ``config``: a KV
    connector's config or a proposer's options. Raises ``PlinthError``
    when ``target`` is nothing installed."""
    from plinth import __version__
    from plinth.api import PLUGIN_API_VERSION
    from plinth.testing.registration import check_registration, discover_all

    registry = discover_all()
    dist, note = resolve_distribution(target, registry)
    name = str(dist.metadata["Name"])
    entries = sorted(
        (e for es in registry.entries.values() for e in es if canonicalize_name(e.distribution) == canonicalize_name(name)),
        key=lambda e: (ORDER.index(e.category) if e.category in ORDER else len(ORDER), e.name),
    )
    plugin = {
        "distribution": name,
        "version": dist.version,
        "location": str(Path(target).resolve()) if Path(target).is_dir() else (_installed_from(dist) or ""),
        "plugins": [{"category": e.category, "name": e.name, "api": e.descriptor.api} for e in entries],
        "note": note,
    }
    machine = _machine()
    sections = [Section(f"registration: {name}")]
    sections[0].run(check_registration, name, registry=registry, raise_on_problem=False)
    accelerator = _accelerator(registry, device, entries, machine)
    for entry in entries:
        section = Section(f"{entry.category} {entry.name}")
        sections.append(section)
        stubs = _stubs(entry)
        if stubs:  # a scaffold's methods: its category's checks would only repeat each one's NotImplementedError
            section.checks.append(Check(FAIL, f"not implemented yet: {', '.join(stubs)}; its {entry.category} checks run once they are"))
            continue
        CHECKS[entry.category](section, entry, registry, accelerator, dtypes, model, config)
    return Certificate(
        plinth={"core": __version__, "plugin_api": PLUGIN_API_VERSION},
        plugin=plugin,
        machine=machine,
        sections=sections,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=command or f"platform plugins check {target}",
    )


def _stubs(entry: PluginEntry) -> list[str]:
    from plinth.api import SelectionContext

    try:
        impl = entry.load()
        return implementation_stubs(impl, SelectionContext(), checked=not impl.check(SelectionContext()))
    except Exception:  # it does not load, or its check raises: the registration section says why
        return []


@dataclass
class Device:
    """The accelerator the checks compute on, or why there is none."""

    name: str = ""
    instance: Any = None
    dtypes: tuple[str, ...] = ()
    why_none: str = ""


def _accelerator(registry: PluginRegistry, device: str, entries: list[PluginEntry], machine: dict[str, str]) -> Device:
    """The accelerator ``device`` names (an accelerator under test that is
    available is itself the device with ``auto``), described in ``machine``."""
    from plinth.api import SelectionContext

    own = [e for e in entries if e.category == "accelerator"]
    name = device
    if device == "auto" and own and not own[0].evaluate(SelectionContext()):
        name = own[0].name
    try:
        entry = registry.select("accelerator", name, SelectionContext())
        acc = entry.load()()
        info = acc.info()
    except Exception as exc:
        why = str(exc).splitlines()[0]
        machine["accelerator"] = f"none usable ({why})"
        return Device(why_none=why)
    machine["accelerator"] = f"{entry.name} ({entry.distribution} {entry.version}): {info.device_type}, {info.dist_backend}"
    machine["device"] = f"{info.device_count} x {info.device_name or info.device_type}"
    if info.capability:
        machine["capability"] = info.capability
    if info.isa:
        machine["isa"] = ",".join(info.isa)
    return Device(entry.name, acc, tuple(info.dtypes))


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _check_accelerator(section: Section, entry: PluginEntry, registry: PluginRegistry, device: Device, *_: Any) -> None:
    from plinth.testing.accelerator import check_accelerator

    report = section.run(check_accelerator, entry.name, registry=registry, raise_on_problem=False)
    info = getattr(report, "info", None)
    if info is None:
        return
    section.facts["device"] = f"{info.device_count} x {info.device_name or info.device_type} ({info.device_type})"
    section.facts["distributed backend"] = info.dist_backend
    section.facts["dtypes"] = f"{', '.join(info.dtypes)} (default {info.default_dtype}); fp8 {info.fp8}"
    try:
        acc = entry.load()()
        free, total = acc.memory(0)
        budget = acc.kv_cache_budget(free=free, total=total, weights=0, utilization=DEFAULT_UTILIZATION)
        section.facts["memory"] = f"{_gib(free)} free of {_gib(total)}; KV pool by default {_gib(budget)} (no weights loaded)"
    except Exception as exc:  # the kit has the failure; the facts say what was seen
        section.facts["memory"] = f"memory(0) raised {type(exc).__name__}: {exc}"
    if info.preferred_backends:
        section.facts["preferred backends"] = ", ".join(info.preferred_backends)


def _dtypes(device: Device, dtypes: list[str] | None) -> list[str]:
    return list(dtypes) if dtypes else list(device.dtypes) or ["float32"]


def _check_backend(
    section: Section, entry: PluginEntry, registry: PluginRegistry, device: Device, dtypes: list[str] | None, *_: Any
) -> None:
    import torch

    from plinth.api import SelectionContext
    from plinth.testing.backend import check_backend

    if device.instance is None:
        section.checks.append(Check(SKIP, f"ops against the reference: no accelerator to compute on ({device.why_none})"))
        return
    for dtype in _dtypes(device, dtypes):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            section.checks.append(Check(FAIL, f"{dtype}: not a torch dtype"))
            continue
        ctx = SelectionContext(accelerator=device.instance, dtype=getattr(torch, dtype))
        try:
            impl = entry.load()
            if not entry.evaluate(ctx):
                declined = dict(impl.unsupported_ops(ctx))
                section.facts[f"declines in {dtype}"] = (
                    "; ".join(f"{op}: {why}" for op, why in sorted(declined.items())) or "nothing"
                )
        except Exception as exc:
            section.facts[f"declines in {dtype}"] = f"unsupported_ops() raised {type(exc).__name__}: {exc}"
        section.run(check_backend, entry.name, dtypes=(dtype,), accelerator=device.name)


def _check_model(
    section: Section, entry: PluginEntry, registry: PluginRegistry, device: Device, dtypes: list[str] | None,
    model: str | None, *_: Any,
) -> None:  # fmt: skip
    from plinth.testing.model import check_model_loader

    path, tokenizer, why = model, True, ""
    if path is None:
        path, why = _tiny_checkpoint(entry)
        tokenizer = False
    if path is None:
        section.checks.append(Check(SKIP, f"building a model: {why}"))
        return
    for dtype in dtypes or ["float32"]:
        section.run(check_model_loader, entry.name, path, dtype=dtype, tokenizer=tokenizer)


def _tiny_checkpoint(entry: PluginEntry) -> tuple[str | None, str]:
    """A tiny random checkpoint of an architecture the loader names that
    transformers builds (its reference), or (None, why not)."""
    import tempfile

    architectures = tuple(getattr(entry.descriptor, "architectures", ()))
    hint = "pass --model PATH (a checkpoint of " + (", ".join(architectures) or "an architecture it names") + ")"
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None, f"transformers is not installed to make a tiny checkpoint; {hint}"
    by_class = {cls: model_type for model_type, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
    from plinth.testing.tiny import save_random_model

    for arch in architectures:
        if arch not in by_class:
            continue
        try:
            config = AutoConfig.for_model(
                by_class[arch], vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                architectures=[arch],
            )  # fmt: skip
            path = save_random_model(config, tempfile.mkdtemp(prefix=f"plinth-check-{entry.name}-"), seed=0)
            return path, ""
        except Exception as exc:  # not every architecture takes these sizes
            hint = f"a tiny {arch} could not be built ({type(exc).__name__}: {exc}); {hint}"
    return None, f"transformers builds none of its architectures; {hint}" if "could not" not in hint else hint


def _check_a2a(section: Section, entry: PluginEntry, registry: PluginRegistry, device: Device, *_: Any) -> None:
    from plinth.testing.a2a import check_a2a

    if device.instance is None:
        section.checks.append(Check(SKIP, f"round trips: no accelerator to run the ranks on ({device.why_none})"))
        return
    section.run(check_a2a, entry.name, worlds=(2,), accelerator=device.name)


def _check_kv_connector(section: Section, entry: PluginEntry, *args: Any) -> None:
    from plinth.testing.kv_connector import check_kv_connector

    section.run(check_kv_connector, entry.name, config=dict(args[-1] or {}))


def _check_proposer(section: Section, entry: PluginEntry, *args: Any) -> None:
    from plinth.testing.proposer import check_proposer

    section.run(check_proposer, entry.name, options=dict(args[-1] or {}))


def _check_tool_parser(section: Section, entry: PluginEntry, *_: Any) -> None:
    from plinth.testing.parsers import check_tool_parser

    section.run(check_tool_parser, entry.name, None)


def _check_reasoning_parser(section: Section, entry: PluginEntry, *_: Any) -> None:
    from plinth.testing.parsers import check_reasoning_parser

    section.run(check_reasoning_parser, entry.name, None)


#: category -> what runs for it
CHECKS: dict[str, Callable[..., None]] = {
    "accelerator": _check_accelerator,
    "backend": _check_backend,
    "model": _check_model,
    "a2a": _check_a2a,
    "kv_connector": _check_kv_connector,
    "proposer": _check_proposer,
    "tool_parser": _check_tool_parser,
    "reasoning_parser": _check_reasoning_parser,
}
