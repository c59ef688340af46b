"""The cpukernels backend: what it does better than the reference, per op."""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Mapping

from plinth.api import Backend, SelectionContext

from plinth_plugin_cpukernels.gemm import DTYPE_NAMES, PackedLinear, make_linear, pack_linear


class CPUKernelsBackend(Backend):
    """GEMMs, decode attention and the small per-layer ops for CPUs; the rest
    (and what a kernel does not cover) from the reference."""

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        from plinth_plugin_cpukernels.kernels import compiler_missing

        reasons = []
        if ctx.accelerator is not None and getattr(ctx.accelerator, "device_type", "") != "cpu":
            reasons.append(f"runs on CPUs only, not {ctx.accelerator.device_type}")
        if importlib.util.find_spec("torch") is None:
            reasons.append("torch is not installed")
        elif ctx.accelerator is not None:  # chosen for real: now torch may load
            import torch

            if not torch.backends.mkldnn.is_available():
                reasons.append("this torch build has no oneDNN (MKL-DNN)")
        if ctx.dtype is not None and str(ctx.dtype).removeprefix("torch.") not in DTYPE_NAMES:
            reasons.append(f"dtype {ctx.dtype} is not bfloat16 or float32")
        missing = compiler_missing()
        if missing:
            reasons.append(missing)
        return reasons

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        import torch.nn.functional as F

        from plinth_plugin_cpukernels.attention import make_attention_ops
        from plinth_plugin_cpukernels.elementwise import make_elementwise_ops

        # weights it does not pack (quantized ones) keep the reference's packing and linear
        ref_pack = self.reference.get("pack_linear", lambda w: w)
        ref_linear = self.reference.get("linear", F.linear)

        def pack(weight: Any) -> Any:
            packed = pack_linear(weight)
            return packed if type(packed) is PackedLinear else ref_pack(weight)

        ops: dict[str, Callable[..., Any]] = {"pack_linear": pack, "linear": make_linear(ref_linear)}
        # the decode kernel reads the reference's KV layout and hands it what
        # it does not handle; without the reference's attention ops, none
        if all(op in self.reference for op in ("allocate_kv_cache", "prepare_attention", "attention", "copy_pages")):
            ops.update(make_attention_ops(self.reference))
        if all(op in self.reference for op in ("rms_norm", "silu_and_mul", "rotary")):
            ops.update(make_elementwise_ops(self.reference))
        return ops
