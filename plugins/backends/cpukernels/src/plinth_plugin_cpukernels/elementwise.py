"""rms_norm (with the residual add fused), silu_and_mul and rotary as single
C++ kernels: each replaces 2-8 torch ops, and a decode step runs them ~120
times. Inputs they do not cover (other dtypes, flat rotary inputs,
non-float32 rotary tables) go to the reference's ops. Strided inputs are
made contiguous for the kernels rather than handed to the reference: a
view such as a q split from a fused qkv projection is contiguous for one
token and strided for more, so choosing the path by it would compute a
decode row (one token) and the same row in a batch with different code
(and different bits under ``--deterministic``)."""

from __future__ import annotations

from typing import Any, Callable, Mapping


def make_elementwise_ops(kernels: Any, reference: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    import torch

    k_rms, k_silu, k_rotary = kernels.rms_norm, kernels.silu_and_mul, kernels.rotary
    dtypes = (torch.bfloat16, torch.float32)
    ref_rms, ref_silu, ref_rotary = reference["rms_norm"], reference["silu_and_mul"], reference["rotary"]

    def rms_norm(x, weight, eps, residual=None):
        if x.dtype not in dtypes or (residual is not None and residual.dtype != x.dtype) or weight is None:
            return ref_rms(x, weight, eps, residual)
        if residual is not None and not residual.is_contiguous():
            residual = residual.contiguous()
        out = k_rms(x.contiguous(), weight, float(eps), residual)
        return out[0] if residual is None else (out[0], out[1])

    def silu_and_mul(x):
        if x.dtype not in dtypes:
            return ref_silu(x)
        return k_silu(x.contiguous())

    def rotary(q, k, positions, cos_sin, is_neox):
        if (
            q.dim() != 3
            or k.dim() != 3
            or q.dtype not in dtypes
            or k.dtype != q.dtype
            or q.stride(2) != 1
            or k.stride(2) != 1
            or cos_sin.dtype != torch.float32
        ):
            return ref_rotary(q, k, positions, cos_sin, is_neox)
        table = cos_sin if cos_sin.is_contiguous() else cos_sin.contiguous()
        return k_rotary(q, positions, table, bool(is_neox)), k_rotary(k, positions, table, bool(is_neox))

    return {"rms_norm": rms_norm, "silu_and_mul": silu_and_mul, "rotary": rotary}
