"""NVIDIA GPUs as a plinth accelerator.

``check()`` never initialises CUDA: it reads the torch build from the
distribution metadata first (a ``+cpu`` wheel answers at once, without
importing torch) and otherwise asks ``torch.cuda.device_count()``, which does
not create a CUDA context, so worker processes can still be forked or spawned
afterwards. Everything that touches a device runs only after selection.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Callable, Mapping
from typing import Any

from plinth.api import Accelerator, AcceleratorInfo, SelectionContext

#: FP8 tensor cores that our kernels use natively start with Hopper (SM90);
#: below that an FP8 checkpoint runs weight-only (dequantized to bf16/fp16).
FP8_NATIVE_FROM = (9, 0)
#: bfloat16 arithmetic in hardware starts with Ampere (SM80).
BF16_FROM = (8, 0)


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _visible_devices_hint() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None and value.strip() in ("", "-1"):
        return f" (CUDA_VISIBLE_DEVICES={value!r} hides every GPU)"
    return ""


def fp8_mode(capability: tuple[int, int]) -> str:
    return "native" if capability >= FP8_NATIVE_FROM else "weight_only"


def dtypes_for(capability: tuple[int, int]) -> tuple[str, ...]:
    if capability >= BF16_FROM:
        return ("bfloat16", "float16", "float32")
    return ("float16", "float32")


class CUDAAccelerator(Accelerator):
    device_type = "cuda"
    dist_backend = "nccl"

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        if importlib.util.find_spec("torch") is None:
            return ["torch is not installed (install a CUDA build of torch)"]
        version = _torch_version()
        if "+cpu" in version:  # the CPU wheel: known without importing torch
            return [f"torch was built without CUDA (torch {version})"]
        import torch

        if torch.version.cuda is None:
            return [f"torch was built without CUDA (torch {torch.__version__})"]
        if torch.cuda.device_count() < 1:  # no CUDA context is created here
            return ["no CUDA device is visible" + _visible_devices_hint()]
        return []

    def info(self) -> AcceleratorInfo:
        import torch

        count = torch.cuda.device_count()
        major, minor = torch.cuda.get_device_capability(0)
        capability = (major, minor)
        return AcceleratorInfo(
            device_type="cuda",
            dist_backend="nccl",
            device_count=count,
            device_name=torch.cuda.get_device_name(0),
            capability=f"sm_{capability[0]}{capability[1]}",
            fp8=fp8_mode(capability),
            memory_total=torch.cuda.get_device_properties(0).total_memory,
            dtypes=dtypes_for(capability),
            default_dtype=dtypes_for(capability)[0],
            preferred_backends=("triton", "torch"),
        )

    def init_process(self, *, local_rank: int, options: Mapping[str, Any]) -> None:
        import torch

        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(f"local rank {local_rank} needs GPU {local_rank}, but only {count} are visible")
        torch.cuda.set_device(local_rank)

    def process_group_device(self, local_rank: int) -> Any:
        # NCCL binds the group to this GPU: its communicator is made at init,
        # not at the first collective (DeepEP's init_dist passes device_id too)
        return self.device(local_rank)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def memory(self, index: int = 0) -> tuple[int, int]:
        """(free, total): free is what an allocation can get, the device's free
        bytes plus the blocks torch's caching allocator holds unused (after
        the profile forward it keeps the activation peak and the scratch
        pool cached: counted as used, the KV budget, which subtracts the
        peak, would subtract it twice)."""
        import torch

        free, total = torch.cuda.mem_get_info(index)
        cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return int(free + max(0, cached)), int(total)

    def measure_peak(self, fn: Callable[[], Any], index: int = 0) -> int:
        # the caching allocator's peak counter, as vLLM's profile run reads it;
        # memory outside torch's allocator (NCCL, cuBLAS workspaces) shows in mem_get_info
        import torch

        torch.cuda.synchronize(index)
        torch.cuda.reset_peak_memory_stats(index)
        before = torch.cuda.memory_allocated(index)
        reserved_before = torch.cuda.memory_reserved(index)
        free_before, _ = torch.cuda.mem_get_info(index)
        fn()
        torch.cuda.synchronize(index)
        peak = torch.cuda.max_memory_allocated(index) - before
        free_after, _ = torch.cuda.mem_get_info(index)
        outside = (free_before - free_after) - (torch.cuda.memory_reserved(index) - reserved_before)
        return max(0, peak) + max(0, outside)
