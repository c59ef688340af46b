"""The accelerator category (``--device``): a device platform."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, cast

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

    def __post_init__(self) -> None:
        super().__post_init__()
        # checked here, at registration: the CLI writes them into os.environ
        # before torch loads, where a bad one would fail every command
        raw = cast(object, self.process_env)  # whatever a plugin passed, whatever the annotation says
        if not isinstance(raw, tuple):
            raise ValueError(f"{self.name}: process_env must be a tuple of (name, value) pairs, got {type(raw).__name__}")
        seen: set[str] = set()
        for pair in cast("tuple[object, ...]", raw):
            name = _env_name(self.name, pair)
            if name in seen:
                raise ValueError(f"{self.name}: process_env sets {name} twice")
            seen.add(name)


def _env_name(plugin: str, pair: object) -> str:
    """The name of pair, a (name, value) an environment can hold, or a ValueError."""
    items = cast("tuple[object, ...]", pair) if isinstance(pair, tuple) else ()
    if len(items) != 2 or not isinstance(items[0], str) or not isinstance(items[1], str):
        raise ValueError(f"{plugin}: process_env entry {pair!r} is not a (name, value) pair of strings")
    name, value = items[0], items[1]
    if not name or "=" in name or "\0" in name or "\0" in value:
        raise ValueError(f"{plugin}: process_env cannot set {name!r}={value!r} in the environment")
    return name


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

    def process_group_device(self, local_rank: int) -> "torch.device | None":
        """The device a rank's process group is bound to (torch.distributed's
        ``init_process_group(device_id=...)``: its communicator formed at
        once, not at the first collective, and the subgroups' split from
        it), or None where collectives run on the host. A library that
        reuses a group's communicator (DeepEP V2 reads ``_comm_ptr()``)
        finds one only where the group is bound; the engine also runs a
        collective on the expert group before building the a2a plugin."""
        return None

    def synchronize(self) -> None:
        """Wait for queued device work (used by benchmarks and timing)."""

    @abc.abstractmethod
    def memory(self, index: int = 0) -> tuple[int, int]:
        """(free, total) bytes of device ``index``; sizes the KV page pool."""
        raise NotImplementedError

    def kv_cache_budget(
        self, *, free: int, total: int, weights: int, utilization: float, activation_peak: int = 0, reserved: int = 0
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
