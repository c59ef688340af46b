"""The plugin's logic on a simulated XPU runtime (torch.xpu functions
replaced), so that every code path runs without an Intel GPU."""

from __future__ import annotations

import types

import pytest
import torch
from plinth.api import SelectionContext
from plinth_plugin_xpu import accelerator as mod
from plinth_plugin_xpu.accelerator import XPUAccelerator


@pytest.mark.parametrize(
    "version, without",
    [("2.13.0+cpu", True), ("2.8.0+cu128", True), ("2.9.0+rocm6.4", True), ("2.8.0+xpu", False), ("2.8.0", False), ("", False)],
)
def test_build_label(version: str, without: bool) -> None:
    assert mod._built_without_xpu(version) is without


@pytest.fixture
def xpu_build(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(mod, "_torch_version", lambda: "2.13.0+xpu")
    monkeypatch.setattr(torch.xpu, "_is_compiled", lambda: True)
    return monkeypatch


def test_reasons(monkeypatch: pytest.MonkeyPatch, xpu_build: pytest.MonkeyPatch) -> None:
    xpu_build.setattr(torch.xpu, "device_count", lambda: 0)
    assert XPUAccelerator.check(SelectionContext()) == ["no XPU device is visible"]
    xpu_build.setattr(torch.xpu, "_is_compiled", lambda: False)
    assert XPUAccelerator.check(SelectionContext()) == [f"torch was built without XPU support (torch {torch.__version__})"]


def test_info_memory_init(xpu_build: pytest.MonkeyPatch) -> None:
    calls = []
    props = types.SimpleNamespace(name="Intel(R) Data Center GPU Max 1550", total_memory=64 << 30, has_fp16=True, architecture=12)
    xpu_build.setattr(torch.xpu, "device_count", lambda: 2)
    xpu_build.setattr(torch.xpu, "get_device_properties", lambda i=0: props)
    xpu_build.setattr(torch.xpu, "is_bf16_supported", lambda *a, **k: True)
    xpu_build.setattr(torch.xpu, "mem_get_info", lambda i=0: (60 << 30, 64 << 30))
    xpu_build.setattr(torch.xpu, "set_device", calls.append)
    xpu_build.setattr(torch.xpu, "synchronize", lambda: calls.append("sync"))
    assert XPUAccelerator.check(SelectionContext()) == []
    acc = XPUAccelerator()
    info = acc.info()
    assert (info.device_type, info.dist_backend, info.device_count) == ("xpu", "xccl", 2)
    assert (info.device_name, info.capability, info.fp8) == (props.name, "arch_12", "weight_only")
    assert info.dtypes == ("bfloat16", "float16", "float32") and info.preferred_backends == ("triton", "torch")
    assert acc.memory(0) == (60 << 30, 64 << 30)
    acc.init_process(local_rank=1, options={})
    acc.synchronize()
    assert calls == [1, "sync"]
    with pytest.raises(RuntimeError, match="local rank 3 needs XPU 3"):
        acc.init_process(local_rank=3, options={})
