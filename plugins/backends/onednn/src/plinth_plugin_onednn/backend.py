"""Pre-packed oneDNN linear layers.

torch is imported inside functions: `platform plugins` imports this module to
ask ``check()``, and that must stay fast.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Mapping

from plinth.api import Backend, SelectionContext

_DTYPE_NAMES = ("bfloat16", "float32")


class PackedLinear:
    """A weight in oneDNN's blocked layout, with what linear needs to know."""

    __slots__ = ("packed", "out_features", "in_features", "dtype")

    def __init__(self, weight: Any) -> None:
        import torch

        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())

    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize


def pack_linear(weight: Any) -> Any:
    """Pack plain CPU bf16/fp32 matrices; anything else is returned as is."""
    import torch

    if (
        isinstance(weight, torch.Tensor)
        and str(weight.dtype).removeprefix("torch.") in _DTYPE_NAMES
        and weight.dim() == 2
        and weight.device.type == "cpu"
    ):
        return PackedLinear(weight)
    return weight


def make_linear(reference_linear: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    mkldnn_linear = torch.ops.mkldnn._linear_pointwise

    def linear(x: Any, weight: Any, bias: Any = None) -> Any:
        if type(weight) is PackedLinear:
            if x.dtype != weight.dtype:
                x = x.to(weight.dtype)
            shape = x.shape
            y = mkldnn_linear(x.reshape(-1, shape[-1]), weight.packed, bias, "none", [], "")
            return y.view(*shape[:-1], weight.out_features)
        return reference_linear(x, weight, bias)

    return linear


class OneDNNBackend(Backend):
    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        reasons = []
        if ctx.accelerator is not None and getattr(ctx.accelerator, "device_type", "") != "cpu":
            reasons.append(f"runs on CPUs only, not {ctx.accelerator.device_type}")
        if importlib.util.find_spec("torch") is None:
            reasons.append("torch is not installed")
        elif ctx.accelerator is not None:  # chosen for real: now torch may load
            import torch

            if not torch.backends.mkldnn.is_available():
                reasons.append("this torch build has no oneDNN (MKL-DNN)")
        if ctx.dtype is not None and str(ctx.dtype).removeprefix("torch.") not in _DTYPE_NAMES:
            reasons.append(f"dtype {ctx.dtype} is not bfloat16 or float32")
        return reasons

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        import torch.nn.functional as F

        # weights it does not pack (quantized ones) keep the reference's
        # packing and linear
        ref_pack = self.reference.get("pack_linear", lambda w: w)
        ref_linear = self.reference.get("linear", F.linear)

        def pack(weight: Any) -> Any:
            packed = pack_linear(weight)
            return packed if type(packed) is PackedLinear else ref_pack(weight)

        return {"pack_linear": pack, "linear": make_linear(ref_linear)}
