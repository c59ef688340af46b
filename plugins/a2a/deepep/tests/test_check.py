"""check() judges the planned layout (``ctx.layout``) without importing
deep_ep: every upstream limit is refused with its number, deepep is chosen
with the fake installed on a planned SM90 layout, and choosing it by name
on this machine fails with its reasons before any model loads."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from plinth.api import PlannedLayout, PluginError, SelectionContext
from plinth.testing import discover_all
from plinth_plugin_deepep.a2a import LEGACY_RANKS, LOW_LATENCY_HIDDEN, DeepEPAllToAll

FAKE = str(pathlib.Path(__file__).parent / "fake")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine: check() may pass")


def plan(**kw) -> PlannedLayout:
    base = dict(world=8, dp=8, ep=8, local_world=8, device_type="cuda", capability="sm_90", hidden_size=4096,
                num_experts=64, top_k=8, max_tokens_per_step=2048, max_num_seqs=128)  # fmt: skip
    return PlannedLayout(**{**base, **kw})


def check(options=None, **kw) -> list[str]:
    return DeepEPAllToAll.check(SelectionContext(ep=kw.get("ep", 8), options=dict(options or {}), layout=plan(**kw)))


@pytest.fixture
def fake_installed(monkeypatch):
    monkeypatch.syspath_prepend(FAKE)
    sys.modules.pop("deep_ep", None)
    yield
    assert "deep_ep" not in sys.modules  # check() never imports it


def test_chosen_with_the_fake_on_a_planned_sm90_layout(fake_installed):
    assert check() == []
    assert check({"deepep_generation": "legacy"}) == []
    assert check({"deepep_generation": "legacy", "deepep_low_latency": "on"}) == []


@no_gpu
def test_every_reason_on_a_cpu_machine():
    reasons = DeepEPAllToAll.check(SelectionContext(ep=2, layout=plan(world=2, dp=2, ep=2, device_type="cpu", capability="")))
    text = "; ".join(reasons)
    assert "deep_ep is not installed" in text and "needs CUDA SM90+ (the planned device is cpu)" in text
    assert "world is not set up" not in text  # judged before any group exists
    assert "deep_ep" not in sys.modules


def test_each_upstream_limit_is_refused_with_its_number(fake_installed, monkeypatch):
    assert any("sm_80" in r for r in check(capability="sm_80"))
    legacy = {"deepep_generation": "legacy"}
    assert any("not 3" in r and str(LEGACY_RANKS[:2]).rstrip(")") in r for r in check(legacy, world=3, dp=3, ep=3, num_experts=63))
    assert any("multiple of 8 NVLink peers" in r for r in check(legacy, world=12, dp=12, ep=12, num_experts=48))  # 12 is not in the map either
    assert any("1024" in r for r in check(legacy, num_experts=8 * 1032))
    assert any("do not split over ep 8" in r for r in check(num_experts=60))
    assert any("16 bytes" in r for r in check(hidden_size=1001))
    ll = {"deepep_generation": "legacy", "deepep_low_latency": "on"}
    assert any(str(LOW_LATENCY_HIDDEN) in r and "not 1024" in r for r in check(ll, hidden_size=1024))
    assert any("top-k <= 11" in r and "not 12" in r for r in check(ll, top_k=12))
    assert any("NVSHMEM_QP_DEPTH 1024 < 2 x (max tokens per rank 512 + 1) = 1026" in r for r in check(ll, max_num_seqs=512))
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "2048")
    assert check(ll, max_num_seqs=512) == []
    assert check({"deepep_generation": "legacy"}, hidden_size=1024) == []  # auto: decode takes the normal kernels
    assert any("deepep_fp8 is not offered" in r for r in check({"deepep_fp8": True}))
    assert any("must be auto, legacy or v2" in r for r in check({"deepep_generation": "v3"}))
    assert any("must be auto, on or off" in r for r in check({"deepep_low_latency": "sometimes"}))


@no_gpu
def test_start_up_with_a2a_deepep_fails_with_its_reasons_before_any_model_loads():
    from plinth import LLM

    with pytest.raises(PluginError) as err:  # the model path does not exist: nothing was located or loaded
        LLM("/nonexistent/model", ep=2, a2a="deepep", device="cpu")
    assert "deep_ep is not installed" in str(err.value) and "needs CUDA SM90+" in str(err.value)


def test_platform_plugins_answers_without_a_plan():
    reasons = discover_all().get("a2a", "deepep").evaluate(SelectionContext())
    assert all("planned" not in r for r in reasons)
