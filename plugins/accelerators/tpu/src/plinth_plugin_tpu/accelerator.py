"""Google TPUs as a plinth accelerator, through torch_xla.

``check()`` imports nothing: torch_xla (and libtpu) are probed with
``importlib.util.find_spec`` and the chips by their device nodes: ``/dev/accel<N>``
(TPU v2-v4) or ``/dev/vfio/<N>`` (v5e, v5p, v6e and later). torch_xla is
imported only by the methods used after the plugin is chosen.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from collections.abc import Mapping
from typing import Any

from plinth.api import Accelerator, AcceleratorInfo, SelectionContext

DEV = "/dev"


def _device_nodes() -> list[str]:
    """TPU chips: accel0, accel1, ... (v2-v4) or vfio/0, vfio/1, ... (v5e and later)."""
    nodes = glob.glob(os.path.join(DEV, "accel[0-9]*")) + glob.glob(os.path.join(DEV, "vfio", "[0-9]*"))
    return sorted(p for p in nodes if re.fullmatch(r"(accel\d+|vfio/\d+)", os.path.relpath(p, DEV)))


def _xla() -> tuple[Any, Any, Any]:
    os.environ.setdefault("PJRT_DEVICE", "TPU")
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    return torch_xla, xm, xr


def _memory_info(xm: Any, device: Any) -> tuple[int, int]:
    """(free, total) bytes: torch_xla >= 2.1 reports bytes_used/bytes_limit,
    older releases kb_free/kb_total."""
    m = xm.get_memory_info(device)
    if "bytes_limit" in m:
        return int(m["bytes_limit"]) - int(m["bytes_used"]), int(m["bytes_limit"])
    return int(m["kb_free"]) * 1024, int(m["kb_total"]) * 1024


class TPUAccelerator(Accelerator):
    device_type = "xla"
    dist_backend = "xla"  # registered by torch_xla.distributed.xla_backend

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        reasons = []
        if importlib.util.find_spec("torch") is None:
            reasons.append("torch is not installed")
        if importlib.util.find_spec("torch_xla") is None:
            reasons.append("torch_xla is not installed (pip install 'torch_xla[tpu]')")
        elif importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
            reasons.append("libtpu is not installed (pip install 'torch_xla[tpu]')")
        pjrt = os.environ.get("PJRT_DEVICE")
        if pjrt and pjrt.upper() != "TPU":
            reasons.append(f"PJRT_DEVICE={pjrt} asks torch_xla for another device (unset it or set PJRT_DEVICE=TPU)")
        if not _device_nodes():
            reasons.append("no TPU is visible (no /dev/accel<N> or /dev/vfio/<N> device)")
        return reasons

    def info(self) -> AcceleratorInfo:
        torch_xla, xm, xr = _xla()
        device = torch_xla.device()
        version = ""
        try:
            from torch_xla._internal import tpu

            version = f"v{tpu.version()}"
        except Exception:  # the version lookup is best effort
            pass
        kind = os.environ.get("TPU_ACCELERATOR_TYPE", "")
        return AcceleratorInfo(
            device_type="xla",
            dist_backend="xla",
            device_count=xr.addressable_device_count(),
            device_name=" ".join(x for x in (f"TPU {version}".strip(), kind and f"({kind})") if x),
            capability=f"tpu_{version}" if version else "tpu",
            fp8="weight_only",
            memory_total=_memory_info(xm, device)[1],
            dtypes=("bfloat16", "float32"),  # float16 is emulated on TPUs
            default_dtype="bfloat16",
            preferred_backends=("torch",),
        )

    def device(self, index: int = 0) -> Any:
        torch_xla, xm, _ = _xla()
        return torch_xla.device(index) if hasattr(torch_xla, "device") else xm.xla_device(index)

    def init_process(self, *, local_rank: int, options: Mapping[str, Any]) -> None:
        # PJRT gives each process its own chips; registering the "xla"
        # torch.distributed backend is what the process layer needs here.
        _xla()
        import torch_xla.distributed.xla_backend  # noqa: F401

    def synchronize(self) -> None:
        torch_xla, xm, _ = _xla()
        if hasattr(torch_xla, "sync"):
            torch_xla.sync()
        else:
            xm.mark_step()
        xm.wait_device_ops()

    def memory(self, index: int = 0) -> tuple[int, int]:
        _, xm, _ = _xla()
        return _memory_info(xm, self.device(index))
