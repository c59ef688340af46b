"""check() gives every reason deepep cannot run here, without importing
deep_ep, and choosing it by name fails with those reasons."""

from __future__ import annotations

import sys

import pytest
import torch
from plinth.api import PluginError, SelectionContext
from plinth.testing import discover_all
from plinth_plugin_deepep.a2a import LEGACY_RANKS, DeepEPAllToAll

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine: check() may pass")


@no_gpu
def test_every_reason_on_a_cpu_machine():
    reasons = DeepEPAllToAll.check(SelectionContext(ep=2))
    text = "; ".join(reasons)
    assert "deep_ep is not installed" in text and "needs CUDA SM90+" in text
    assert "world is not set up" in text
    assert "deep_ep" not in sys.modules


def test_options_are_checked():
    reasons = DeepEPAllToAll.check(SelectionContext(ep=3, options={"deepep_generation": "legacy"}))
    assert any("not 3" in r and str(LEGACY_RANKS[:2]).rstrip(")") in r for r in reasons)
    assert any("must be auto, legacy or v2" in r for r in DeepEPAllToAll.check(SelectionContext(options={"deepep_generation": "v3"})))


@no_gpu
def test_choosing_deepep_fails_with_its_reasons():
    registry = discover_all()
    with pytest.raises(PluginError) as err:
        registry.select("a2a", "deepep", SelectionContext(ep=2))
    assert "deep_ep is not installed" in str(err.value) and "needs CUDA SM90+" in str(err.value)


@no_gpu
def test_start_up_with_a2a_deepep_fails_with_its_reasons_before_any_model_loads():
    from plinth import LLM

    with pytest.raises(PluginError) as err:  # the model path does not exist: nothing was located or loaded
        LLM("/nonexistent/model", ep=2, a2a="deepep")
    assert "deep_ep is not installed" in str(err.value) and "needs CUDA SM90+" in str(err.value)
