"""The host CPU as a plinth accelerator."""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
from typing import Any, Mapping

from plinth.api import Accelerator, AcceleratorInfo, SelectionContext

from plinth_plugin_cpu.isa import ISA_ENV, effective_isa, hardware_isa, machine, native_bf16
from plinth_plugin_cpu.threads import BIND_ENV, bind_threads

log = logging.getLogger("plinth.cpu")


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
        isa = effective_isa()
        narrowed = set(isa) != hardware_isa()
        # bf16 only where the CPU multiplies it natively: elsewhere bf16
        # matmuls are emulated, 3.7-8x slower than float32 (docs/benchmarks.md)
        default = "bfloat16" if native_bf16(isa) else "float32"
        return AcceleratorInfo(
            device_type="cpu",
            dist_backend="gloo",
            device_count=1,
            device_name=f"{_cpu_name()} ({os.cpu_count()} cores)",
            capability=machine() + (f" (narrowed by {ISA_ENV})" if narrowed else ""),
            fp8="weight_only",
            memory_total=_meminfo()[1],
            dtypes=("bfloat16", "float32"),
            default_dtype=default,
            preferred_backends=("cpukernels", "torch"),
            isa=isa,
        )

    def init_process(self, *, local_rank: int, options: Mapping[str, Any]) -> None:
        import torch

        _narrow_torch(effective_isa())
        threads = options.get("cpu_threads") or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads:
            torch.set_num_threads(int(threads))
        setting = options.get("cpu_bind") or os.environ.get(BIND_ENV) or "none"
        if setting != "none":
            log.info("cpu: %s", bind_threads(setting, threads=torch.get_num_threads(), local_rank=local_rank))

    def memory(self, index: int = 0) -> tuple[int, int]:
        return _meminfo()

    def kv_cache_budget(self, *, free: int, total: int, weights: int, **_: Any) -> int:
        # host memory is shared with everything else on the machine
        return min(4 << 30, free // 4)


def _narrow_torch(isa: tuple[str, ...]) -> None:
    """With a narrowed set, torch's own kernels (ATen's dispatch, oneDNN) are
    capped to it too, so the run matches the smaller CPU's. Both settings are
    read at torch's first op of each kind: before that they take effect; the
    log says when ATen had already chosen."""
    if set(isa) == hardware_isa() or machine() != "x86_64":
        return
    s = set(isa)
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= s:
        aten = "avx512"
        onednn = (
            "AVX512_CORE_AMX" if "amx_bf16" in s else "AVX512_CORE_BF16" if "avx512_bf16" in s
            else "AVX512_CORE_VNNI" if "avx512_vnni" in s else "AVX512_CORE"
        )
    elif {"avx2", "fma"} <= s:
        aten, onednn = "avx2", "AVX2_VNNI" if "avx_vnni" in s else "AVX2"
    else:
        aten, onednn = "default", "AVX" if "avx" in s else "SSE41"
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
    os.environ.setdefault("ATEN_CPU_CAPABILITY", aten)
    import torch

    got = torch.backends.cpu.get_cpu_capability().lower()
    if got != os.environ["ATEN_CPU_CAPABILITY"].lower():
        log.warning(
            "%s narrows plinth's kernels to %s, but torch already runs its own at %s: set "
            "ATEN_CPU_CAPABILITY=%s before starting to narrow those too", ISA_ENV, ",".join(isa), got, aten,
        )
