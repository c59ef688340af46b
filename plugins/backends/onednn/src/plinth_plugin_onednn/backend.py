"""Pre-packed oneDNN linear layers."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from plinth.api import Backend, SelectionContext

_DTYPES = (torch.bfloat16, torch.float32)


class PackedLinear:
    """A weight in oneDNN's blocked layout, with what linear needs to know."""

    __slots__ = ("packed", "out_features", "in_features", "dtype")

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())

    def nbytes(self) -> int:
        return self.out_features * self.in_features * torch.empty((), dtype=self.dtype).element_size()


def pack_linear(weight: Any) -> Any:
    if isinstance(weight, torch.Tensor) and weight.dtype in _DTYPES and weight.dim() == 2 and weight.device.type == "cpu":
        return PackedLinear(weight)
    return weight  # quantized or unusual weights keep the reference path


def make_linear(reference_linear: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    mkldnn_linear = torch.ops.mkldnn._linear_pointwise

    def linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
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
        try:
            import torch as _torch

            if not _torch.backends.mkldnn.is_available():
                reasons.append("this torch build has no oneDNN (MKL-DNN)")
        except ImportError:
            reasons.append("torch is not installed")
        if ctx.dtype is not None and ctx.dtype not in _DTYPES:
            reasons.append(f"dtype {ctx.dtype} is not bfloat16 or float32")
        return reasons

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        # weights it does not pack (quantized ones) keep the reference's
        # packing and linear
        ref_pack = self.reference.get("pack_linear", lambda w: w)
        ref_linear = self.reference.get("linear", F.linear)

        def pack(weight: Any) -> Any:
            packed = pack_linear(weight)
            return packed if type(packed) is PackedLinear else ref_pack(weight)

        return {"pack_linear": pack, "linear": make_linear(ref_linear)}
