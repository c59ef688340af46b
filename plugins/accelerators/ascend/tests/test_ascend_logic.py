"""The plugin's logic on a simulated Ascend stack: stand-in torch_npu and
dlinfer packages on sys.path (so find_spec finds them), a stand-in torch.npu
and device nodes, so that every code path runs without an NPU."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from plinth.api import SelectionContext
from plinth_plugin_ascend import accelerator as mod
from plinth_plugin_ascend.accelerator import AscendAccelerator


def test_reasons_on_a_machine_without_the_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mod, "_device_nodes", lambda: [])
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    reasons = AscendAccelerator.check(SelectionContext())
    assert "torch_npu is not installed" in reasons
    assert "dlinfer is not installed (pip install dlinfer-ascend)" in reasons
    assert "no Ascend NPU is visible (no /dev/davinci<N> device)" in reasons
    assert "torch_npu" not in sys.modules and "dlinfer" not in sys.modules


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list:
    """torch_npu and dlinfer importable, two NPUs present."""
    calls: list = []
    for pkg in ("torch_npu", "dlinfer"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("npu = __import__('types').SimpleNamespace(get_soc_version=lambda: 223)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for pkg in ("torch_npu", "dlinfer"):
        monkeypatch.delitem(sys.modules, pkg, raising=False)
    monkeypatch.setattr(mod, "_device_nodes", lambda: ["/dev/davinci0", "/dev/davinci1"])
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    npu = types.SimpleNamespace(
        device_count=lambda: 2,
        get_device_name=lambda i=0: "Ascend910B3",
        is_bf16_supported=lambda: True,
        mem_get_info=lambda i=0: (50 << 30, 64 << 30),
        set_device=calls.append,
        synchronize=lambda: calls.append("sync"),
    )
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    yield calls
    for pkg in ("torch_npu", "dlinfer"):
        sys.modules.pop(pkg, None)


def test_available_with_the_stack(stack: list) -> None:
    assert AscendAccelerator.check(SelectionContext()) == []


def test_empty_visible_devices_hides_every_npu(stack: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    assert AscendAccelerator.check(SelectionContext()) == ["ASCEND_RT_VISIBLE_DEVICES is empty, which hides every NPU"]


def test_info_memory_init(stack: list) -> None:
    acc = AscendAccelerator()
    info = acc.info()
    assert (info.device_type, info.dist_backend, info.device_count) == ("npu", "hccl", 2)
    assert (info.device_name, info.capability, info.fp8) == ("Ascend910B3", "soc_223", "weight_only")
    assert info.dtypes == ("bfloat16", "float16", "float32") and info.default_dtype == "bfloat16"
    assert info.preferred_backends == ("dlinfer", "torch") and info.memory_total == 64 << 30
    assert acc.memory(0) == (50 << 30, 64 << 30)
    acc.init_process(local_rank=1, options={})
    acc.synchronize()
    assert stack == [1, "sync"]
    with pytest.raises(RuntimeError, match="local rank 5 needs NPU 5"):
        acc.init_process(local_rank=5, options={})


def test_device_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("davinci0", "davinci12", "davinci_manager", "davinci3x"):
        (tmp_path / name).touch()
    monkeypatch.setattr(mod, "DEV", str(tmp_path))
    assert mod._device_nodes() == [str(tmp_path / "davinci0"), str(tmp_path / "davinci12")]
