"""Dense linear layers: oneDNN's packed GEMM, and a streaming kernel of our
own for few rows (csrc/linear_ops.cpp).

Each weight is re-blocked once at load time into oneDNN's preferred layout;
``linear`` then runs oneDNN's kernel on it. On the 2-core AVX-512 machines
measured here that doubles batch-1 GEMV bandwidth in bfloat16 (about 20 ->
40 GB/s on cached weights) and helps small batches; bfloat16 results are
bit-identical to ``F.linear``.

For decode batches (up to ``SMALL_ROWS`` activation rows, by kernel path and
dtype) a second copy of the weight, repacked for streaming (bf16: pairs
``[N/16][K/2][16][2]`` that one 64-byte load feeds to ``vdpbf16ps`` for 16
outputs; fp32: ``[N/16][K][16]``), is multiplied by ``linear_small``: rows x
blocks of 16 outputs held in registers over the whole K (up to 16 rows
share each weight load, so a decode batch streams every weight line once;
software prefetch 48 lines ahead into L1 and, on the vdpbf16ps and AVX2
paths, 128 lines ahead into L2), fp32 accumulation,
``at::parallel_for`` over the output blocks, the code path chosen at compile
time from the instruction sets (AVX512-BF16, AVX-512F, AVX2+FMA, scalar). Its
bfloat16 results match ``F.linear`` to bfloat16 rounding, not bit for bit
(another summation order).

The rule is fixed, from ``bench/small_gemm.py`` (one thread,
``time.thread_time``, on a loaded 2-core AMD EPYC Zen 4 with avx512_bf16).
``--step``: the 121 linears of a SmolLM2-135M decode step (random weights,
read from memory as in decode), ours and oneDNN alternating step by step,
oneDNN's time over ours at 1, 2, 4, 8, 16 rows: bf16 1.50, 1.45, 1.13, 1.19,
1.13; fp32 1.60, 1.67, 1.29, 1.35, 1.12; the AVX2+FMA build
(``PLINTH_CPU_ISA=avx2,fma ONEDNN_MAX_CPU_ISA=AVX2``, fp32) 1.65, 1.96, 1.94,
1.76, 1.44. Per shape (without ``--step``) the one loss is the 49152-row
lm_head at 16 rows in bf16 (0.9x); at 32 rows and more bf16 runs at par with
oneDNN (both about 190 GFLOP/s a thread here) and fp32 at 0.9x, so larger
batches stay with oneDNN, whose kernels may also use instructions (AMX) that
these do not. The scalar build (aarch64 and others) never takes it. Both
copies are kept only while the streaming copies fit ``SMALL_COPY_SHARE`` of
the memory available at the first weight; beyond it oneDNN runs every batch.
``PLINTH_CPU_SMALL_GEMM_ROWS`` overrides the row limit (0: off), for
comparisons. torch is imported inside functions.

Deterministic mode (``SmallGemm(invariant=True)``) runs the streaming kernel
for every batch and keeps no oneDNN copy: each output is one fp32
accumulator per row, summed over K in order whatever the number of rows or
the register tile (``nr_for``), so a row's result never depends on its
batch, on every code path including the scalar one; oneDNN's kernels
choose their blocking (and so the order) by M. Its cost is the streaming
kernel's time over oneDNN's above ``SMALL_ROWS`` (``bench/small_gemm.py
--step 3 --rows 1,16,64,256``, SmolLM2-135M's 121 linears, one thread,
loaded 2-core AMD EPYC Zen 4): bf16 0.97x at 64 rows, 1.11x at 256; fp32
1.11x at 64, 1.19x at 256; nothing up to 16 rows (the same kernel).

CPUs with AMX (``amx_tile`` + ``amx_bf16``, Sapphire Rapids and later): the
vdpbf16ps kernel runs at about 60 GFLOP/s a thread there and oneDNN's AMX
kernels beat it from 8 rows up (0.45x at 16 rows, 0.11x at 256), so bf16
weights whose K is a multiple of 32 take ``linear_amx`` instead: the same
packed copy read as TDPBF16PS tiles (16 pair lines of a block are one B
tile), 4 blocks of 16 outputs per group, one C tile row per output summed
over K in order whatever the rows, so it is batch-invariant too (not
bit-identical to the vdpbf16ps kernel: each weight keeps one of the two).
``bench/small_gemm.py --step 3`` (SmolLM2-135M's 121 linears, one thread,
Intel Xeon with AMX, 2 cores, the other busy with CI): ms/step at 1, 16, 32,
64, 128 rows: AMX 26-29, 24-33, 44, 62-74, 61; vdpbf16ps 23-26, 67-79, 149,
319-439, 531; oneDNN 30-42, 34-55, 82, 59-62, 58. The default mode
therefore takes it up to ``AMX_ROWS`` rows and oneDNN above; deterministic
mode takes it for every batch (``PLINTH_CPU_AMX=0``: off). The fused GGUF
records run on AMX tiles too (``gguf_fused_linear_amx``: each block
dequantized in registers into a B tile, bit-identical to the dense copy's).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

from plinth_plugin_cpukernels.quant import GGUF_FORMATS

DTYPE_NAMES = ("bfloat16", "float32")

LINEAR_SOURCE = Path(__file__).parent / "csrc" / "linear_ops.cpp"
LINEAR_FUNCTIONS = ["linear_pack", "linear_small", "linear_kernel_path", "gguf_fused_pack", "gguf_fused_linear", "gguf_fused_formats", "linear_amx", "linear_amx_available", "gguf_fused_linear_amx"]

#: the code path of bf16 weights on AVX512-BF16 CPUs (linear_kernel_path's name,
#: the one linear_ops.cpp's linear_kernel_path() returns)
VDPBF16PS_PATH = "avx512-bf16 (vdpbf16ps)"
#: the largest number of activation rows the streaming kernel takes, by its
#: code path and the weight's dtype (beyond it, oneDNN): see the module doc
SMALL_ROWS = {
    VDPBF16PS_PATH: {"bfloat16": 16, "float32": 16},
    "avx512f (fp32 fma)": {"bfloat16": 16, "float32": 16},
    "avx2+fma (fp32 fma)": {"bfloat16": 16, "float32": 16},
    "scalar": {"bfloat16": 0, "float32": 0},  # portable code: oneDNN's JIT is faster
}
#: the share of the memory available at the first weight that the streaming
#: copies may take (they double the dense weights' memory)
SMALL_COPY_SHARE = 0.25
ROWS_ENV = "PLINTH_CPU_SMALL_GEMM_ROWS"
#: deterministic mode, GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights with a bfloat16 dense copy:
#: batches of up to this many rows take the fused kernel on the blocks, larger
#: ones the dense copy (bit-identical results, see ``SmallGemm.fused_gguf_pack``),
#: by where the two run. On AMX tiles the records cost at most the copy's time
#: up to 8 rows (bench/fused_q5.py, Intel Xeon: 12.9 vs 13.3 ms at 8). On
#: vdpbf16ps they win up to 4 and lose from 6 (bench/batch_invariant.py
#: --weights gguf, AMD EPYC Zen 4, one thread: 11.5 vs 17.6 ms a step at 4
#: rows, 18.5 vs 17.5 at 6, 24.3 vs 18.6 at 8): a record's dequantizing is
#: shared by fewer rows than the copy's loads.
FUSED_GGUF_ROWS = {"amx": 8, "vdpbf16ps": 4}
FUSED_GGUF_ROWS_ENV = "PLINTH_CPU_FUSED_GGUF_ROWS"
#: the GGUF formats (their quant.py codes) whose records the default
#: mode takes on AMX tiles below 12 rows: there they beat the integer kernel
#: at every small batch (Q4_1: 0.9x its time at 1 row, 0.3x at 8,
#: bench/batch_invariant.py). Q5_0's do at 2 rows and more (0.85x at 2, 0.33x
#: at 8) but not at 1 (1.18x, bench/fused_q5.py), the decode of one sequence:
#: its default stays the integer kernel (Intel Xeon with AMX, one thread).
DEFAULT_MODE_RECORDS = frozenset(GGUF_FORMATS[name][0] for name in ("Q4_0", "Q4_1", "Q8_0"))
#: the row limit of deterministic mode: every batch
ALL_ROWS = 1 << 62
#: bf16 weights on CPUs with AMX (``linear_amx``): the row limit in the default
#: mode (above it oneDNN, whose AMX kernels block for large M); deterministic
#: mode takes the AMX kernel for every batch. See the module doc.
AMX_ROWS = 32
#: "0" keeps the AMX kernel off (the vdpbf16ps kernel instead), for comparisons
AMX_ENV = "PLINTH_CPU_AMX"


def load_linear_kernels(isa: Iterable[str], verbose: bool = False) -> Any:
    """The small-M linear kernels for these instruction sets (their own extension)."""
    from plinth_plugin_cpukernels.kernels import load_extension

    return load_extension(LINEAR_SOURCE, LINEAR_FUNCTIONS, isa, prefix="plinth_cpukernels_linear", verbose=verbose)


def linear_kernel_path(isa: Iterable[str]) -> str:
    """The code path a build of linear_ops.cpp for these instruction sets
    compiles (the same choice as its #if chain; a test checks they agree)."""
    isa = set(isa)
    if "avx512f" in isa:
        if {"avx512_bf16", "avx512bw"} <= isa:
            return VDPBF16PS_PATH
        return "avx512f (fp32 fma)"
    if {"avx2", "fma"} <= isa:
        return "avx2+fma (fp32 fma)"
    return "scalar"


def _available_memory() -> int:
    from plinth_plugin_cpukernels.quant import _available_memory as available

    return available()


def amx_allowed() -> bool:
    """Whether ``PLINTH_CPU_AMX`` leaves the AMX kernel on (whether it runs also takes the CPU and the kernel)."""
    return os.environ.get(AMX_ENV, "").strip() != "0"


@functools.cache
def kernel_grants_amx() -> bool:
    """Whether Linux grants this process the AMX tile registers: the request
    the kernels make before their first tile (arch_prctl
    ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; process-wide, idempotent).
    The CPU's flags alone do not say it: Linux before 5.16, or a sandbox's
    syscall filter, refuses, and the kernels then stream with vdpbf16ps."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return False
    arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # x86_64 syscall number; asm/prctl.h
    return syscall(arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0


def fused_gguf_rows(amx: bool) -> int:
    """Deterministic mode's row limit for the fused GGUF kernel on AMX tiles
    or on vdpbf16ps (the setting's override, else ``FUSED_GGUF_ROWS``)."""
    override = os.environ.get(FUSED_GGUF_ROWS_ENV, "").strip()
    return int(override) if override else FUSED_GGUF_ROWS["amx" if amx else "vdpbf16ps"]


class SmallGemm:
    """Packs the streaming copies and says how many rows they serve; the
    kernels are built on the first weight that gets one."""

    def __init__(self, isa: Iterable[str], *, rows: dict[str, int] | None = None, budget: int | None = None, invariant: bool = False) -> None:
        self.isa = tuple(isa)
        self.path = linear_kernel_path(self.isa)
        self.rows = dict(rows if rows is not None else SMALL_ROWS.get(self.path, {}))
        override = os.environ.get(ROWS_ENV)
        if override is not None and override.strip():
            self.rows = {name: int(override) for name in DTYPE_NAMES}
        #: deterministic mode: every batch streams (batch-invariant), whatever the budget
        self.invariant = invariant
        if invariant:
            self.rows = {name: ALL_ROWS for name in DTYPE_NAMES}
        self.budget = budget
        self.kernels: Any = None
        self._fused_formats: frozenset[int] | None = None
        self._amx: bool | None = None

    @property
    def fused_gguf_rows(self) -> int:
        """Deterministic mode: rows up to which GGUF weights take the fused kernel (0: never)."""
        return fused_gguf_rows(self.amx()) if self.invariant else 0

    def rows_for(self, dtype: Any) -> int:
        return self.rows.get(str(dtype).removeprefix("torch."), 0)

    def amx(self) -> bool:
        """Whether bf16 weights run on AMX tiles here (the build, the CPU and
        the kernel grant them, and ``PLINTH_CPU_AMX`` does not say 0)."""
        if self._amx is None:
            if self.kernels is None:
                self.kernels = load_linear_kernels(self.isa)
            self._amx = amx_allowed() and bool(self.kernels.linear_amx_available())
        return self._amx

    def amx_for(self, weight: Any) -> bool:
        """Whether this [N, K] weight takes the AMX kernel (bf16, K a multiple of 32), for every batch it streams."""
        return str(weight.dtype) == "torch.bfloat16" and weight.shape[-1] % 32 == 0 and self.amx()

    def pack(self, weight: Any) -> Any:
        """The streaming copy of a [N, K] weight, or None (no rows, over budget)."""
        if self.rows_for(weight.dtype) <= 0:
            return None
        if self.budget is None:
            self.budget = int(_available_memory() * SMALL_COPY_SHARE)
        size = weight.numel() * weight.dtype.itemsize
        if size > self.budget and not self.invariant:  # invariant: the only copy, not a second one
            return None
        if self.kernels is None:
            self.kernels = load_linear_kernels(self.isa)
        self.budget -= size
        return self.kernels.linear_pack(weight)


    def fused_gguf_pack(self, blocks: Any, code: int, out_features: int, in_features: int) -> Any:
        """The fused kernel's records of a GGUF weight (its file blocks, format
        ``code`` as quant.py), or None: not deterministic mode, or this build
        has no fused kernel for the format (only the AVX512-BF16 build has one).

        Why (csrc/linear_ops.cpp): deterministic mode runs a GGUF weight from
        its bf16 dense copy through the streaming kernel, which reads 16 bits a
        weight where the blocks hold 4.5-8.5. The fused kernel reads the blocks
        (repacked into 16-row records), dequantizes them in registers to
        exactly the dense copy's bf16 values and runs the same vdpbf16ps
        sequence, so its results are bit-identical to the dense copy's for
        every batch and the two can share the batches by size. Other builds
        (AVX-512F, AVX2+FMA, scalar) do not offer it: the dense copy serves
        every batch there, as before.

        The default mode takes the records too where they run on AMX tiles,
        for the formats where they beat the integer kernel at every small
        batch (``DEFAULT_MODE_RECORDS``)."""
        if self.invariant and self.fused_gguf_rows <= 0:
            return None
        if not self.invariant and (not self.amx() or code not in DEFAULT_MODE_RECORDS):
            return None
        if self.kernels is None:
            self.kernels = load_linear_kernels(self.isa)
        if self._fused_formats is None:
            self._fused_formats = frozenset(int(c) for c in self.kernels.gguf_fused_formats())
        if code not in self._fused_formats:
            return None
        return self.kernels.gguf_fused_pack(blocks, code, out_features, in_features)


def make_fused_gguf_linear(small: SmallGemm) -> Callable[..., Any]:
    """linear(x, w, bias) on a GGUF weight's fused records (``w.fused``, from
    ``SmallGemm.fused_gguf_pack``) -> [..., out] bfloat16."""
    import torch

    fused_linear = None

    def linear(x: Any, weight: Any, bias: Any = None) -> Any:
        nonlocal fused_linear
        if fused_linear is None:
            # the dense copy's kernel decides: AMX tiles there, AMX tiles here (GGUF K is a multiple of 32)
            fused_linear = small.kernels.gguf_fused_linear_amx if small.amx() else small.kernels.gguf_fused_linear
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        flat = x.dim() == 2  # a model's [tokens, features]: no reshape and view (2 us of ~120 calls a step)
        shape = x.shape
        y = fused_linear(x if flat else x.reshape(-1, shape[-1]), weight.fused, weight.code, weight.out_features, weight.in_features, bias)
        return y if flat else y.view(*shape[:-1], weight.out_features)

    return linear


class PackedLinear:
    """A weight in oneDNN's blocked layout (and, for few rows, in the
    streaming layout), with what linear needs to know."""

    __slots__ = ("packed", "out_features", "in_features", "dtype", "small", "small_rows", "amx")

    def __init__(self, weight: Any, small: SmallGemm | None = None) -> None:
        import torch

        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        weight = weight.contiguous()
        # deterministic mode streams every batch: no oneDNN copy
        self.packed = None if small is not None and small.invariant else torch.ops.mkldnn._reorder_linear_weight(weight)
        self.small = small.pack(weight) if small is not None else None
        #: the streaming copy runs on AMX tiles (linear_amx), else the vdpbf16ps/FMA kernel (linear_small)
        self.amx = False
        #: batches of up to this many rows take the streaming copy
        self.small_rows = 0
        if small is not None and self.small is not None:
            self.amx = small.amx_for(weight)
            self.small_rows = small.rows_for(weight.dtype)
            if self.amx and not small.invariant and ROWS_ENV not in os.environ:
                self.small_rows = AMX_ROWS

    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize


def pack_linear(weight: Any, *, bf16: bool, small: SmallGemm | None = None) -> Any:
    """Pack plain CPU fp32 matrices, and bf16 ones when ``bf16`` (oneDNN can
    run them on this CPU); anything else is returned as is. With ``small``,
    also the streaming copy for few rows."""
    import torch

    names = DTYPE_NAMES if bf16 else ("float32",)
    if (
        isinstance(weight, torch.Tensor)
        and str(weight.dtype).removeprefix("torch.") in names
        and weight.dim() == 2
        and weight.device.type == "cpu"
    ):
        return PackedLinear(weight, small)
    return weight


def make_linear(reference_linear: Callable[..., Any], small: SmallGemm | None = None) -> Callable[..., Any]:
    import torch

    mkldnn_linear = torch.ops.mkldnn._linear_pointwise
    small_linear: Any = None
    amx_linear: Any = None

    def linear(x: Any, weight: Any, bias: Any = None) -> Any:
        nonlocal small_linear, amx_linear
        if type(weight) is PackedLinear:
            if x.dtype != weight.dtype:
                x = x.to(weight.dtype)
            flat = x.dim() == 2  # a model's [tokens, features]: no reshape and view (2 us of ~120 calls a step)
            shape = x.shape
            x2 = x if flat else x.reshape(-1, shape[-1])
            if x2.shape[0] <= weight.small_rows:
                if small_linear is None:
                    assert small is not None and small.kernels is not None, "a streaming copy comes from small.pack"
                    small_linear = small.kernels.linear_small
                    amx_linear = small.kernels.linear_amx
                kernel = amx_linear if weight.amx else small_linear
                y = kernel(x2, weight.small, weight.out_features, weight.in_features, bias)
            else:
                y = mkldnn_linear(x2, weight.packed, bias, "none", [], "")
            return y if flat else y.view(*shape[:-1], weight.out_features)
        return reference_linear(x, weight, bias)

    return linear
