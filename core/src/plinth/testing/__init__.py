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
model          ``check_model_loader``                      ``ModelLoaderConformance``
proposer       ``check_proposer``                          ``ProposerConformance``
tool_parser    ``check_tool_parser``                       ``ToolParserConformance``
reasoning_     ``check_reasoning_parser``                  ``ReasoningParserConformance``
parser
=============  ==========================================  ===========================

A plugin's tests import only these names and ``plinth.api``. Helpers for
tests that go beyond the kit: ``resolve_op_table`` / ``op_table`` (the op
table start-up builds for a backend), ``resolve_attention_backend`` /
``attention_backend`` (its attention backend), ``attention_metadata`` (a step's
metadata for given sequences and pages; ``random_attention_metadata``: their
pages drawn in random order), ``kv_test_layout``,
``kv_value_bytes`` and ``kv_key`` (a KV connector's layout, stored value size
and store keys),
``bundled_model_path`` (the bundled default GGUF, or None),
``save_random_model`` / ``random_prompts`` / ``reference_model`` /
``reference_greedy`` (a tiny random transformers checkpoint and
transformers' float32 answers on it), ``run_ranks``
(a function on N real processes), ``IsolatedEnv`` (a fresh virtual
environment for install tests), ``discover_all`` (the real discovery,
ignoring the shell's allow/block lists), ``Report`` (collect problems, raise
once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plinth.testing._report import ConformanceError, Report
from plinth.testing.a2a import check_a2a
from plinth.testing.accelerator import AcceleratorReport, check_accelerator
from plinth.testing.backend import (
    attention_backend,
    attention_metadata,
    check_backend,
    op_table,
    random_attention_metadata,
    resolve_attention_backend,
    resolve_op_table,
)
from plinth.testing.conformance import (
    A2AConformance,
    AcceleratorConformance,
    BackendConformance,
    KVConnectorConformance,
    ModelLoaderConformance,
    PluginConformance,
    ProposerConformance,
    ReasoningParserConformance,
    ToolParserConformance,
)
from plinth.testing.distributed import run_ranks
from plinth.testing.isolated import IsolatedEnv
from plinth.testing.kv_connector import check_kv_connector, kv_key, kv_test_layout, kv_value_bytes
from plinth.testing.model import bundled_model_path, check_model_loader
from plinth.testing.parsers import check_reasoning_parser, check_tool_parser
from plinth.testing.proposer import FakeDraftRunner, FakeTokenizer, check_proposer
from plinth.testing.registration import (
    FORBIDDEN_AT_CHECK,
    FORBIDDEN_AT_ENTRY_POINT,
    check_cheap_import,
    check_registration,
    discover_all,
)
from plinth.testing.tiny import random_prompts, reference_greedy, reference_model, save_random_model

#: category -> its check function ``(name, ...) -> Report``
CATEGORY_CHECKS: dict[str, Callable[..., Report]] = {
    "a2a": check_a2a,
    "accelerator": check_accelerator,
    "backend": check_backend,
    "kv_connector": check_kv_connector,
    "model": check_model_loader,
    "proposer": check_proposer,
    "tool_parser": check_tool_parser,
    "reasoning_parser": check_reasoning_parser,
}


def check_plugin(category: str, name: str, **kwargs: Any) -> Report:
    """Run the checks of ``category`` on the plugin registered as ``name``."""
    try:
        check = CATEGORY_CHECKS[category]
    except KeyError:
        raise ValueError(f"unknown category {category!r} (categories: {', '.join(CATEGORY_CHECKS)})") from None
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
    "FakeDraftRunner",
    "FakeTokenizer",
    "KVConnectorConformance",
    "ModelLoaderConformance",
    "PluginConformance",
    "ProposerConformance",
    "ReasoningParserConformance",
    "ToolParserConformance",
    "Report",
    "attention_backend",
    "attention_metadata",
    "random_attention_metadata",
    "bundled_model_path",
    "check_a2a",
    "check_accelerator",
    "check_backend",
    "check_cheap_import",
    "check_kv_connector",
    "check_model_loader",
    "check_proposer",
    "check_reasoning_parser",
    "check_tool_parser",
    "check_plugin",
    "check_registration",
    "discover_all",
    "kv_key",
    "kv_test_layout",
    "kv_value_bytes",
    "op_table",
    "random_prompts",
    "reference_greedy",
    "reference_model",
    "resolve_attention_backend",
    "resolve_op_table",
    "run_ranks",
    "save_random_model",
]
