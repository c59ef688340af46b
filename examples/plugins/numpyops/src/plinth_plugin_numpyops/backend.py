"""The numpyops backend (`--backend numpyops`): compute ops in numpy.

An example completed from `platform plugins new backend numpyops`: rms_norm,
silu_and_mul and linear (with pack_linear) are computed by numpy on the
host's float32 arrays; rotary, fused_moe and paged attention are the torch
reference backend's (their methods and attention.py were deleted, and
`attention_backend` returns None). Outside float32 numpy has nothing to run
(no bfloat16), so every op is declined there with why, and under
--deterministic linear is (OpenBLAS may block a GEMM by the batch's rows).

Each op must give the reference's numbers (the conformance kit compares
them); its signature is the one in plinth.api.OP_SIGNATURES (checked at
start-up). numpy is imported when the ops are built, not by `check`.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Callable, Mapping

from plinth.api import AttentionBackend, Backend, QuantizedWeight, SelectionContext

if TYPE_CHECKING:
    import numpy
    import torch

#: the ops numpy computes here
OPS = ("rms_norm", "pack_linear", "linear", "silu_and_mul")


def _array(t: torch.Tensor) -> numpy.ndarray:
    """A host tensor's memory as a numpy array (no copy)."""
    return t.detach().numpy()


class NumpyopsBackend(Backend):
    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        """Why the whole backend cannot run in `ctx`: numpy missing, or a device
        that is not host memory."""
        reasons: list[str] = []
        if importlib.util.find_spec("numpy") is None:
            reasons.append("numpy is not installed (pip install numpy)")
        if ctx.accelerator is not None and ctx.accelerator.device_type != "cpu":
            reasons.append(f"numpy computes in host memory, and the accelerator's device type is {ctx.accelerator.device_type}, not cpu")
        return reasons

    @classmethod
    def unsupported_ops(cls, ctx: SelectionContext) -> Mapping[str, str]:
        """Ops it has but cannot run for `ctx`, each with why; `ops()` leaves them out."""
        dtype = str(ctx.dtype).removeprefix("torch.") if ctx.dtype is not None else "float32"
        if dtype != "float32":
            why = f"numpyops computes in float32 only (numpy has no bfloat16), not {dtype}"
            return {op: why for op in OPS}
        if ctx.deterministic:
            why = "numpy's GEMM (OpenBLAS) may block by the batch's rows, so a row's result could depend on its batch"
            return {"pack_linear": why, "linear": why}
        return {}

    @classmethod
    def attention_backend(cls, ctx: SelectionContext) -> type[AttentionBackend[Any]] | None:
        """Its paged attention: None, the reference's."""
        return None

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        """The ops it brings for `self.ctx` (less those `unsupported_ops` declines)."""
        ops: dict[str, Callable[..., Any]] = {
            "rms_norm": self.rms_norm,
            "pack_linear": self.pack_linear,
            "linear": self.linear,
            "silu_and_mul": self.silu_and_mul,
        }
        declined = self.unsupported_ops(self.ctx)
        return {name: op for name, op in ops.items() if name not in declined}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None) -> Any:
        """x * rsqrt(mean(x^2) + eps) * weight, in float32 inside; with
        `residual`: (norm(x + residual), x + residual)."""
        import numpy as np
        import torch

        a = _array(x)
        if residual is not None:
            a = a + _array(residual)
        y = a / np.sqrt(np.mean(np.square(a), axis=-1, keepdims=True) + np.float32(eps))
        if weight is not None:
            y = y * _array(weight)
        out = torch.from_numpy(np.ascontiguousarray(y))
        return (out, torch.from_numpy(a)) if residual is not None else out

    def pack_linear(self, weight: torch.Tensor | QuantizedWeight) -> Any:
        """A weight [out, in] once at load, as the numpy array `linear` takes
        (a QuantizedWeight, which no declared capability asks for, stays the reference's)."""
        import numpy as np

        if isinstance(weight, QuantizedWeight):
            return self.reference["pack_linear"](weight)
        return np.ascontiguousarray(_array(weight))

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] @ W^T (+ bias) -> [T, out], W as `pack_linear` made it."""
        import numpy as np
        import torch

        if not isinstance(weight, np.ndarray):  # the reference's packed form
            return self.reference["linear"](x, weight, bias)
        y = _array(x) @ weight.T
        if bias is not None:
            y += _array(bias)
        return torch.from_numpy(y)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2N] -> silu(x[:, :N]) * x[:, N:]."""
        import numpy as np
        import torch

        a = _array(x)
        n = a.shape[-1] // 2
        gate, up = a[..., :n], a[..., n:]
        with np.errstate(over="ignore"):  # exp(-gate) overflows to inf for very negative gates: silu is then -0
            return torch.from_numpy(gate / (np.float32(1) + np.exp(-gate)) * up)
