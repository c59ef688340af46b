"""pytest base classes: subclass one in a plugin's tests and set ``name``.

    # plugins/accelerators/npu/tests/test_conformance.py
    from plinth.testing import AcceleratorConformance

    class TestConformance(AcceleratorConformance):
        name = "npu"

pytest collects only classes named ``Test*``, so these bases are never
collected themselves. They do not import pytest until a test runs, and the
functions they call (``check_registration``, ``check_accelerator``, ...) work
without pytest too.
"""

from __future__ import annotations

from typing import Any, ClassVar

from plinth.testing.a2a import check_a2a
from plinth.testing.accelerator import check_accelerator
from plinth.testing.backend import check_backend
from plinth.testing.kv_connector import check_kv_connector
from plinth.testing.model import check_model_loader
from plinth.testing.parsers import check_reasoning_parser, check_tool_parser
from plinth.testing.proposer import check_proposer
from plinth.testing.registration import check_cheap_import, check_registration, discover_all


class PluginConformance:
    """Checks every plugin passes, whatever its category.

    category:     the plinth category ("accelerator", "backend", "model", "a2a",
                  "kv_connector", "proposer", "tool_parser",
                  "reasoning_parser"); set by the category's subclass.
    name:         the name the plugin registers (``--device npu`` -> "npu").
    distribution: the distribution to check; default: the one that registers
                  ``name`` in ``category``.
    naming:       check the naming rule (``plinth-plugin-<name>``); set False
                  for a distribution named otherwise.
    """

    category: ClassVar[str] = ""
    name: ClassVar[str] = ""
    distribution: ClassVar[str | None] = None
    naming: ClassVar[bool] = True

    def plugin_distribution(self) -> str:
        if self.distribution:
            return self.distribution
        assert self.category and self.name, f"{type(self).__name__}: set `name` (and `category`)"
        return discover_all().get(self.category, self.name).distribution

    def test_registration(self) -> None:
        """Entry point loads through discovery; descriptors valid; impl imports."""
        check_registration(self.plugin_distribution(), naming=self.naming, cheap_import=False)

    def test_entry_point_is_cheap(self) -> None:
        """Importing the entry point imports no torch/vendor SDK; check() no vendor SDK."""
        check_cheap_import(self.plugin_distribution())


class AcceleratorConformance(PluginConformance):
    """The registration checks plus the accelerator checks.

    require_available: True makes the device checks fail (not skip) when the
    accelerator is unavailable; None (default) requires it only when its name
    is in $PLINTH_REQUIRE_ACCELERATORS.
    """

    category: ClassVar[str] = "accelerator"
    require_available: ClassVar[bool | None] = None

    def test_check_answers(self) -> None:
        """check() answers with reasons; the class names device type and backend."""
        check_accelerator(self.name, device=False, require_available=False)

    def test_device(self) -> None:
        """info(), memory(), init_process(), device(), round trips (when available)."""
        report = check_accelerator(self.name, require_available=self.require_available)
        if not report.available:
            _skip(f"{self.name} is unavailable here: {'; '.join(report.reasons)}")


def _skip(reason: str) -> Any:
    import pytest

    pytest.skip(reason)


class BackendConformance(PluginConformance):
    """The registration checks plus every op the backend provides against
    the reference backend's (float32 and bfloat16 by default), and its
    attention backend against its declarations and the reference's."""

    category: ClassVar[str] = "backend"
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    accelerator: ClassVar[str] = "auto"
    #: the page sizes attention is checked at, and whether with a sliding
    #: window (None: what its attention backend declares)
    page_sizes: ClassVar[tuple[int, ...] | None] = None
    sliding_window: ClassVar[bool | None] = None

    def test_ops_match_the_reference(self) -> None:
        report = check_backend(
            self.name, dtypes=self.dtypes, accelerator=self.accelerator, page_sizes=self.page_sizes,
            sliding_window=self.sliding_window,
        )
        if not report.passed and report.skipped:
            _skip("; ".join(report.skipped))


class A2AConformance(PluginConformance):
    """The registration checks plus dispatch/combine round trips on real
    processes (``worlds``: the group sizes), both layouts, uneven and empty
    sends, experts with no tokens, float8 as bytes, and expert counts the
    group does not divide (``uneven_experts``; off only for a plugin whose
    library cannot split so, as DeepEP's kernels assert E % ranks == 0)."""

    category: ClassVar[str] = "a2a"
    worlds: ClassVar[tuple[int, ...]] = (2, 4)
    uneven_experts: ClassVar[bool] = True

    def test_dispatch_combine_round_trips(self) -> None:
        report = check_a2a(self.name, worlds=self.worlds, uneven=self.uneven_experts)
        if not report.passed and report.skipped:
            _skip("; ".join(report.skipped))


class KVConnectorConformance(PluginConformance):
    """The registration checks plus the KV-connector round trips. Override
    ``connector_config`` to point the plugin at a store (a fixture's)."""

    category: ClassVar[str] = "kv_connector"
    deadline_s: ClassVar[float] = 0.5

    def connector_config(self) -> dict[str, Any]:
        return {}

    def test_round_trips_and_faults(self) -> None:
        """save/lookup/load; corrupt, truncated, foreign values missed; a store that raises or stalls never stalls."""
        check_kv_connector(self.name, config=self.connector_config(), deadline_s=self.deadline_s)


class ModelLoaderConformance(PluginConformance):
    """The registration checks plus a model built from ``model_path()`` (a
    tiny checkpoint of an architecture the loader names) computing through
    the paged KV cache: chunked prefill and decode give the whole prefill's
    logits. ``tokenizer = False`` for a checkpoint without one."""

    category: ClassVar[str] = "model"
    tokenizer: ClassVar[bool] = True

    def model_path(self) -> str:
        raise NotImplementedError(f"{type(self).__name__}: return a checkpoint path from model_path()")

    def test_builds_and_computes_a_model(self) -> None:
        check_model_loader(self.name, self.model_path(), tokenizer=self.tokenizer)


class ProposerConformance(PluginConformance):
    """The registration checks plus proposals from a proposer built with a
    ``ProposerContext`` (fake draft runner and tokenizers)."""

    category: ClassVar[str] = "proposer"
    options: ClassVar[dict[str, Any]] = {}

    def test_proposals(self) -> None:
        check_proposer(self.name, options=dict(self.options))


class ToolParserConformance(PluginConformance):
    """The registration checks plus the tool-parser promises on ``samples``
    (outputs in the parser's format, each with a well-formed call; default:
    the parser class's ``examples``)."""

    category: ClassVar[str] = "tool_parser"
    samples: ClassVar[tuple[str, ...]] = ()

    def test_parses_whole_and_streamed(self) -> None:
        check_tool_parser(self.name, self.samples or None)


class ReasoningParserConformance(PluginConformance):
    """The registration checks plus the reasoning-parser promises on
    ``samples``: (prompt, output) pairs with reasoning (default: the parser
    class's ``examples``)."""

    category: ClassVar[str] = "reasoning_parser"
    samples: ClassVar[tuple[tuple[str, str], ...]] = ()

    def test_parses_whole_and_streamed(self) -> None:
        check_reasoning_parser(self.name, self.samples or None)
