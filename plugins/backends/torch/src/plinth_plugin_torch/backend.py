"""The torch backend: the reference implementation of every op."""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Mapping

from plinth.api import Backend, SelectionContext


class TorchBackend(Backend):
    """Every op in ``OP_NAMES`` but the fusions (``FUSED_OPS``) in plain PyTorch, on any torch device."""

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

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        from plinth_plugin_torch import attention, ops

        # deterministic mode: every op batch-invariant (the others already are, row by row)
        deterministic = self.ctx.deterministic
        return {
            "rms_norm": ops.rms_norm_rowwise if deterministic else ops.rms_norm,
            "pack_linear": ops.pack_linear,
            "linear": ops.linear_rowwise if deterministic else ops.linear,
            "silu_and_mul": ops.silu_and_mul,
            "rotary": ops.rotary,
            "allocate_kv_cache": attention.allocate_kv_cache,
            # --deterministic: the batch-invariant form (attention.deterministic_attention)
            "prepare_attention": attention.prepare_deterministic_attention if deterministic else attention.prepare_attention,
            "attention": attention.deterministic_attention if deterministic else attention.attention,
            "copy_pages": ops.copy_pages,
            "fused_moe": ops.fused_moe_rowwise if deterministic else ops.fused_moe,
        }
