"""plinth.testing: the conformance kit a plugin author runs against a plugin.

Two ways to use it, with the same checks behind both:

* functions, which return a ``Report`` and raise ``ConformanceError`` (an
  ``AssertionError``) listing every problem::

      from plinth.testing import check_registration, check_accelerator
      check_registration("plinth-plugin-npu")      # any category
      check_accelerator("npu")                     # the accelerator contract

* pytest base classes, which a plugin's tests subclass::

      from plinth.testing import AcceleratorConformance

      class TestConformance(AcceleratorConformance):
          name = "npu"

Everything runs against the *installed* distribution through the real
discovery (``plinth.plugins.PluginRegistry.discover``): install the plugin
(``pip install -e .``) before running its tests.

What each category checks:

=============  ==========================================  ===========================
category       function                                    pytest base class
=============  ==========================================  ===========================
(every one)    ``check_registration``, ``check_cheap_import``  ``PluginConformance``
accelerator    ``check_accelerator``                       ``AcceleratorConformance``
backend        ``check_backend``                           ``BackendConformance``
a2a            ``check_a2a``                               ``A2AConformance``
kv_connector   ``check_kv_connector``                      ``KVConnectorConformance``
=============  ==========================================  ===========================

Extension points. A later category adds a module here (``a2a.py``:
dispatch/combine round trips; ``kv_connector.py``: save/lookup/load round
trips, as ``backend.py`` checks ops against the reference backend) with a
``check_<category>(name, ...) -> Report`` function and a
``<Category>Conformance(PluginConformance)`` class, and registers the function
in ``CATEGORY_CHECKS`` below; ``check_plugin`` then dispatches to it.
Shared pieces to reuse: ``Report`` (collect problems, raise once),
``discover_all`` (the real discovery, ignoring the shell's allow/block lists),
``IsolatedEnv`` (a fresh virtual environment for install tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plinth.testing._report import ConformanceError, Report
from plinth.testing.a2a import check_a2a
from plinth.testing.accelerator import AcceleratorReport, check_accelerator
from plinth.testing.backend import check_backend
from plinth.testing.conformance import (
    A2AConformance,
    AcceleratorConformance,
    BackendConformance,
    KVConnectorConformance,
    PluginConformance,
)
from plinth.testing.distributed import run_ranks
from plinth.testing.isolated import IsolatedEnv
from plinth.testing.kv_connector import check_kv_connector
from plinth.testing.registration import (
    FORBIDDEN_AT_CHECK,
    FORBIDDEN_AT_ENTRY_POINT,
    check_cheap_import,
    check_registration,
    discover_all,
)

#: category -> its check function ``(name, **kwargs) -> Report``; later
#: categories add theirs (see the module docstring).
CATEGORY_CHECKS: dict[str, Callable[..., Report]] = {
    "a2a": check_a2a,
    "accelerator": check_accelerator,
    "backend": check_backend,
    "kv_connector": check_kv_connector,
}


def check_plugin(category: str, name: str, **kwargs: Any) -> Report:
    """Run the checks of ``category`` on the plugin registered as ``name``."""
    try:
        check = CATEGORY_CHECKS[category]
    except KeyError:
        raise NotImplementedError(
            f"plinth.testing has no {category} checks yet (it has: {', '.join(CATEGORY_CHECKS)}); "
            "check_registration covers every category"
        ) from None
    return check(name, **kwargs)


__all__ = [
    "CATEGORY_CHECKS",
    "FORBIDDEN_AT_CHECK",
    "FORBIDDEN_AT_ENTRY_POINT",
    "A2AConformance",
    "AcceleratorConformance",
    "AcceleratorReport",
    "BackendConformance",
    "ConformanceError",
    "IsolatedEnv",
    "KVConnectorConformance",
    "PluginConformance",
    "Report",
    "check_a2a",
    "check_accelerator",
    "check_backend",
    "check_cheap_import",
    "check_kv_connector",
    "check_plugin",
    "check_registration",
    "discover_all",
    "run_ranks",
]
