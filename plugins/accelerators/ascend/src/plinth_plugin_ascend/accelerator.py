"""Huawei Ascend NPUs as a plinth accelerator.

``check()`` imports nothing: it probes torch, torch_npu and dlinfer with
``importlib.util.find_spec`` and looks for the NPU device nodes
(``/dev/davinci<N>``) that the Ascend driver creates (and a container maps in).
torch_npu, which loads CANN, is imported only by the methods used after the
plugin is chosen.
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
    """The NPU device nodes (davinci0, davinci1, ...; not davinci_manager)."""
    found = glob.glob(os.path.join(DEV, "davinci[0-9]*"))
    return sorted(p for p in found if re.fullmatch(r"davinci\d+", os.path.basename(p)))


def _torch_npu() -> Any:
    import torch  # noqa: F401  (torch_npu patches torch: import it first)
    import torch_npu

    return torch_npu


class AscendAccelerator(Accelerator):
    device_type = "npu"  # torch_npu registers the "npu" device type
    dist_backend = "hccl"

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        reasons = []
        if importlib.util.find_spec("torch") is None:
            reasons.append("torch is not installed")
        if importlib.util.find_spec("torch_npu") is None:
            reasons.append("torch_npu is not installed")
        if importlib.util.find_spec("dlinfer") is None:
            reasons.append("dlinfer is not installed (pip install dlinfer-ascend)")
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        if visible is not None and not visible.strip():
            reasons.append("ASCEND_RT_VISIBLE_DEVICES is empty, which hides every NPU")
        elif not _device_nodes():
            reasons.append("no Ascend NPU is visible (no /dev/davinci<N> device)")
        return reasons

    def info(self) -> AcceleratorInfo:
        torch_npu = _torch_npu()
        import torch

        npu = torch.npu
        name = npu.get_device_name(0)
        soc = getattr(torch_npu.npu, "get_soc_version", None)
        bf16 = getattr(npu, "is_bf16_supported", lambda: True)()
        dtypes = ("bfloat16", "float16", "float32") if bf16 else ("float16", "float32")
        return AcceleratorInfo(
            device_type="npu",
            dist_backend="hccl",
            device_count=npu.device_count(),
            device_name=name,
            capability=f"soc_{soc()}" if soc else name,
            fp8="weight_only",  # FP8 checkpoints are dequantized; no FP8 matmul here
            memory_total=int(npu.mem_get_info(0)[1]),
            dtypes=dtypes,
            default_dtype=dtypes[0],
            preferred_backends=("dlinfer", "torch"),
        )

    def device(self, index: int = 0) -> Any:
        _torch_npu()
        import torch

        return torch.device("npu", index)

    def init_process(self, *, local_rank: int, options: Mapping[str, Any]) -> None:
        _torch_npu()
        import torch

        count = torch.npu.device_count()
        if local_rank >= count:
            raise RuntimeError(f"local rank {local_rank} needs NPU {local_rank}, but only {count} are visible")
        torch.npu.set_device(local_rank)

    def synchronize(self) -> None:
        _torch_npu()
        import torch

        torch.npu.synchronize()

    def memory(self, index: int = 0) -> tuple[int, int]:
        _torch_npu()
        import torch

        free, total = torch.npu.mem_get_info(index)
        return int(free), int(total)
