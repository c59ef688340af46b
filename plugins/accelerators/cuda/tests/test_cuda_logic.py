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


class CachingAllocator:
    """torch.cuda's memory calls over a scripted device, as the caching
    allocator behaves: a forward allocates and frees, the allocator keeps
    what it reserved (its peak) until ``empty_cache``, so ``mem_get_info``
    reports that much less free after the profile; ``outside`` is what
    something beside torch's allocator holds (NCCL, cuBLAS workspaces)."""

    def __init__(self, total: int, held: int) -> None:
        self.total, self.allocated, self.reserved, self.peak, self.outside = total, held, held, held, 0

    def install(self, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(torch.cuda, "synchronize", lambda i=None: None)
        mp.setattr(torch.cuda, "reset_peak_memory_stats", lambda i=None: setattr(self, "peak", self.allocated))
        mp.setattr(torch.cuda, "memory_allocated", lambda i=None: self.allocated)
        mp.setattr(torch.cuda, "max_memory_allocated", lambda i=None: self.peak)
        mp.setattr(torch.cuda, "memory_reserved", lambda i=None: self.reserved)
        mp.setattr(torch.cuda, "mem_get_info", lambda i=None: (self.total - self.reserved - self.outside, self.total))
        mp.setattr(torch.cuda, "empty_cache", lambda: setattr(self, "reserved", self.allocated))

    def forward(self, activations: int, outside: int = 0) -> None:
        self.allocated += activations
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)
        self.outside += outside
        self.allocated -= activations  # freed to the cache, still reserved


def test_the_memory_report_drops_by_the_profiled_peak(cuda_build: pytest.MonkeyPatch) -> None:
    """After the profile forward the caching allocator still holds its peak:
    free reads that much lower, as on a real GPU (what a KV budget read after
    the profile must not subtract twice)."""
    device = CachingAllocator(total=80 << 30, held=20 << 30)  # the weights
    device.install(cuda_build)
    acc = CUDAAccelerator()
    free_before, _ = acc.memory(0)
    peak = acc.measure_peak(lambda: device.forward(3 << 30, outside=1 << 28), 0)
    assert peak == (3 << 30) + (1 << 28)  # the allocator's peak and what NCCL took beside it
    assert torch.cuda.mem_get_info(0)[0] == free_before - peak  # the device's own report: the cache still held
    free_after, total = acc.memory(0)  # what an allocation can get: the cache counts as free
    assert free_after == free_before - (1 << 28) and total == 80 << 30
    torch.cuda.empty_cache()
    assert acc.memory(0)[0] == free_before - (1 << 28)  # the cache given back; NCCL's stays


def test_the_kv_budget_subtracts_the_profiled_peak_once(cuda_build: pytest.MonkeyPatch) -> None:
    """Start-up's order on a GPU shared with another process: weights, the
    profile forward (the allocator keeps its 3 GiB cached), then the budget
    from memory(). The pool gets what is available less the peak: 80 - 20
    weights - 10 elsewhere - 0.25 NCCL - 3.25 peak = 46.5 GiB. Read from
    mem_get_info alone, free lacked the cached peak and the budget took it
    off again (43.5 GiB)."""
    from plinth.engine.config import EngineConfig
    from plinth.engine.startup import kv_pool_pages

    device = CachingAllocator(total=80 << 30, held=20 << 30)
    device.outside = 10 << 30  # another process
    device.install(cuda_build)
    acc = CUDAAccelerator()
    peak = acc.measure_peak(lambda: device.forward(3 << 30, outside=1 << 28), 0)

    class Model:
        def weight_bytes(self) -> int:
            return 20 << 30

        def kv_cache_specs(self) -> list:
            from plinth.api import FullAttentionSpec

            return [FullAttentionSpec(8, 128)]

    plan = kv_pool_pages(EngineConfig.from_kwargs(page_size=16, max_num_seqs=1 << 20), acc, Model(), torch.bfloat16, max_model_len=1 << 20,
                         activation_peak=peak)  # fmt: skip
    assert plan.budget == (80 << 30) - (20 << 30) - (10 << 30) - (1 << 28) - peak
