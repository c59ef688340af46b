"""The mychip accelerator: a device platform for plinth (`--device mychip`).

An example completed from `platform plugins new accelerator mychip`: a
"chip" that is the host CPU, seen through torch's cpu device and gloo, so it
runs anywhere. A real device replaces the /proc reads with its runtime's
calls (torch_mychip.device_count(), mem_get_info(), ...).

`check` must stay cheap and import no vendor runtime; the other methods run
after the plugin was chosen and may import it.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from typing import Any, Mapping

from plinth.api import Accelerator, AcceleratorInfo, SelectionContext

#: the instruction-set extensions a backend may choose kernels by, as Linux names them
_ISA = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_bf16", "asimd", "sve")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def _meminfo() -> tuple[int, int]:
    """(available, total) bytes of host memory, from /proc/meminfo."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = values.get("MemTotal", 0)
    return values.get("MemAvailable", total), total


class MychipAccelerator(Accelerator):
    #: the torch device type your runtime registers (PyTorch's PrivateUse1 name, or "cuda", "xpu", "cpu", ...)
    device_type = "cpu"
    #: the torch.distributed backend its collectives register as ("nccl", "hccl", "gloo", ...)
    dist_backend = "gloo"

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        """Why mychip cannot run here (empty: it can). Cheap, no runtime
        imported: a real device probes its runtime with
        importlib.util.find_spec("torch_mychip") and its device nodes."""
        reasons: list[str] = []
        if importlib.util.find_spec("torch") is None:
            reasons.append("torch is not installed (pip install torch)")
        if not os.path.exists("/proc/meminfo"):
            reasons.append("mychip reads its memory from /proc/meminfo, which this system lacks (Linux only)")
        return reasons

    def info(self) -> AcceleratorInfo:
        """What `platform plugins` and the engine learn of the device: an
        AcceleratorInfo(device_type=..., dist_backend=... (as above),
        device_count, device_name, capability, fp8 ("native", "weight_only" or
        "none"), memory_total of device 0, dtypes (torch names) with
        default_dtype among them, isa, preferred_backends)."""
        cpu = _cpuinfo()
        flags = set((cpu.get("flags") or cpu.get("Features") or "").split())
        return AcceleratorInfo(
            device_type=self.device_type,
            dist_backend=self.dist_backend,
            device_count=1,
            device_name=f"mychip on {cpu.get('model name') or platform.machine()} ({os.cpu_count()} cores)",
            capability=platform.machine(),
            fp8="none",
            memory_total=_meminfo()[1],
            dtypes=("float32", "bfloat16"),
            default_dtype="float32",
            isa=tuple(f for f in _ISA if f in flags),
            # the example backend first; the torch reference serves what it declines
            preferred_backends=("numpyops", "torch"),
        )

    def memory(self, index: int = 0) -> tuple[int, int]:
        """(free, total) bytes of device `index`, 0 < free <= total: it sizes the KV page pool."""
        return _meminfo()

    def kv_cache_budget(self, *, free: int, total: int, weights: int, **_: Any) -> int:
        # host memory is shared with everything else on the machine: a quarter of what is free, at most 2 GiB
        return min(2 << 30, free // 4)

    def init_process(self, *, local_rank: int, options: Mapping[str, Any]) -> None:
        """Once in each process before the model loads: bind device `local_rank`,
        set threads. `options` holds the parsed CLI options (your own too)."""

    def synchronize(self) -> None:
        """Wait for the device's queued work (benchmarks and timing use it)."""
