"""The numpyops backend (`--backend numpyops`): compute ops and paged attention.

An op it does not bring is the reference backend's (torch): bring only the
ops your kernels make faster, and delete the others from `ops()` and this
file. An op it has but cannot run in a context (a dtype, an instruction set)
is declined in `unsupported_ops` with why. Each op must give the reference's
numbers (the conformance kit compares them); its signature is the one in
plinth.api.OP_SIGNATURES (checked at start-up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from plinth.api import AttentionBackend, Backend, QuantizedWeight, SelectionContext

if TYPE_CHECKING:
    import torch


class NumpyopsBackend(Backend):
    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        """Why the whole backend cannot run in `ctx` (its library missing, the
        accelerator's device type `ctx.accelerator.device_type`, the dtype), a
        sentence a user can act on each. Cheap: no vendor library imported."""
        return []

    @classmethod
    def unsupported_ops(cls, ctx: SelectionContext) -> Mapping[str, str]:
        """Ops it has but cannot run for `ctx`, each with why; `ops()` leaves them out."""
        return {}

    @classmethod
    def attention_backend(cls, ctx: SelectionContext) -> type[AttentionBackend[Any]] | None:
        """Its paged attention (attention.py); return None to run the reference's."""
        from plinth_plugin_numpyops.attention import NumpyopsAttention

        return NumpyopsAttention

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        """The ops it brings for `self.ctx` (less those `unsupported_ops` declines)."""
        ops: dict[str, Callable[..., Any]] = {
            "rms_norm": self.rms_norm,
            "pack_linear": self.pack_linear,
            "linear": self.linear,
            "silu_and_mul": self.silu_and_mul,
            "rotary": self.rotary,
            "fused_moe": self.fused_moe,
        }
        declined = self.unsupported_ops(self.ctx)
        return {name: op for name, op in ops.items() if name not in declined}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None) -> Any:
        """x * rsqrt(mean(x^2) + eps) * weight, in float32 inside; with
        `residual`: (norm(x + residual), x + residual)."""
        raise NotImplementedError("NumpyopsBackend.rms_norm(): not implemented yet (or delete it: the reference's runs)")

    def pack_linear(self, weight: torch.Tensor | QuantizedWeight) -> Any:
        """A weight [out, in] (or a QuantizedWeight in a format `capabilities`
        declares) once at load, into whatever `linear` takes."""
        raise NotImplementedError("NumpyopsBackend.pack_linear(): not implemented yet (or delete it with linear)")

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] @ W^T (+ bias) -> [T, out], W as `pack_linear` made it."""
        raise NotImplementedError("NumpyopsBackend.linear(): not implemented yet (or delete it with pack_linear)")

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2N] -> silu(x[:, :N]) * x[:, N:]."""
        raise NotImplementedError("NumpyopsBackend.silu_and_mul(): not implemented yet (or delete it)")

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] rotated at `positions` by the table
        cos_sin [max_pos, rotary_dim] (cos halves then sin halves); neox: halves, else pairs."""
        raise NotImplementedError("NumpyopsBackend.rotary(): not implemented yet (or delete it)")

    def fused_moe(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Per token, sum over its top-k of weight x w2[e] @ silu_and_mul(w13[e] @ x);
        ids outside 0..E-1 (other ranks' experts) add nothing."""
        raise NotImplementedError("NumpyopsBackend.fused_moe(): not implemented yet (or delete it)")
