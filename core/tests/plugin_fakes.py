"""Helpers for the unit tests of plinth.plugins: in-memory plugin modules.

The registry is built with the same ``_register`` / ``_collect`` steps that
``PluginRegistry.discover`` runs after importing entry points, so selection,
validation and reporting are the real code; only the import of installed
distributions is skipped (tests/test_plugins_install.py covers that with real
installs).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable
from typing import Any

from plinth.api import Accelerator, AcceleratorDescriptor, AcceleratorInfo, hookimpl
from plinth.plugins import EntryPointInfo, PluginRegistry

IMPL_MODULE = "plinth_unit_fake_impls"


def impl_module() -> types.ModuleType:
    """A module (in sys.modules) holding implementation classes for descriptors."""
    mod = sys.modules.get(IMPL_MODULE)
    if mod is None:
        mod = types.ModuleType(IMPL_MODULE)
        sys.modules[IMPL_MODULE] = mod
    return mod


def make_accelerator(name: str, reasons: Iterable[str] = (), *, raises: Exception | None = None) -> str:
    """Define an Accelerator subclass whose check() returns ``reasons`` (or
    raises); returns its ``module:attr`` path."""
    reasons = list(reasons)

    class Fake(Accelerator):
        device_type = "cpu"
        dist_backend = "gloo"

        @classmethod
        def check(cls, ctx: Any) -> list[str]:
            if raises is not None:
                raise raises
            return list(reasons)

        def info(self) -> AcceleratorInfo:
            return AcceleratorInfo("cpu", "gloo", 1, dtypes=("float32",), default_dtype="float32")

        def memory(self, index: int = 0) -> tuple[int, int]:
            return 1 << 30, 1 << 30

    attr = f"Acc_{name}"
    Fake.__name__ = attr
    setattr(impl_module(), attr, Fake)
    return f"{IMPL_MODULE}:{attr}"


def plugin_module(name: str, *descriptors: Any, **hooks: Any) -> types.ModuleType:
    """An entry-point module registering ``descriptors`` (accelerators), plus
    any extra hook functions given by name."""
    mod = types.ModuleType(f"plinth_unit_plugin_{name}")
    if descriptors:

        @hookimpl
        def plinth_register_accelerators():
            return list(descriptors)

        mod.plinth_register_accelerators = plinth_register_accelerators
    for hook_name, fn in hooks.items():
        setattr(mod, hook_name, fn)
    return mod


def accel(name: str, reasons: Iterable[str] = (), **kw: Any) -> AcceleratorDescriptor:
    raises = kw.pop("raises", None)
    kw.setdefault("description", f"fake {name}")
    return AcceleratorDescriptor(name=name, impl=kw.pop("impl", None) or make_accelerator(name, reasons, raises=raises), **kw)


def registry_of(*plugins: tuple[str, str, types.ModuleType], allow: Iterable[str] = (), block: Iterable[str] = ()) -> PluginRegistry:
    """plugins: (distribution, version, entry-point module)."""
    reg = PluginRegistry()
    for dist, version, module in plugins:
        info = EntryPointInfo(module.__name__.rsplit("_", 1)[-1], module.__name__, dist, version)
        info.module = module
        reg.entry_points.append(info)
        reg._register(info)
    reg._collect(list(allow), list(block))
    return reg
