"""The torch backend: the reference implementation of every op and of
paged attention (``plinth_plugin_torch.attention``)."""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Mapping

from plinth.api import AttentionBackend, Backend, SelectionContext


class TorchBackend(Backend):
    """Every op in ``OP_NAMES`` and paged attention in plain PyTorch, on any torch device."""

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        if importlib.util.find_spec("torch") is None:
            return ["torch is not installed (pip install torch)"]
        reasons = []
        if ctx.dtype is not None and str(ctx.dtype).removeprefix("torch.") not in (
            "float32",
            "bfloat16",
            "float16",
            "float64",
        ):
            reasons.append(f"activation dtype {ctx.dtype} is not a floating point dtype torch computes in")
        return reasons

    @classmethod
    def attention_backend(cls, ctx: SelectionContext) -> type[AttentionBackend[Any]]:
        from plinth_plugin_torch.attention import TorchAttention, TorchDeterministicAttention

        # --deterministic: the batch-invariant form (attention.deterministic_attention)
        return TorchDeterministicAttention if ctx.deterministic else TorchAttention

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        from plinth_plugin_torch import ops

        # deterministic mode: every op batch-invariant (the others already are, row by row)
        deterministic = self.ctx.deterministic
        return {
            "rms_norm": ops.rms_norm_rowwise if deterministic else ops.rms_norm,
            "pack_linear": ops.pack_linear,
            "linear": ops.linear_rowwise if deterministic else ops.linear,
            "silu_and_mul": ops.silu_and_mul,
            "rotary": ops.rotary,
            "fused_moe": ops.fused_moe_rowwise if deterministic else ops.fused_moe,
        }
