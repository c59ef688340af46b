"""The accelerator category (``--device``): a device platform."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

from plinth.contract.base import PluginDescriptor, PluginImpl

if TYPE_CHECKING:
    import torch



@dataclass(frozen=True)
class AcceleratorDescriptor(PluginDescriptor):
    """A device platform (``--device``). impl -> an ``Accelerator`` subclass.

    process_env: (name, value) defaults for runtimes that read their settings
    once, when torch loads them (an OpenMP runtime's spin-wait, a vendor
    runtime's), so ``init_process`` is too late to set them. The ``platform``
    CLI sets each one the user has not set, before anything imports torch:
    those of the accelerator ``--device`` names, or with ``auto`` those of
    every installed accelerator (the highest priority first). Processes it
    starts (ranks, workers) inherit them; ``LLM(...)`` in a user's own
    program does not set them.
    """

    category: ClassVar[str] = "accelerator"
    process_env: tuple[tuple[str, str], ...] = ()


@dataclass
class AcceleratorInfo:
    """What ``platform plugins`` and the engine learn about a device platform."""

    device_type: str  # torch device type: "cpu", "cuda", "npu", "xla", "xpu", ...
    dist_backend: str  # torch.distributed backend: "gloo", "nccl", "hccl", ...
    device_count: int
    device_name: str = ""
    capability: str = ""  # e.g. "sm_90"
    fp8: str = "none"  # "native" | "weight_only" | "none"
    memory_total: int = 0  # bytes, device 0
    dtypes: tuple[str, ...] = ()  # e.g. ("bfloat16", "float32")
    #: instruction-set extensions found (CPU: "avx2", "avx512_bf16", "amx_bf16",
    #: "sve", ...), possibly narrowed by the user; backends decide from these,
    #: never from the machine's name or their own probing
    isa: tuple[str, ...] = ()
    default_dtype: str = "bfloat16"
    preferred_backends: tuple[str, ...] = ()


class Accelerator(PluginImpl):
    """A device platform. Instantiated once per process after it is chosen."""

    device_type: ClassVar[str] = ""
    dist_backend: ClassVar[str] = "gloo"

    @abc.abstractmethod
    def info(self) -> AcceleratorInfo:
        raise NotImplementedError

    def device(self, index: int = 0) -> "torch.device":
        import torch

        return torch.device(self.device_type, index)

    def init_process(self, *, local_rank: int, options: Mapping[str, Any]) -> None:
        """Called once in each process before the model loads (bind the
        device, set thread counts)."""

    def synchronize(self) -> None:
        """Wait for queued device work (used by benchmarks and timing)."""

    @abc.abstractmethod
    def memory(self, index: int = 0) -> tuple[int, int]:
        """(free, total) bytes of device ``index``; sizes the KV page pool."""
        raise NotImplementedError

    def kv_cache_budget(
        self, *, free: int, total: int, weights: int, activation_peak: int = 0, reserved: int = 0, utilization: float = 0.9
    ) -> int:
        """Bytes the KV page pool takes by default (``--kv-cache-memory`` and
        ``--num-pages`` override), asked after the weights loaded and the a2a
        buffers were allocated: ``free`` is measured then, so it already
        lacks them. A device that holds nothing else takes ``utilization``
        of its memory less what the run holds besides the pool (weights, the
        profiled activation peak, ``reserved``: a2a buffers, a draft model),
        and never more than is free (as vLLM's ``--gpu-memory-utilization``);
        a host shares its memory and takes less."""
        return min(int(utilization * total) - weights - activation_peak - reserved, free - activation_peak)

    def measure_peak(self, fn: "Callable[[], Any]", index: int = 0) -> int:
        """Run ``fn`` (the profiling forward) and return the most device bytes
        it held at once beyond what was held before. The default reads
        ``memory`` before and after: right for caching allocators, which keep
        what a forward took; a device with a peak counter overrides it."""
        before, _ = self.memory(index)
        fn()
        after, _ = self.memory(index)
        return max(0, before - after)

    def supported_dtypes(self) -> "list[torch.dtype]":
        import torch

        return [getattr(torch, name) for name in self.info().dtypes]

    def default_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.info().default_dtype)
