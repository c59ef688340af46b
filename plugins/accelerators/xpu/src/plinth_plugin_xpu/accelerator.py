"""Intel GPUs as a plinth accelerator, through torch.xpu.

``check()`` reads the torch build from the distribution metadata first (a
``+cpu`` or ``+cu…`` wheel has no XPU support, known without importing torch);
otherwise it asks ``torch.xpu`` whether it was compiled in and how many devices
are visible. Devices are touched only after the plugin is chosen.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Mapping
from typing import Any

from plinth.api import Accelerator, AcceleratorInfo, SelectionContext


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _built_without_xpu(version: str) -> bool:
    """True when the wheel's local label names another build (cpu, cu128, rocm6.3)."""
    label = version.partition("+")[2]
    return bool(re.fullmatch(r"cpu.*|cu\d+.*|rocm.*", label))


class XPUAccelerator(Accelerator):
    device_type = "xpu"
    dist_backend = "xccl"

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        if importlib.util.find_spec("torch") is None:
            return ["torch is not installed (install an XPU build of torch)"]
        version = _torch_version()
        if _built_without_xpu(version):
            return [f"torch was built without XPU support (torch {version})"]
        import torch

        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu._is_compiled():
            return [f"torch was built without XPU support (torch {torch.__version__})"]
        if xpu.device_count() < 1:
            hint = " (ZE_AFFINITY_MASK hides every GPU)" if os.environ.get("ZE_AFFINITY_MASK") == "" else ""
            return ["no XPU device is visible" + hint]
        return []

    def info(self) -> AcceleratorInfo:
        import torch

        props = torch.xpu.get_device_properties(0)
        arch = getattr(props, "architecture", None)
        bf16 = torch.xpu.is_bf16_supported()
        fp16 = getattr(props, "has_fp16", True)
        dtypes = tuple(n for n, ok in (("bfloat16", bf16), ("float16", fp16), ("float32", True)) if ok)
        return AcceleratorInfo(
            device_type="xpu",
            dist_backend="xccl",
            device_count=torch.xpu.device_count(),
            device_name=props.name,
            capability=f"arch_{arch}" if arch is not None else str(getattr(props, "version", "")),
            fp8="weight_only",
            memory_total=int(props.total_memory),
            dtypes=dtypes,
            default_dtype=dtypes[0],
            preferred_backends=("triton", "torch"),
        )

    def init_process(self, *, local_rank: int, options: Mapping[str, Any]) -> None:
        import torch

        count = torch.xpu.device_count()
        if local_rank >= count:
            raise RuntimeError(f"local rank {local_rank} needs XPU {local_rank}, but only {count} are visible")
        torch.xpu.set_device(local_rank)

    def synchronize(self) -> None:
        import torch

        torch.xpu.synchronize()

    def memory(self, index: int = 0) -> tuple[int, int]:
        import torch

        if hasattr(torch.xpu, "mem_get_info"):
            free, total = torch.xpu.mem_get_info(index)
            return int(free), int(total)
        total = int(torch.xpu.get_device_properties(index).total_memory)
        return total - int(torch.xpu.memory_reserved(index)), total
