"""The mychip accelerator: a device platform for plinth (`--device mychip`).

`check` must stay cheap and import no vendor runtime; the other methods run
after the plugin was chosen and may import it.
"""

from __future__ import annotations

from typing import Any, Mapping

from plinth.api import Accelerator, AcceleratorInfo, SelectionContext


class MychipAccelerator(Accelerator):
    #: the torch device type your runtime registers (PyTorch's PrivateUse1 name, or "cuda", "xpu", "cpu", ...)
    device_type = "mychip"
    #: the torch.distributed backend its collectives register as ("nccl", "hccl", "gloo", ...)
    dist_backend = "gloo"

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        """Why mychip cannot run here, one sentence a user can act on each
        ("torch_mychip is not installed (pip install 'plinth-plugin-mychip[runtime]')", "no
        mychip device is visible"); empty means it can. Probe without importing
        the runtime: importlib.util.find_spec, device nodes, environment."""
        return []

    def info(self) -> AcceleratorInfo:
        """What `platform plugins` and the engine learn of the device: an
        AcceleratorInfo(device_type=..., dist_backend=... (as above),
        device_count, device_name, capability, fp8 ("native", "weight_only" or
        "none"), memory_total of device 0, dtypes (torch names) with
        default_dtype among them, isa, preferred_backends)."""
        raise NotImplementedError("MychipAccelerator.info(): not implemented yet (return an AcceleratorInfo)")

    def memory(self, index: int = 0) -> tuple[int, int]:
        """(free, total) bytes of device `index`, 0 < free <= total: it sizes the KV page pool."""
        raise NotImplementedError("MychipAccelerator.memory(): not implemented yet (return (free, total) bytes)")

    def init_process(self, *, local_rank: int, options: Mapping[str, Any]) -> None:
        """Once in each process before the model loads: bind device `local_rank`,
        set threads. `options` holds the parsed CLI options (your own too)."""

    def synchronize(self) -> None:
        """Wait for the device's queued work (benchmarks and timing use it)."""
