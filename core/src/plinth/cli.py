"""The ``platform`` command.

The engine's flags are made from the settings' declarations
(``plinth.engine.config``: name, type, default, help), one argument group
per section (``add_config_arguments``), as ``LLM(**kw)`` is; nothing here
writes a setting's default again. Plugin choices (``--device``,
``--backend``, ``--a2a``, ``--kv-connector``, ``--speculative-method``) show
the installed plugins' names when the parser is built; nothing here names
one. A bad choice is rejected by the plugin registry, whose message lists
every candidate and why it cannot be used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import sys
import typing
from typing import Any, Callable, Iterable, Sequence

from plinth import __version__
from plinth.contract import AcceleratorDescriptor
from plinth.engine.config import AUTO, SECTIONS, default_of, iter_settings, setting_sections
from plinth.errors import ConfigError, PlinthError
from plinth.plugins import ALLOW_ENV, BLOCK_ENV, PluginRegistry, install_hint

log = logging.getLogger("plinth")


def _flag(f: Any) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


#: the option that chooses each category's plugin, and its default (the settings' declarations)
CATEGORY_OPTIONS: dict[str, tuple[str, str | None]] = {
    f.metadata["category"]: (_flag(f), default_of(f)) for _, f in iter_settings() if f.metadata.get("category")
}

#: each section's argument group
SECTION_TITLES = {
    "load": "model",
    "compute": "compute (plugin choices are the installed plugins; see `platform plugins`)",
    "cache": "KV cache",
    "scheduler": "scheduler",
    "parallel": "parallelism and the multi-process launch (torchrun's flags; one node launches all its ranks itself)",
    "speculative": "speculative decoding",
    "kv_transfer": "KV connector",
    "observability": "observability",
}

#: flags that only the command line has: another spelling of a setting
KV_TRANSFER_CONFIG_HELP = (
    'the KV connector as vLLM and LMDeploy spell it: \'{"kv_connector": NAME, "kv_role": kv_both|kv_producer|kv_consumer, '
    '"kv_connector_extra_config": {...}}\' (merged under --kv-connector-config)'
)


def _choices(registry: PluginRegistry, category: str, with_auto: bool) -> str:
    names = (["auto"] if with_auto else []) + registry.names(category)
    return "{" + ",".join(names) + "}" if names else "NAME"


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _json_option(args: argparse.Namespace, name: str) -> dict[str, Any] | None:
    """A JSON-object option given as text (None when not given)."""
    text = getattr(args, name, None)
    if not text:
        return None
    try:
        return _json_object(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"--{name.replace('_', '-')} is {exc}") from None


def _parser_of(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A setting's parser as argparse's ``type``: its ConfigError a usage error."""

    def parse_arg(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse_arg.__name__ = getattr(parse, "__name__", "value")
    return parse_arg


def _default_text(f: Any) -> str:
    default, unset = default_of(f), f.metadata.get("unset")
    if isinstance(default, bool):
        text = "on" if default else "off"
    else:
        text = "" if default is None else str(default)
    return ", ".join(t for t in (text, unset) if t) or "none"


def setting_argument(f: Any, hints: dict[str, Any], registry: PluginRegistry) -> tuple[str, dict[str, Any]]:
    """The flag of one setting and its ``add_argument`` keywords, from its declaration."""
    meta = f.metadata
    kw: dict[str, Any] = {"dest": f.name, "default": default_of(f)}
    kw["help"] = f"{meta['help']} (default: {_default_text(f)})".replace("%", "%%")
    types = {t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)}
    if meta.get("category"):
        kw["metavar"] = _choices(registry, meta["category"], kw["default"] == AUTO)
    elif meta.get("metavar"):
        kw["metavar"] = meta["metavar"]
    if meta.get("parse"):
        kw["type"] = _parser_of(meta["parse"])
    elif meta.get("json"):
        kw["type"] = _json_object
    elif types == {bool}:
        kw["action"] = argparse.BooleanOptionalAction if meta.get("negatable", True) else "store_true"
    elif len(types) == 1 and next(iter(types)) in (int, float):
        kw["type"] = next(iter(types))
    return _flag(f), kw


def add_config_arguments(parser: argparse.ArgumentParser, registry: PluginRegistry, *, command: str, only: Iterable[str] | None = None) -> None:
    """The flags of the engine's settings (``plinth.engine.config``), one
    argument group per section, and the options plugins add; ``only``: just
    these settings (a command that takes a few, as ``bench offline``)."""
    wanted = set(only) if only is not None else None
    groups: dict[str, Any] = {}
    for section, f in iter_settings():
        commands = f.metadata.get("commands")
        if not f.metadata.get("cli", True) or (commands and command not in commands) or (wanted is not None and f.name not in wanted):
            continue
        if section not in groups:
            groups[section] = parser.add_argument_group(SECTION_TITLES[section])
        flag, kw = setting_argument(f, typing.get_type_hints(SECTIONS[section]), registry)
        groups[section].add_argument(flag, **kw)
        if f.name == "kv_connector_config":
            groups[section].add_argument("--kv-transfer-config", type=_json_object, default=None, metavar="JSON", help=KV_TRANSFER_CONFIG_HELP)
    if wanted is None:
        extra = parser.add_argument_group("plugin options")
        before = {a.dest for a in parser._actions}
        registry.hook.plinth_add_cli_arguments(parser=extra)
        parser.set_defaults(_plugin_options=[a.dest for a in parser._actions if a.dest not in before])


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """The model, a positional argument (``LoadConfig.model``'s declaration)."""
    f = next(f for _, f in iter_settings() if f.name == "model")
    parser.add_argument("model", nargs="?", default=default_of(f), help=f"{f.metadata['help']} (default: {_default_text(f)})")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM`` keyword arguments from parsed flags: the settings given as
    flags (``add_config_arguments``) and the plugins' options."""
    names = setting_sections()
    kwargs = {k: v for k, v in vars(args).items() if k in names}
    transfer = getattr(args, "kv_transfer_config", None)
    if transfer is not None:  # vLLM's spelling, under plinth's own
        kwargs["kv_connector_config"] = {**transfer, **(kwargs.get("kv_connector_config") or {})}
    kwargs["plugin_options"] = {k: getattr(args, k) for k in getattr(args, "_plugin_options", ())}
    return kwargs


# ---------------------------------------------------------------------------
# platform plugins
# ---------------------------------------------------------------------------


def _details(row: dict[str, Any]) -> str:
    if row["reasons"]:
        return "; ".join(row["reasons"])
    text = row.get("summary") or row.get("description", "")
    claims = [*row.get("architectures", ()), *(f"gguf:{a}" for a in row.get("gguf_architectures", ()))]
    if claims:  # model loaders: what they build, and the names they serve
        text += f" [{', '.join(claims)}]"
    if row.get("named_models"):
        text += f" [models: {', '.join(name for name, _ in row['named_models'])}]"
    for dtype, limits in (row.get("unsupported_ops") or {}).items():
        for why in dict.fromkeys(limits.values()):  # ops that share a reason are listed together
            ops = ", ".join(op for op, w in limits.items() if w == why)
            text += f"; in {dtype}, {ops} from the reference: {why}"
    declared: dict[str, list[str]] = {}  # one line per declaration, naming the dtypes that share it
    for dtype, caps in (row.get("capabilities") or {}).items():
        if caps.get("fp8"):
            declared.setdefault(f"FP8 weights {caps['fp8']}: {caps['fp8_why']}", []).append(dtype)
        if caps.get("gguf_formats"):
            declared.setdefault(f"GGUF {','.join(caps['gguf_formats'])} kept in blocks: {caps['gguf_path']}", []).append(dtype)
        if caps.get("deterministic_default"):  # an unset --deterministic turns the mode on here
            declared.setdefault(f"deterministic by default ({caps['deterministic_why']})", []).append(dtype)
        for line in caps.get("dropped_paths") or ():  # kernel paths the CPU claims that its probe refused
            declared.setdefault(f"kernel path dropped: {line}", []).append(dtype)
    for what, dtypes in declared.items():
        text += f"; in {', '.join(dtypes)}, {what}"
    for dtype, caps in (row.get("deterministic_capabilities") or {}).items():
        if caps.get("gguf_path"):
            text += f"; --deterministic in {dtype}, GGUF blocks: {caps['gguf_path']}"
    deterministic = row.get("deterministic")
    if deterministic is not None:  # what --deterministic takes from the reference on top of the above
        if not any(deterministic.values()):
            text += "; --deterministic: every op batch-invariant"
        for dtype, limits in deterministic.items():
            for why in dict.fromkeys(limits.values()):
                ops = ", ".join(op for op, w in limits.items() if w == why)
                text += f"; --deterministic in {dtype}: {ops} from the reference: {why}"
    return text


def _unsupported_ops(registry: PluginRegistry, row: dict[str, Any], ctx: Any) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
    """For an available backend, over the accelerator's dtypes: dtype ->
    {op: why} it declines, and dtype -> {op: why} it declines in addition
    under ``--deterministic`` (an empty dict: every op it has stays, batch-invariant)."""
    impl = registry.get("backend", row["name"]).load()
    out, deterministic = {}, {}
    for dtype in ctx.accelerator.supported_dtypes():
        name = str(dtype).removeprefix("torch.")
        limits = dict(impl.unsupported_ops(dataclasses.replace(ctx, dtype=dtype, deterministic=False)))
        if limits:
            out[name] = limits
        det = impl.unsupported_ops(dataclasses.replace(ctx, dtype=dtype, deterministic=True))
        deterministic[name] = {op: why for op, why in det.items() if op not in limits}
    return out, deterministic


def _capabilities(registry: PluginRegistry, row: dict[str, Any], ctx: Any) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """dtype -> the backend's declared capabilities (those it declares), over
    the accelerator's dtypes: what start-up hands the model loader there; and
    dtype -> those under ``--deterministic`` where they differ."""
    impl = registry.get("backend", row["name"]).load()
    out, deterministic = {}, {}
    for dtype in ctx.accelerator.supported_dtypes():
        caps = impl.capabilities(dataclasses.replace(ctx, dtype=dtype, deterministic=False))
        if caps != type(caps)():
            out[str(dtype).removeprefix("torch.")] = dataclasses.asdict(caps)
        det = impl.capabilities(dataclasses.replace(ctx, dtype=dtype, deterministic=True))
        if det != caps:  # what --deterministic changes, e.g. how GGUF blocks run
            deterministic[str(dtype).removeprefix("torch.")] = dataclasses.asdict(det)
    return out, deterministic


def _backend_context(registry: PluginRegistry, name: str) -> Any:
    """The context backends are judged in by `platform plugins`: the
    accelerator ``--device`` takes (its instruction sets, its default dtype)."""
    from plinth.api import SelectionContext

    try:
        accelerator = registry.get("accelerator", name).load()()
        return SelectionContext(accelerator=accelerator, dtype=accelerator.default_dtype())
    except Exception as exc:  # backends are then judged without one
        log.debug("no accelerator for the backend report: %s", exc)
        return None


def resolve_choices(
    registry: PluginRegistry, choices: dict[str, str | None], *, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Resolve plugin choices the way start-up does, before any model is read.

    The accelerator is always resolved (a name, or ``auto``: the highest
    priority that validates); the backend, a2a and KV connector are validated
    when named, with the chosen accelerator in the context. ``auto`` for those
    depends on the model and dtype, so it is reported as such. Raises
    ``PluginError`` (with every candidate's reasons) when a choice fails.
    Returns category -> ``PluginEntry`` (or a string for a deferred ``auto``).
    """
    from plinth.api import SelectionContext

    ctx = SelectionContext(options=dict(options or {}))
    accel = registry.select("accelerator", choices.get("accelerator") or "auto", ctx)
    selected: dict[str, Any] = {"accelerator": accel}
    accelerator = accel.load()()
    ctx = dataclasses.replace(ctx, accelerator=accelerator)
    prefer: tuple[str, ...] = ()
    try:
        prefer = tuple(accelerator.info().preferred_backends)
    except Exception as exc:  # info() may need the device; selection does not
        log.debug("info() of %s failed: %s", accel.name, exc)
    for category in ("backend", "a2a", "kv_connector", "proposer"):
        name = choices.get(category)
        if name and name != "auto":
            selected[category] = registry.select(category, name, ctx, prefer=prefer)
        elif category == "backend" and registry.entries["backend"]:
            order = ", ".join(prefer) or "priority"
            selected[category] = f"auto (chosen at start-up with the model; tries {order} first)"
    return selected


def _check_choices(args: argparse.Namespace) -> dict[str, str | None] | None:
    """The choices given to `platform plugins`; None when nothing is to be checked."""
    choices = {c: getattr(args, CATEGORY_OPTIONS[c][0].lstrip("-").replace("-", "_"), None) for c in CATEGORY_OPTIONS}
    if not args.check and not any(v and v != "auto" for v in choices.values()):
        return None
    return choices


def cmd_plugins(args: argparse.Namespace, registry: PluginRegistry) -> int:
    choices = _check_choices(args)
    selected: dict[str, Any] = {}
    error = None
    if choices is not None:
        try:
            selected = resolve_choices(registry, choices)
        except PlinthError as exc:
            error = exc
    rows = registry.report()
    usable = sorted((r for r in rows if r["category"] == "accelerator" and r["status"] == "ok"), key=lambda r: (-r["priority"], r["name"]))
    auto = usable[0] if usable else None  # what `--device auto` takes (select() orders the same way)
    chosen = selected.get("accelerator")
    backend_ctx = _backend_context(registry, chosen.name if chosen else auto["name"]) if (chosen or auto) else None
    if backend_ctx is not None:  # backends judged on that accelerator, as start-up judges them
        rows = registry.report(contexts={"backend": backend_ctx})
        for row in rows:
            if row["category"] == "backend" and row["status"] == "ok":
                try:
                    row["unsupported_ops"], row["deterministic"] = _unsupported_ops(registry, row, backend_ctx)
                except Exception as exc:
                    row["status"], row["reasons"] = "failed", [f"unsupported_ops() raised {type(exc).__name__}: {exc}"]
                    continue
                try:
                    row["capabilities"], row["deterministic_capabilities"] = _capabilities(registry, row, backend_ctx)
                except Exception as exc:
                    row["status"], row["reasons"] = "failed", [f"capabilities() raised {type(exc).__name__}: {exc}"]
    for row in rows:  # an available accelerator says what it found
        if row["category"] == "accelerator" and row["status"] == "ok":
            try:
                info = registry.get("accelerator", row["name"]).load()().info()
                row["summary"] = (
                    f"{info.device_count} x {info.device_name or info.device_type}"
                    + (f" {info.capability}" if info.capability else "")
                    + f", {info.dist_backend}, fp8 {info.fp8}, default {info.default_dtype}"
                    + (f"; instruction sets: {','.join(info.isa)}" if info.isa else "")
                )
                row["info"] = vars(info)
            except Exception as exc:
                row["status"], row["reasons"] = "failed", [f"info() raised {type(exc).__name__}: {exc}"]
    if args.json:
        doc: dict[str, Any] = {"core": __version__, "plugin_api": _api_version(), "plugins": rows}
        doc["auto"] = {"accelerator": auto["name"] if auto else None}
        if choices is not None:
            doc["selected"] = {
                c: (e if isinstance(e, str) else {"name": e.name, "distribution": e.distribution, "version": e.version})
                for c, e in selected.items()
            }
            doc["error"] = str(error) if error else None
        json.dump(doc, sys.stdout, indent=2, default=str)
        print()
        if error:
            print(f"error: {error}", file=sys.stderr)
        return 2 if error else 1 if registry.duplicates() else 0
    if not rows:
        print("No plinth plugins are installed.")
        print(f"plinth needs at least an accelerator, a backend and a model plugin: {install_hint()}.")
        print("From a checkout, `make setup` installs all of them.")
        if error:
            raise error
        return 0
    headers = ("CATEGORY", "NAME", "DISTRIBUTION", "VERSION", "STATUS", "DETAILS")
    table = [(r["category"], r["name"], r["distribution"], r["version"], r["status"], _details(r)) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *table)]
    widths[-1] = 0
    for line in (headers, *table):
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())
    for dup in registry.duplicates():
        print(f"error: {dup}", file=sys.stderr)
    if registry.entries["accelerator"]:
        print(
            f"\n--device auto chooses: {auto['name']} ({auto['distribution']} {auto['version']})"
            if auto
            else "\n--device auto chooses: nothing (no accelerator is usable here)"
        )
    missing = [c for c in ("accelerator", "backend", "model") if not registry.entries[c]]
    if missing:
        print(f"\nno {', '.join(missing)} plugin installed: {install_hint()}.")
    if error:
        raise error
    if choices is not None:
        print("\nselected (as `platform serve` would choose):")
        for category, entry in selected.items():
            print(f"  {category:<13} {entry if isinstance(entry, str) else entry.label()}")
    return 1 if registry.duplicates() else 0


def add_plugins_subcommands(plugins: argparse.ArgumentParser) -> None:
    """`platform plugins new` and `platform plugins check` (`platform plugins` alone lists)."""
    from plinth.scaffold import KINDS

    sub = plugins.add_subparsers(dest="plugins_command", metavar="{new,check}")
    new = sub.add_parser(
        "new", help="write a new plugin distribution to fill in", description="Write plinth-plugin-NAME: a complete, "
        "installable plugin of CATEGORY whose contract methods raise NotImplementedError until you write them.",
    )  # fmt: skip
    new.add_argument("category", choices=tuple(KINDS))
    new.add_argument("name", help="the plugin's name (--device NAME, --backend NAME, ...)")
    new.add_argument("--dir", default=None, metavar="PATH", help="the folder to write (default: ./plinth-plugin-NAME)")
    new.set_defaults(_run=cmd_plugins_new)
    check = sub.add_parser(
        "check", help="run the conformance kit on an installed plugin and print a report to publish",
        description="Run the conformance kit for the plugin's categories on this machine (it installs nothing) and "
        "print what passed, failed and was skipped, with why; exit 1 on any failure.",
    )  # fmt: skip
    check.add_argument("plugin", metavar="PATH_OR_NAME", help="a plugin's source folder (installed), its distribution or its name")
    check.add_argument("--json", action="store_true", help="the report as JSON")
    check.add_argument(
        "--device", default=CATEGORY_OPTIONS["accelerator"][1], help="the accelerator the checks compute on (default: %(default)s)"
    )
    check.add_argument(
        "--dtype", action="append", default=None, metavar="DTYPE",
        help="a dtype to check (repeat or comma-separate; default: every dtype the accelerator offers)",
    )  # fmt: skip
    check.add_argument("--model", default=None, metavar="PATH", help="model loaders: the checkpoint to build (default: a tiny random one)")
    check.add_argument("--config", default=None, metavar="JSON", help="KV connectors: their config; proposers: their options")
    check.set_defaults(_run=cmd_plugins_check)


def cmd_plugins_new(args: argparse.Namespace, registry: PluginRegistry) -> int:
    from plinth.scaffold import generate

    files = generate(args.category, args.name, args.dir)
    root = files[0].parent
    print(f"wrote {root} ({len(files)} files). Next:")
    print(f"  pip install -e {root}\n  platform plugins\n  platform plugins check {root}")
    return 0


def cmd_plugins_check(args: argparse.Namespace, registry: PluginRegistry) -> int:
    from plinth.testing.certify import certify

    dtypes = [d.strip() for text in args.dtype or () for d in text.split(",") if d.strip()] or None
    command = ["platform", "plugins", "check", args.plugin] + (["--device", args.device] if args.device != "auto" else [])
    command += [f"--dtype={d}" for d in dtypes or ()] + ([f"--model={args.model}"] if args.model else [])
    command += [f"--config={args.config}"] if args.config else []
    report = certify(
        args.plugin, device=args.device, dtypes=dtypes, model=args.model, config=_json_option(args, "config"),
        command=shlex.join(command),
    )  # fmt: skip
    if args.json:
        json.dump(report.as_dict(), sys.stdout, indent=2)
        print()
    else:
        print(report.text())
    return 0 if report.passed else 1


def _api_version() -> str:
    from plinth.api import PLUGIN_API_VERSION

    return PLUGIN_API_VERSION


# ---------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------

#: subcommand name -> (module, function name, help); each module is imported
#: only when its subcommand runs, so `platform --help` stays fast.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {}


def register_subcommand(name: str, module: str, func: str, help: str) -> None:
    SUBCOMMANDS[name] = (module, func, help)


register_subcommand("generate", "plinth.cli_engine", "generate", "generate text offline with the engine")
register_subcommand("serve", "plinth.cli_engine", "serve", "serve the OpenAI- and Anthropic-compatible HTTP API")
register_subcommand(
    "proxy", "plinth.server.proxy", "proxy", "prefill/decode disaggregation: a proxy in front of --role prefill and --role decode servers"
)
register_subcommand(
    "router", "plinth.server.router", "router",
    "one OpenAI/Anthropic front over N replicas, routed by prefix-cache affinity (their KV events), KV-cache use and queue depth",
)  # fmt: skip
register_subcommand("bench", "plinth.cli_engine", "bench", "benchmarks: `bench offline` (engine), `bench serve` (HTTP), `bench a2a` (MoE all-to-all)")


def build_parser(registry: PluginRegistry) -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="platform",
        description="plinth: LLM inference and serving, a minimal core plus plugins.",
    )
    parser.add_argument("--version", action="version", version=f"plinth-core {__version__}")
    parser.add_argument("--plugins-allow", default=None, help=f"only these plugins (comma-separated; env {ALLOW_ENV})")
    parser.add_argument("--plugins-block", default=None, help=f"never these plugins (comma-separated; env {BLOCK_ENV})")
    parser.add_argument("--log-level", default=os.environ.get("PLINTH_LOG_LEVEL", "INFO"))
    # the same global options are accepted after the subcommand too
    # (`platform serve --plugins-block cuda`); _pre_parse reads them from anywhere
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("plugin lists and logging (also accepted before the command)")
    g.add_argument("--plugins-allow", default=argparse.SUPPRESS, help=f"only these plugins (comma-separated; env {ALLOW_ENV})")
    g.add_argument("--plugins-block", default=argparse.SUPPRESS, help=f"never these plugins (comma-separated; env {BLOCK_ENV})")
    g.add_argument("--log-level", default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("plugins", parents=[common], help="list installed plugins and whether each can run here")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--check",
        action="store_true",
        help="also resolve the plugin choices as `platform serve` would and fail (exit 2) with every "
        "candidate's reasons if one cannot be used; naming a plugin below implies --check",
    )
    for category, (flag, default) in CATEGORY_OPTIONS.items():
        p.add_argument(
            flag,
            default=None,
            metavar=_choices(registry, category, default == "auto"),
            help=f"the {category.replace('_', ' ')} plugin to check (default: {default or 'none'})",
        )
    p.set_defaults(_run=cmd_plugins)
    add_plugins_subcommands(p)
    for name, (module, func, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        sp = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        getattr(mod, f"add_{func}_arguments")(sp, registry)
        sp.set_defaults(_run=lambda a, r, m=mod, f=func: getattr(m, f)(a, r))
    return parser


def _pre_parse(argv: Sequence[str]) -> argparse.Namespace:
    """Read the allow/block lists before discovery (they decide what loads)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plugins-allow", default=None)
    pre.add_argument("--plugins-block", default=None)
    pre.add_argument("--log-level", default=os.environ.get("PLINTH_LOG_LEVEL", "INFO"))
    flag, default = CATEGORY_OPTIONS["accelerator"]
    pre.add_argument(flag, dest="device", default=default)
    known, _ = pre.parse_known_args(argv)
    return known


def set_process_env(registry: PluginRegistry, device: str) -> dict[str, str]:
    """Set the accelerators' ``process_env`` defaults the user has not set
    (``AcceleratorDescriptor``: for ``device``, or every installed one with
    ``auto``, the highest priority first); returns what was set. Runs before
    anything imports torch, which reads them once."""
    entries = [e for e in registry.entries["accelerator"] if device == "auto" or e.name == device]
    done: dict[str, str] = {}
    for entry in sorted(entries, key=lambda e: -e.descriptor.priority):
        if not isinstance(entry.descriptor, AcceleratorDescriptor):
            continue
        for name, value in entry.descriptor.process_env:
            if name not in os.environ:
                os.environ[name] = done[name] = value
    return done


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = _pre_parse(argv)
    logging.basicConfig(
        level=getattr(logging, str(pre.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    registry = PluginRegistry.discover(allow=pre.plugins_allow, block=pre.plugins_block)
    set_process_env(registry, pre.device)
    parser = build_parser(registry)
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace, PluginRegistry], int] | None = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 0
    try:
        return int(run(args, registry) or 0)
    except BrokenPipeError:
        # the reader went away (`platform plugins --json | head -1`): exit
        # quietly, and keep Python from complaining again when it flushes stdout
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except PlinthError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
