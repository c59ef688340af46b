"""The triton backend: its kernels per op, the reference for the rest.

Op by op:

=================  ================================================================
op                 source
=================  ================================================================
attention          its attention backend (``TritonAttention``): split-K paged
                   decode (GQA), ragged causal paged prefill, over pages
                   [Hkv, pages, page_size, D] (allocated and copied as the
                   contract's defaults do: whole-page index copies)
fused_moe          Triton: grouped GEMMs over expert-sorted, block-aligned tokens
rms_norm           Triton: one pass, residual add fused
pack_linear,       FP8 ``QuantizedWeight``: Triton (W8A8 block-scaled on native
linear             FP8, weight-only dequant-in-kernel otherwise); dense weights:
                   the reference (torch.matmul: cuBLAS beats a Triton GEMM)
silu_and_mul       the reference (fused into fused_moe's first GEMM; dense MLPs
                   take torch's elementwise op)
rotary             the reference (a gather + multiply-add; no kernel pays yet)
=================  ================================================================

Its capabilities declare the FP8 path its linear takes here (``fp8``, with
why); model loaders that find one keep FP8 weights quantized instead of
dequantizing at load.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any, Callable, Mapping

from plinth.api import AttentionBackend, Backend, BackendCapabilities, PluginError, QuantizedWeight, SelectionContext

#: what this backend takes from the reference, and why (logged at start-up)
FROM_REFERENCE = {
    "silu_and_mul": "fused into fused_moe; dense MLPs use torch's elementwise op",
    "rotary": "no kernel pays yet",
}
DTYPES = ("float32", "bfloat16", "float16")

log = logging.getLogger("plinth.triton")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


#: Triton's NVIDIA backend takes float8e4nv (e4m3fn) tensors from sm_89 on
#: (third_party/nvidia/backend/compiler.py: supported_fp8_dtypes adds fp8e4nv for capability >= 89)
FP8_POINTERS_FROM = (8, 9)


def _capability(text: str) -> tuple[int, int] | None:
    digits = (text or "").removeprefix("sm_")
    return (int(digits[:-1]), int(digits[-1])) if digits.isdigit() and len(digits) >= 2 else None


def fp8_path(ctx: SelectionContext) -> tuple[str, str]:
    """(path, why): "w8a8" (block-scaled FP8 GEMM on FP8 tensor cores),
    "weight_only" (float8 weights dequantized inside the GEMM) or, on GPUs
    whose Triton takes no float8 pointer (below sm_89: A100, A10, 3090),
    "weight_only_bits" (the e4m3 bytes loaded as uint8 and decoded to floats
    inside the GEMM), from the accelerator's FP8 support and capability."""
    info = ctx.accelerator.info() if ctx.accelerator is not None else None
    if info is None:
        return "weight_only", "no accelerator in the context"
    cap = info.capability or "unknown capability"
    if info.fp8 == "native" and info.device_type == "cuda":
        return "w8a8", f"{info.device_name or info.device_type} {cap} reports native FP8: block-scaled W8A8 (128x128 weight blocks, 1x128 activation groups); per-tensor FP8 weights run weight-only"
    if info.device_type == "cuda":
        parsed = _capability(info.capability)
        if parsed is None or parsed < FP8_POINTERS_FROM:
            return "weight_only_bits", (
                f"{info.device_name or 'GPU'} {cap} has no FP8 tensor cores and Triton takes no float8 pointer below sm_89: "
                "FP8 bytes loaded as uint8 and decoded to floats inside the GEMM"
            )
        return "weight_only", f"{info.device_name or 'GPU'} {cap} has no native FP8 (W8A8 needs sm_90 or newer): FP8 weights dequantized inside the GEMM"
    return "weight_only", f"{info.device_type} (fp8 {info.fp8}) under the Triton interpreter: FP8 weights dequantized inside the GEMM"


class TritonBackend(Backend):
    """Triton kernels for attention, MoE experts, rms_norm and FP8 GEMMs."""

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        reasons = []
        if importlib.util.find_spec("triton") is None:
            reasons.append("triton is not installed (a CUDA build of torch brings the triton it was built with; pip install triton otherwise)")
        if importlib.util.find_spec("torch") is None:
            reasons.append("torch is not installed")
        acc = ctx.accelerator
        if acc is not None:
            device_type = getattr(acc, "device_type", "")
            if device_type != "cuda" and not _interpreting():
                reasons.append(
                    f"its kernels run on CUDA GPUs; the chosen device is {device_type or 'unknown'} "
                    "(set TRITON_INTERPRET=1 to run them in Triton's interpreter on CPU tensors: tests only, slow)"
                )
            elif device_type == "cuda":
                info = acc.info()
                if ctx.dtype is not None and str(ctx.dtype) == "torch.bfloat16" and "bfloat16" not in info.dtypes:
                    reasons.append(f"{info.device_name} {info.capability} has no bfloat16 (sm_80 or newer); use --dtype float16")
        if ctx.dtype is not None and str(ctx.dtype).removeprefix("torch.") not in DTYPES:
            reasons.append(f"dtype {ctx.dtype} is not one of {', '.join(DTYPES)}")
        return reasons

    @classmethod
    def unsupported_ops(cls, ctx: SelectionContext) -> Mapping[str, str]:
        # every op it has runs for every config check() accepts; what it never
        # had is taken from the reference by declaration (FROM_REFERENCE)
        return {}

    @classmethod
    def attention_backend(cls, ctx: SelectionContext) -> type[AttentionBackend[Any]]:
        from plinth_plugin_triton.attention import TritonAttention

        return TritonAttention

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        from plinth_plugin_triton import fp8, moe, norm

        ref = self.reference
        missing = [op for op in ("linear", "pack_linear") if op not in ref]
        if missing:
            raise PluginError(f"triton takes {', '.join(missing)} from the reference backend, which is not available")
        for op, reason in FROM_REFERENCE.items():
            log.info("backend triton: %s from the reference: %s", op, reason)
        path, why = fp8_path(self.ctx)
        log.info("backend triton: FP8 linear path %s: %s", path, why)
        ref_pack, ref_linear = ref["pack_linear"], ref["linear"]

        def pack_linear(weight: Any) -> Any:
            if isinstance(weight, QuantizedWeight) and weight.format == "fp8_e4m3":
                return fp8.pack(weight, path)
            return ref_pack(weight)

        def linear(x: Any, weight: Any, bias: Any = None) -> Any:
            if type(weight) is fp8.FP8Linear:
                return fp8.linear(x, weight, bias)
            return ref_linear(x, weight, bias)

        return dict(rms_norm=norm.rms_norm, fused_moe=moe.fused_moe, pack_linear=pack_linear, linear=linear)

    @classmethod
    def capabilities(cls, ctx: SelectionContext) -> BackendCapabilities:
        path, why = fp8_path(ctx)
        return BackendCapabilities(fp8=path, fp8_why=why)
