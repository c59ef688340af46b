"""A test-only accelerator, found through the entry point of the dist-info
beside it when this folder is on sys.path: torch device type ``npu`` (what
the dlinfer backend checks, as on a real NPU) with its tensors on the CPU,
and the ascend accelerator's backend preference. Never installed."""

from __future__ import annotations

import os
from typing import Any

from plinth.api import Accelerator, AcceleratorDescriptor, AcceleratorInfo, hookimpl


@hookimpl
def plinth_register_accelerators():
    return [
        AcceleratorDescriptor(
            name="fakenpu",
            impl="plinth_test_fakenpu:FakeNPUAccelerator",
            priority=-100,  # auto never takes it
            description="tests only: an 'npu' whose tensors live on the CPU",
        )
    ]


class FakeNPUAccelerator(Accelerator):
    device_type = "npu"
    dist_backend = "gloo"

    def info(self) -> AcceleratorInfo:
        return AcceleratorInfo(
            device_type="npu", dist_backend="gloo", device_count=1, device_name="fake NPU (CPU tensors)",
            dtypes=("bfloat16", "float16", "float32"), default_dtype="float16", preferred_backends=("dlinfer", "torch"),
        )

    def device(self, index: int = 0) -> Any:
        import torch

        return torch.device("cpu")

    def memory(self, index: int = 0) -> tuple[int, int]:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total // 4, total
