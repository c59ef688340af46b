"""Accelerator checks: does an accelerator plugin answer the contract?

Unavailable here: ``check()`` must say why, as non-empty strings, and the
class must still name its torch device type and distributed backend.
Available here: ``info()``, ``memory()``, ``init_process()``, ``device()`` and
``synchronize()`` must work and agree with each other, and a tensor must make
the round trip host -> device -> host unchanged in every dtype it claims.
"""

from __future__ import annotations

import os
from typing import Any

from plinth.api import Accelerator, AcceleratorInfo, SelectionContext
from plinth.engine.config import CacheConfig
from plinth.errors import PluginError
from plinth.plugins import PluginRegistry
from plinth.testing._report import Report
from plinth.testing.registration import discover_all

#: the share of memory the kit asks a budget for: what an engine asks by default
DEFAULT_UTILIZATION = CacheConfig().gpu_memory_utilization

#: Comma-separated accelerator names that must be available (a GPU CI runner
#: sets PLINTH_REQUIRE_ACCELERATORS=cuda): their device checks fail instead of
#: being skipped when the accelerator is unavailable.
REQUIRE_ENV = "PLINTH_REQUIRE_ACCELERATORS"
FP8_MODES = ("native", "weight_only", "none")


def required_here(name: str) -> bool:
    return name in {n.strip() for n in os.environ.get(REQUIRE_ENV, "").split(",") if n.strip()}


class AcceleratorReport(Report):
    """A ``Report`` that also says whether the accelerator is available here."""

    def __init__(self, subject: str) -> None:
        super().__init__(subject)
        self.available: bool | None = None
        self.reasons: list[str] = []
        self.info: AcceleratorInfo | None = None


def check_accelerator(
    name: str,
    *,
    device: bool = True,
    require_available: bool | None = None,
    ctx: SelectionContext | None = None,
    registry: PluginRegistry | None = None,
    raise_on_problem: bool = True,
) -> AcceleratorReport:
    """Check the installed accelerator plugin registered as ``name``.

    Always: it is found by the real discovery (exactly one distribution
    registers the name), its class names a ``device_type`` and a
    ``dist_backend``, and ``check(ctx)`` returns a list of non-empty strings.
    The report also lists the descriptor's ``process_env`` (what the CLI
    sets before torch loads; the descriptor checked it when it was built).

    When available (and ``device``): ``info()`` is an ``AcceleratorInfo`` that
    agrees with the class, counts at least one device, lists its dtypes (torch
    names) with the default among them and a known FP8 mode;
    ``init_process(local_rank=0, options={})`` runs; ``memory(0)`` is
    ``(free, total)`` with ``0 < free <= total`` and ``kv_cache_budget``
    gives a positive byte count within ``free``; ``device(0)`` has the
    declared type; a tensor of each dtype round-trips to it and back, and a
    small computation on it is right; ``supported_dtypes()`` and
    ``default_dtype()`` agree with ``info()``; the distributed backend is
    known to torch.distributed (where torch can say).

    ``require_available``: True fails when it is unavailable; None (default)
    requires it only when its name is in $PLINTH_REQUIRE_ACCELERATORS.
    Returns the report (``report.available``, ``report.reasons``); raises
    ``ConformanceError`` on problems unless ``raise_on_problem=False``.
    """
    report = AcceleratorReport(f"accelerator {name}")
    registry = registry or discover_all()
    try:
        entry = registry.get("accelerator", name)
        cls = entry.load()
    except PluginError as exc:
        report.problem(str(exc))
        return report.raise_for_problems() if raise_on_problem else report  # type: ignore[return-value]
    report.ok(f"registered by {entry.distribution} {entry.version}; impl {entry.descriptor.impl}")
    # valid by construction (AcceleratorDescriptor checks it); shown so a vendor sees what the CLI sets
    process_env = getattr(entry.descriptor, "process_env", ())
    report.ok(f"process_env: {', '.join(f'{n}={v}' for n, v in process_env) or 'none'}")
    report.expect(issubclass(cls, Accelerator), "subclasses plinth.api.Accelerator")
    report.expect(
        isinstance(cls.device_type, str) and bool(cls.device_type),
        "class names its torch device type (device_type)",
        repr(cls.device_type),
    )
    report.expect(
        isinstance(cls.dist_backend, str) and bool(cls.dist_backend),
        "class names its torch.distributed backend (dist_backend)",
        repr(cls.dist_backend),
    )
    try:
        reasons = cls.check(ctx or SelectionContext())
    except Exception as exc:
        report.problem(f"check() raised {type(exc).__name__}: {exc}")
        return report.raise_for_problems() if raise_on_problem else report  # type: ignore[return-value]
    if not report.expect(
        isinstance(reasons, (list, tuple)) and all(isinstance(r, str) and r.strip() for r in reasons),
        "check() returns a list of non-empty reason strings",
        f"returned {reasons!r}",
    ):
        return report.raise_for_problems() if raise_on_problem else report  # type: ignore[return-value]
    report.available, report.reasons = not reasons, list(reasons)
    required = required_here(name) if require_available is None else require_available
    if reasons:
        if required:
            report.problem(f"required to be available here, but: {'; '.join(reasons)}")
        else:
            report.skip(f"device checks: unavailable here: {'; '.join(reasons)}")
    elif device:
        _check_device(report, cls)
    return report.raise_for_problems() if raise_on_problem else report  # type: ignore[return-value]


def _check_device(report: AcceleratorReport, cls: type[Accelerator]) -> None:
    import torch

    acc = cls()
    try:
        info = acc.info()
    except Exception as exc:
        report.problem(f"info() raised {type(exc).__name__}: {exc}")
        return
    if not report.expect(isinstance(info, AcceleratorInfo), "info() returns an AcceleratorInfo", repr(info)):
        return
    report.info = info
    report.expect(info.device_type == cls.device_type, "info().device_type matches the class", f"{info.device_type!r} != {cls.device_type!r}")
    report.expect(info.dist_backend == cls.dist_backend, "info().dist_backend matches the class", f"{info.dist_backend!r} != {cls.dist_backend!r}")
    report.expect(isinstance(info.device_count, int) and info.device_count >= 1, "info().device_count >= 1", repr(info.device_count))
    report.expect(bool(info.dtypes), "info().dtypes is not empty")
    bad = [d for d in info.dtypes if not isinstance(getattr(torch, str(d), None), torch.dtype)]
    report.expect(not bad, "info().dtypes are torch dtype names", f"not torch dtypes: {bad}")
    report.expect(info.default_dtype in info.dtypes, "info().default_dtype is one of info().dtypes", f"{info.default_dtype!r} not in {info.dtypes}")
    report.expect(info.fp8 in FP8_MODES, f"info().fp8 is one of {FP8_MODES}", repr(info.fp8))
    isa = getattr(info, "isa", ())
    report.expect(
        isinstance(isa, tuple) and all(isinstance(f, str) and f for f in isa),
        "info().isa is a tuple of instruction-set names", repr(isa),
    )
    report.expect(
        isinstance(info.preferred_backends, (tuple, list)) and all(isinstance(b, str) and b for b in info.preferred_backends),
        "info().preferred_backends are names",
        repr(info.preferred_backends),
    )
    report.expect(isinstance(info.memory_total, int) and info.memory_total >= 0, "info().memory_total is bytes (int >= 0)", repr(info.memory_total))

    try:
        acc.init_process(local_rank=0, options={})
        report.ok("init_process(local_rank=0, options={}) runs")
    except Exception as exc:
        report.problem(f"init_process(local_rank=0, options={{}}) raised {type(exc).__name__}: {exc}")
        return
    try:
        free, total = acc.memory(0)
        report.expect(
            isinstance(free, int) and isinstance(total, int) and 0 < free <= total,
            "memory(0) is (free, total) bytes with 0 < free <= total",
            f"({free!r}, {total!r})",
        )
        budget = acc.kv_cache_budget(free=free, total=total, weights=0, utilization=DEFAULT_UTILIZATION)
        report.expect(
            isinstance(budget, int) and 0 < budget <= free,
            "kv_cache_budget(free, total, weights=0, utilization) is bytes within what is free",
            repr(budget),
        )
    except Exception as exc:
        report.problem(f"memory(0)/kv_cache_budget() raised {type(exc).__name__}: {exc}")

    try:
        dev = acc.device(0)
    except Exception as exc:
        report.problem(f"device(0) raised {type(exc).__name__}: {exc}")
        return
    if not report.expect(isinstance(dev, torch.device) and dev.type == cls.device_type, "device(0) is a torch.device of device_type", repr(dev)):
        return
    for name in info.dtypes:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            continue
        _round_trip(report, acc, dev, dtype)
    try:
        supported = acc.supported_dtypes()
        report.expect(
            list(supported) == [getattr(torch, n) for n in info.dtypes],
            "supported_dtypes() matches info().dtypes",
            repr(supported),
        )
        report.expect(acc.default_dtype() in supported, "default_dtype() is supported", repr(acc.default_dtype()))
    except Exception as exc:
        report.problem(f"supported_dtypes()/default_dtype() raised {type(exc).__name__}: {exc}")
    _check_dist_backend(report, info.dist_backend)


def _round_trip(report: AcceleratorReport, acc: Accelerator, dev: Any, dtype: Any) -> None:
    import torch

    host = torch.arange(-8, 8, dtype=torch.float32).reshape(4, 4).to(dtype)
    try:
        on_device = host.to(dev)
        doubled = on_device * 2 + 1
        acc.synchronize()
        back, back2 = on_device.cpu(), doubled.cpu()
    except Exception as exc:
        report.problem(f"{dtype} tensor round trip to {dev} raised {type(exc).__name__}: {exc}")
        return
    report.expect(
        back.dtype == dtype and torch.equal(back, host) and torch.equal(back2, host * 2 + 1),
        f"a {str(dtype).removeprefix('torch.')} tensor round-trips to {dev} and computes there",
        f"got {back2.tolist()}",
    )


def _check_dist_backend(report: AcceleratorReport, backend: str) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        report.skip(f"dist backend {backend!r}: torch.distributed is not available in this torch build")
        return
    is_available = getattr(dist, "is_backend_available", None)
    if is_available is None:
        report.skip(f"dist backend {backend!r}: this torch cannot say which backends it has")
        return
    report.expect(bool(is_available(backend)), f"torch.distributed knows the backend {backend!r}", "is_backend_available() is False")
