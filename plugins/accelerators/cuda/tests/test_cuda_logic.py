"""The plugin's logic on a simulated CUDA runtime (torch.cuda functions
replaced), so that every code path runs on machines without a GPU. The real
thing is covered by the conformance kit on a GPU runner
(PLINTH_REQUIRE_ACCELERATORS=cuda)."""

from __future__ import annotations

import types

import pytest
import torch
from plinth.api import SelectionContext
from plinth_plugin_cuda import accelerator as mod
from plinth_plugin_cuda.accelerator import CUDAAccelerator


@pytest.mark.parametrize(
    "cap, fp8, dtypes",
    [
        ((7, 5), "weight_only", ("float16", "float32")),
        ((8, 0), "weight_only", ("bfloat16", "float16", "float32")),
        ((8, 9), "weight_only", ("bfloat16", "float16", "float32")),
        ((9, 0), "native", ("bfloat16", "float16", "float32")),
        ((10, 0), "native", ("bfloat16", "float16", "float32")),
    ],
)
def test_capability_rules(cap: tuple[int, int], fp8: str, dtypes: tuple[str, ...]) -> None:
    assert mod.fp8_mode(cap) == fp8
    assert mod.dtypes_for(cap) == dtypes


def test_cpu_wheel_is_recognised_without_importing_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mod, "_torch_version", lambda: "2.13.0+cpu")
    assert CUDAAccelerator.check(SelectionContext()) == ["torch was built without CUDA (torch 2.13.0+cpu)"]


@pytest.fixture
def cuda_build(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A CUDA build of torch (as far as the plugin can tell)."""
    monkeypatch.setattr(mod, "_torch_version", lambda: "2.13.0")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    return monkeypatch


def test_no_visible_device(cuda_build: pytest.MonkeyPatch) -> None:
    cuda_build.setattr(torch.cuda, "device_count", lambda: 0)
    cuda_build.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert CUDAAccelerator.check(SelectionContext()) == ["no CUDA device is visible"]
    cuda_build.setenv("CUDA_VISIBLE_DEVICES", "")
    assert CUDAAccelerator.check(SelectionContext()) == ["no CUDA device is visible (CUDA_VISIBLE_DEVICES='' hides every GPU)"]


def test_unlabelled_build_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mod, "_torch_version", lambda: "2.13.0")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert CUDAAccelerator.check(SelectionContext()) == [f"torch was built without CUDA (torch {torch.__version__})"]


def test_info_memory_and_init_on_a_simulated_h100(cuda_build: pytest.MonkeyPatch) -> None:
    calls = []
    cuda_build.setattr(torch.cuda, "device_count", lambda: 2)
    cuda_build.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    cuda_build.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    cuda_build.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace(total_memory=80 << 30))
    cuda_build.setattr(torch.cuda, "mem_get_info", lambda i=0: (70 << 30, 80 << 30))
    cuda_build.setattr(torch.cuda, "set_device", calls.append)
    cuda_build.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    assert CUDAAccelerator.check(SelectionContext()) == []
    acc = CUDAAccelerator()
    info = acc.info()
    assert (info.device_type, info.dist_backend, info.device_count) == ("cuda", "nccl", 2)
    assert (info.capability, info.fp8, info.default_dtype) == ("sm_90", "native", "bfloat16")
    assert info.memory_total == 80 << 30 and info.preferred_backends == ("triton", "torch")
    assert acc.memory(0) == (70 << 30, 80 << 30)
    acc.init_process(local_rank=1, options={})
    acc.synchronize()
    assert calls == [1, "sync"]
    with pytest.raises(RuntimeError, match="local rank 2 needs GPU 2, but only 2 are visible"):
        acc.init_process(local_rank=2, options={})
    assert acc.device(1) == torch.device("cuda", 1)
