"""The plugin's logic on a simulated torch_xla (a stand-in package on
sys.path with the functions the plugin calls), so that every code path runs
without a TPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from plinth.api import SelectionContext
from plinth_plugin_tpu import accelerator as mod
from plinth_plugin_tpu.accelerator import TPUAccelerator

FAKE = {
    "torch_xla/__init__.py": "CALLS = []\ndef device(index=None):\n    return f'xla:{index or 0}'\ndef sync():\n    CALLS.append('sync')\n",
    "torch_xla/core/__init__.py": "",
    "torch_xla/core/xla_model.py": (
        "import torch_xla\nMEMORY = {'bytes_used': 2 << 30, 'bytes_limit': 16 << 30}\n"
        "def get_memory_info(device):\n    return dict(MEMORY)\n"
        "def wait_device_ops():\n    torch_xla.CALLS.append('wait')\n"
        "def mark_step():\n    torch_xla.CALLS.append('mark_step')\n"
        "def xla_device(n=None):\n    return f'xla:{n or 0}'\n"
    ),
    "torch_xla/runtime.py": "def addressable_device_count():\n    return 4\n",
    "torch_xla/_internal/__init__.py": "",
    "torch_xla/_internal/tpu.py": "def version():\n    return 5\n",
    "torch_xla/distributed/__init__.py": "",
    "torch_xla/distributed/xla_backend.py": "import torch_xla\ntorch_xla.CALLS.append('xla backend registered')\n",
    "libtpu/__init__.py": "",
}


@pytest.fixture
def xla(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for rel, text in FAKE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(mod, "_device_nodes", lambda: ["/dev/vfio/0"])
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    import torch_xla

    yield torch_xla
    for name in [m for m in sys.modules if m.split(".")[0] in ("torch_xla", "libtpu")]:
        del sys.modules[name]


def test_reasons_without_torch_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mod, "_device_nodes", lambda: [])
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert TPUAccelerator.check(SelectionContext()) == [
        "torch_xla is not installed (pip install 'torch_xla[tpu]')",
        "no TPU is visible (no /dev/accel<N> or /dev/vfio/<N> device)",
    ]
    assert "torch_xla" not in sys.modules


def test_available_and_pjrt_device_mismatch(xla, monkeypatch: pytest.MonkeyPatch) -> None:
    assert TPUAccelerator.check(SelectionContext()) == []
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert TPUAccelerator.check(SelectionContext()) == [
        "PJRT_DEVICE=CPU asks torch_xla for another device (unset it or set PJRT_DEVICE=TPU)"
    ]


def test_info_memory_init_sync(xla, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    acc = TPUAccelerator()
    info = acc.info()
    assert (info.device_type, info.dist_backend, info.device_count) == ("xla", "xla", 4)
    assert (info.capability, info.device_name) == ("tpu_v5", "TPU v5 (v5litepod-4)")
    assert info.memory_total == 16 << 30 and info.dtypes == ("bfloat16", "float32")
    assert acc.memory(0) == (14 << 30, 16 << 30)
    import torch_xla.core.xla_model as xm

    monkeypatch.setattr(xm, "MEMORY", {"kb_free": 1024, "kb_total": 4096})  # torch_xla < 2.1
    assert acc.memory(0) == (1 << 20, 4 << 20)
    acc.init_process(local_rank=0, options={})
    acc.synchronize()
    assert xla.CALLS == ["xla backend registered", "sync", "wait"]
    assert acc.device(2) == "xla:2"


def test_device_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "vfio").mkdir()
    for name in ("accel0", "accel_x", "vfio/1", "vfio/vfio"):
        (tmp_path / name).touch()
    monkeypatch.setattr(mod, "DEV", str(tmp_path))
    assert mod._device_nodes() == [str(tmp_path / "accel0"), str(tmp_path / "vfio" / "1")]
