"""The cpukernels backend: what it does better than the reference, per op,
decided from the instruction sets the accelerator reports.

Its capabilities declare ``gguf_formats``: the GGUF types whose
``QuantizedWeight`` (format ``gguf_<type>``) ``pack_linear`` keeps in their
blocks, and how ``linear`` runs them (``gguf_path``, quant.py). Model loaders
that find them keep GGUF weights quantized."""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Mapping

from plinth.api import AttentionBackend, Backend, BackendCapabilities, PluginError, QuantizedWeight, SelectionContext

from plinth_plugin_cpukernels.gemm import (
    DTYPE_NAMES,
    VDPBF16PS_PATH,
    PackedLinear,
    SmallGemm,
    amx_allowed,
    fused_gguf_rows,
    kernel_grants_amx,
    linear_kernel_path,
    make_fused_gguf_linear,
    make_linear,
    pack_linear,
)
from plinth_plugin_cpukernels.kernels import compiler_missing
from plinth_plugin_cpukernels.probe import ProbeResult, usable_isa
from plinth_plugin_cpukernels.quant import (
    DENSE_COPY_SHARE,
    GEMM_MIN_ROWS,
    GGUF_FORMATS,
    GGUFLinear,
    GGUFOps,
    format_name,
    gguf_kernel_path,
)

#: deterministic mode's measured cost on the serving benchmark (bench/serve_compare.py, SmolLM2-135M
#: Q4_1 GGUF, bf16, 2 quiet cores; docs/benchmarks.md "Deterministic mode's cost")
AMX_COST = (
    "measured no cost with AMX: 1.10x the default's output tok/s at concurrency 1 and 1.11x at 16 "
    "(SmolLM2 GGUF, bf16, Intel Xeon with AMX, 2 cores)"
)
VDPBF16PS_COST = (
    "measured no cost on vdpbf16ps: 1.01x the default's output tok/s at concurrency 1 and 1.00x at 16 "
    "(SmolLM2 GGUF, bf16, AMD EPYC Zen 4 with AVX512-BF16, 2 cores)"
)
NOT_MEASURED = "not measured under 5% without AVX512-BF16 (the fused GGUF kernel and the bf16 streaming kernel need it)"
AMX_OFF = (
    "off with AMX tiles left unused (PLINTH_CPU_AMX=0, Linux does not grant them, or the start-up probe refused them): "
    "the vdpbf16ps kernel there runs at a fraction of oneDNN's AMX GEMMs from 8 rows up"
)
#: oneDNN runs bfloat16 GEMMs only with one of these (torch checks the same
#: before its bf16 path and raises otherwise): AVX-512 BW+VL+DQ, AVX-NE-CONVERT
#: on x86, the BF16 extension on aarch64
BF16_GEMM_ISA = (("avx512bw", "avx512vl", "avx512dq"), ("avx_ne_convert",), ("bf16",))


def claimed_isa(ctx: SelectionContext) -> tuple[str, ...] | None:
    """The instruction sets the accelerator reports, or None when none is chosen yet."""
    if ctx.accelerator is None:
        return None
    return tuple(getattr(ctx.accelerator.info(), "isa", ()) or ())


def kernel_probe(ctx: SelectionContext) -> ProbeResult | None:
    """What the start-up probes left of the claimed instruction sets (probe.py:
    each kernel path run once in a child process; cached per build and machine)."""
    isa = claimed_isa(ctx)
    if isa is None or compiler_missing():
        return None
    return usable_isa(isa)


def accelerator_isa(ctx: SelectionContext) -> tuple[str, ...] | None:
    """The instruction sets the kernels are built for: the accelerator's,
    less the paths its probes refused; None when none is chosen yet."""
    probed = kernel_probe(ctx)
    return probed.isa if probed is not None else claimed_isa(ctx)


def bf16_gemm_missing(isa: tuple[str, ...]) -> str | None:
    if any(set(group) <= set(isa) for group in BF16_GEMM_ISA):
        return None
    return (
        "oneDNN's bfloat16 GEMMs need avx512bw+avx512vl+avx512dq or avx_ne_convert (x86) or bf16 (aarch64), "
        f"and this CPU reports {','.join(isa) or 'none of them'}"
    )


def amx_tiles(isa: tuple[str, ...]) -> bool:
    """Whether the linear kernels' build for ``isa`` runs bf16 on AMX tiles:
    the CPU has them, Linux grants them to this process, and PLINTH_CPU_AMX
    leaves them on (what ``SmallGemm.amx`` finds once the kernels load)."""
    return {"avx512_bf16", "avx512bw", "amx_tile", "amx_bf16"} <= set(isa) and amx_allowed() and kernel_grants_amx()


#: "1": paged attention over bf16 pages on AMX tiles where the linears take
#: them (csrc/cpu_ops.cpp, attend_tile_amx). Off by default: on the Intel Xeon
#: with AMX it runs a 128-row prefill chunk's attention in 0.46-0.50x the
#: vector kernel's time but decodes in 0.96-1.31x (bench/decode_attention.py
#: --amx off,on; docs/benchmarks.md), so it pays where long prompts dominate.
#: Either path is batch-invariant; a process takes one for every call.
AMX_ATTENTION_ENV = "PLINTH_CPU_AMX_ATTENTION"


def amx_attention(isa: tuple[str, ...]) -> bool:
    """Whether paged attention runs bf16 pages on AMX tiles here."""
    return os.environ.get(AMX_ATTENTION_ENV, "").strip() == "1" and amx_tiles(isa)


def deterministic_default(isa: tuple[str, ...], dtype: Any, claimed: tuple[str, ...] | None = None) -> tuple[bool, str]:
    """Whether deterministic mode is on by default here, and the measurement
    behind it (docs/benchmarks.md, "Deterministic mode's cost"): on with
    bfloat16 where the linears run batch-invariant at the default's speed,
    on AMX tiles or on vdpbf16ps (the fused GGUF records for few rows, the
    streaming kernel, as fast as oneDNN from 1 to 256 rows on AMD Zen 4, for
    the rest: gemm.py); off on CPUs with AMX whose tiles stay unused (their
    vdpbf16ps is slow), and elsewhere (AVX-512F without BF16, AVX2, other
    CPUs), where the streaming kernel replaces oneDNN for large batches
    unmeasured. ``claimed``: what the CPU reports, where ``isa`` is what its
    probes left (AMX claimed but refused counts as AMX left unused)."""
    if str(dtype) != "torch.bfloat16":
        return False, "measured in bfloat16 only (float32 is off by default)"
    if amx_tiles(isa):
        return True, AMX_COST
    if {"amx_tile", "amx_bf16"} <= set(claimed or isa):
        return False, AMX_OFF
    if linear_kernel_path(isa) == VDPBF16PS_PATH:
        return True, VDPBF16PS_COST
    return False, NOT_MEASURED


class CPUKernelsBackend(Backend):
    """GEMMs, decode attention and the small per-layer ops for CPUs; the rest
    (and what a kernel does not cover) from the reference."""

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        from plinth_plugin_cpukernels.kernels import compiler_missing

        reasons = []
        on_cpu = ctx.accelerator is not None and getattr(ctx.accelerator, "device_type", "") == "cpu"
        if ctx.accelerator is not None and not on_cpu:
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
        elif on_cpu and not reasons:  # its kernels would be built: the probes say whether any path runs
            probed = kernel_probe(ctx)
            if probed is not None and probed.error:
                reasons.append(probed.error)
        return reasons

    @classmethod
    def unsupported_ops(cls, ctx: SelectionContext) -> Mapping[str, str]:
        isa = accelerator_isa(ctx)
        if isa is None or ctx.dtype is None or str(ctx.dtype) != "torch.bfloat16":
            return {}
        why = bf16_gemm_missing(isa)
        return {"pack_linear": why, "linear": why} if why else {}

    @classmethod
    def capabilities(cls, ctx: SelectionContext) -> BackendCapabilities:
        isa = accelerator_isa(ctx)
        if isa is None:
            return BackendCapabilities()
        probed = kernel_probe(ctx)
        dropped = probed.dropped if probed is not None else ()
        if "linear" in cls.unsupported_ops(ctx):
            return BackendCapabilities(dropped_paths=dropped)
        integer = f"integer dot products on the blocks, {gguf_kernel_path(isa)}"
        on, why = deterministic_default(isa, ctx.dtype, claimed_isa(ctx))
        mode = {"deterministic_default": on, "deterministic_why": why, "dropped_paths": dropped}
        amx = amx_tiles(isa)
        if not ctx.deterministic:
            if str(ctx.dtype) == "torch.bfloat16" and amx:  # the fused records on AMX tiles beat the integer kernel
                integer = f"up to {GEMM_MIN_ROWS - 1} rows the fused kernel on AMX tiles where it has the format, else {integer}"
            return BackendCapabilities(gguf_formats=tuple(GGUF_FORMATS), gguf_path=integer, **mode)
        # deterministic mode: one path per weight for every batch (ops() below, quant.GGUFOps)
        if str(ctx.dtype) == "torch.bfloat16" and linear_kernel_path(isa) == VDPBF16PS_PATH:
            tiles = "; both on AMX tiles" if amx else ""
            small = f"up to {fused_gguf_rows(amx)} rows the fused kernel on the blocks where it has the format (bit-identical), more rows the copy{tiles}"
        else:
            small = "every batch on the copy"
        path = f"a dense copy per weight within {DENSE_COPY_SHARE:.0%} of the memory, {small}; past that budget, {integer} in one order per row"
        return BackendCapabilities(gguf_formats=tuple(GGUF_FORMATS), gguf_path=path, **mode)

    @classmethod
    def attention_backend(cls, ctx: SelectionContext) -> type[AttentionBackend[Any]]:
        from plinth_plugin_cpukernels.attention import CPUKernelsAttention

        return CPUKernelsAttention

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        import torch.nn.functional as F

        from plinth_plugin_cpukernels.elementwise import make_elementwise_ops
        from plinth_plugin_cpukernels.kernels import load_kernels

        isa = accelerator_isa(self.ctx)
        if isa is None:
            raise PluginError("cpukernels needs the accelerator in its context: its kernels are built for its instruction sets")
        unsupported = self.unsupported_ops(self.ctx)
        ops: dict[str, Callable[..., Any]] = {}
        if "linear" not in unsupported:
            # weights it does not pack (quantized ones) keep the reference's packing and linear
            ref_pack = self.reference.get("pack_linear", lambda w: w)
            ref_linear = self.reference.get("linear", F.linear)

            bf16_gemm = bf16_gemm_missing(isa) is None
            # decode batches: the streaming kernel (gemm.py); deterministic mode: every batch,
            # and GGUF weights always through the integer kernel in one order per row (quant.py)
            invariant = self.ctx.deterministic
            small = SmallGemm(isa, invariant=invariant)
            dense_linear = make_linear(ref_linear, small)
            # large batches on GGUF weights: a dequantized copy in the compute dtype, packed like any
            # dense weight (the streaming copy too: 12-16 rows run 1.5x faster there than in oneDNN)
            dtype = self.ctx.dtype
            dense_dtype = dtype if str(dtype) in ("torch.float32", "torch.bfloat16") and (bf16_gemm or str(dtype) == "torch.float32") else None

            def dense_pack(w: Any) -> Any:
                packed = pack_linear(w, bf16=bf16_gemm, small=small)
                return packed if type(packed) is PackedLinear else None

            def fused_pack(w: GGUFLinear) -> Any:
                return small.fused_gguf_pack(w.blocks, w.code, w.out_features, w.in_features)

            bf16_dense = str(dense_dtype) == "torch.bfloat16"
            gguf = GGUFOps(isa, bf16_gemm, dense_pack=dense_pack, dense_dtype=dense_dtype, invariant=invariant, fused_pack=fused_pack if bf16_dense else None)
            # deterministic mode: a GGUF weight with a dense copy streams it for every batch (quant.py),
            # up to fused_rows rows through the fused kernel on its blocks (bit-identical, gemm.py);
            # the default mode: records only on AMX tiles (gemm.py), below the dense copy's rows
            dense_rows = 0 if invariant else GEMM_MIN_ROWS
            fused_rows = small.fused_gguf_rows if invariant else GEMM_MIN_ROWS - 1
            fused_linear = make_fused_gguf_linear(small)

            def pack(weight: Any) -> Any:
                if isinstance(weight, QuantizedWeight) and format_name(weight.format):
                    return gguf.pack(weight)
                packed = pack_linear(weight, bf16=bf16_gemm, small=small)
                return packed if type(packed) is PackedLinear else ref_pack(weight)

            def linear(x: Any, weight: Any, bias: Any = None) -> Any:
                if type(weight) is GGUFLinear:
                    if weight.fused is not None and x.numel() <= fused_rows * weight.in_features:
                        return fused_linear(x, weight, bias)
                    if weight.dense is not None and x.numel() >= dense_rows * weight.in_features:
                        return dense_linear(x, weight.dense, bias)
                    return gguf.linear(x, weight, bias)
                return dense_linear(x, weight, bias)

            ops.update({"pack_linear": pack, "linear": linear})
        kernels = load_kernels(isa)
        if all(op in self.reference for op in ("rms_norm", "silu_and_mul", "rotary")):
            ops.update(make_elementwise_ops(kernels, self.reference))
        return ops
