"""The host CPU as a plinth accelerator."""

from __future__ import annotations

import importlib.util
import os
import platform
from typing import Any, Mapping

from plinth.api import Accelerator, AcceleratorInfo, SelectionContext


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _meminfo() -> tuple[int, int]:
    """(available, total) bytes of host memory."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = values.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return values.get("MemAvailable", total), total


class CPUAccelerator(Accelerator):
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        if importlib.util.find_spec("torch") is None:
            return ["torch is not installed (pip install torch)"]
        return []

    def info(self) -> AcceleratorInfo:
        flags = _cpu_flags()
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
        return AcceleratorInfo(
            device_type="cpu",
            dist_backend="gloo",
            device_count=1,
            device_name=f"{_cpu_name()} ({os.cpu_count()} cores)",
            capability="+".join(isa) or platform.machine(),
            fp8="weight_only",
            memory_total=_meminfo()[1],
            dtypes=("bfloat16", "float32"),
            default_dtype="bfloat16",
            preferred_backends=("cpukernels", "torch"),
        )

    def init_process(self, *, local_rank: int, options: Mapping[str, Any]) -> None:
        import torch

        threads = options.get("cpu_threads") or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads:
            torch.set_num_threads(int(threads))

    def memory(self, index: int = 0) -> tuple[int, int]:
        return _meminfo()

    def kv_cache_budget(self, *, free: int, total: int, weights: int) -> int:
        # host memory is shared with everything else on the machine
        return min(4 << 30, free // 4)
