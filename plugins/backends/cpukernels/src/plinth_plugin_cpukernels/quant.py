"""Linear layers on GGUF weights kept in their quantized blocks (csrc/quant_ops.cpp).

``pack`` turns a ``QuantizedWeight`` of format ``gguf_<type>`` (its qweight the
file's rows of blocks, uint8 [out, in / block * bytes]) into a ``GGUFLinear``;
``linear`` then runs, by the number of activation rows M:

* M < ``GEMM_MIN_ROWS``: the integer kernel (activations quantized to int8 per
  block, integer dot products with the weight blocks), reading the weights
  once at their quantized size: decode and small batches;
* otherwise (prefill): a tile of weight rows at a time dequantized by the C++
  kernel into a bfloat16 (or float32) scratch and multiplied by oneDNN's GEMM,
  so prefill runs at matmul speed. The crossover was measured on this
  project's 2-core AVX-512 VNNI machine (bench/gguf_quant.py --crossover,
  SmolLM2's shapes, one thread): the integer kernel is faster up to 8 rows
  (2-5x at 1 row), even at 12, and the GEMM from 16 on (2-3x at 64). The
  integer kernel's cost grows with each row (its work is the multiplies, not
  the weight reads, once the weights are in cache).

torch is imported inside functions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable

SOURCE = Path(__file__).parent / "csrc" / "quant_ops.cpp"
FUNCTIONS = ["gguf_linear", "gguf_dequantize", "gguf_kernel_path", "zeros_on_large_pages"]

#: GGUF type name -> (the kernels' format code, weights per block, bytes per block)
GGUF_FORMATS = {
    "Q4_0": (0, 32, 18),
    "Q4_1": (1, 32, 20),
    "Q8_0": (2, 32, 34),
    "Q4_K": (3, 256, 144),
    "Q5_K": (4, 256, 176),
    "Q6_K": (5, 256, 210),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
}
#: activation rows from which linear dequantizes a tile and runs a GEMM
GEMM_MIN_ROWS = 12
#: bytes of dequantized weights per GEMM tile (stays in L2/L3)
GEMM_TILE_BYTES = 4 << 20


def load_quant_kernels(isa: Iterable[str], verbose: bool = False) -> Any:
    """The compiled GGUF kernels for these instruction sets (their own extension)."""
    from plinth_plugin_cpukernels.kernels import load_extension

    return load_extension(SOURCE, FUNCTIONS, isa, prefix="plinth_cpukernels_quant", verbose=verbose)


def format_name(fmt: str) -> str | None:
    """``gguf_q4_1`` -> ``Q4_1`` when it is a format these kernels run, else None."""
    if not fmt.startswith("gguf_"):
        return None
    name = fmt.removeprefix("gguf_").upper()
    return name if name in GGUF_FORMATS else None


class GGUFLinear:
    """A GGUF weight in its file blocks, with what linear needs to know."""

    __slots__ = ("blocks", "code", "type_name", "out_features", "in_features", "dense", "fused")

    def __init__(self, blocks: Any, type_name: str, shape: tuple[int, int]) -> None:
        import torch

        code, block, nbytes = GGUF_FORMATS[type_name]
        n, k = int(shape[0]), int(shape[1])
        if k % block or tuple(blocks.shape) != (n, k // block * nbytes) or blocks.dtype != torch.uint8:
            raise ValueError(f"GGUF {type_name} weight of shape {(n, k)}: blocks must be uint8 [{n}, {k // block * nbytes}], got {blocks.dtype} {tuple(blocks.shape)}")
        self.blocks = blocks.contiguous()
        self.code = code
        self.type_name = type_name
        self.out_features, self.in_features = n, k
        #: the weight dequantized once and packed for oneDNN (``GGUFOps.dense_budget``),
        #: which batches of ``GEMM_MIN_ROWS`` rows and more multiply; None: they
        #: dequantize a tile at a time on every call
        self.dense: Any = None
        #: deterministic mode: the blocks repacked for the fused kernel (gemm.py
        #: ``SmallGemm.fused_gguf_pack``), bit-identical to ``dense``; None: ``dense`` serves every batch
        self.fused: Any = None

    def nbytes(self) -> int:
        """Bytes a decode step reads: the blocks (the dense copy serves only large batches)."""
        return self.blocks.numel()

    def dequantize(self, kernels: Any, bf16: bool, rows: tuple[int, int] | None = None) -> Any:
        begin, end = rows or (0, self.out_features)
        return kernels.gguf_dequantize(self.blocks, self.code, self.in_features, begin, end, bf16)


def pack(weight: Any) -> GGUFLinear | None:
    """A GGUFLinear for a ``QuantizedWeight`` of a GGUF format these kernels run, else None."""
    type_name = format_name(str(getattr(weight, "format", "")))
    if type_name is None:
        return None
    return GGUFLinear(weight.qweight, type_name, weight.shape)


def make_gguf_linear(kernels: Any, *, bf16_gemm: bool, gemm_min_rows: int = GEMM_MIN_ROWS, invariant: bool = False) -> Callable[..., Any]:
    """linear(x, w: GGUFLinear, bias) -> x @ w.T (+ bias) in x's dtype.
    ``invariant`` (deterministic mode): the integer kernel for every M, each
    row summed in one order, so a row's result never depends on the batch."""
    import torch

    gguf_linear, gguf_dequantize = kernels.gguf_linear, kernels.gguf_dequantize

    def linear(x: Any, w: GGUFLinear, bias: Any = None) -> Any:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        m = x2.shape[0]
        if invariant or m < gemm_min_rows:
            y = gguf_linear(x2, w.blocks, w.code, invariant)
        else:
            # prefill: dequantize a tile of rows, GEMM; bf16 where oneDNN runs it natively
            bf16 = bf16_gemm and x2.dtype == torch.bfloat16
            xg = x2 if bf16 or x2.dtype == torch.float32 else x2.float()
            n, k = w.out_features, w.in_features
            tile = max(1, GEMM_TILE_BYTES // (k * (2 if bf16 else 4)))
            if tile >= n:
                y = torch.mm(xg, gguf_dequantize(w.blocks, w.code, k, 0, n, bf16).t())
            else:
                y = torch.empty(m, n, dtype=xg.dtype)
                for n0 in range(0, n, tile):
                    n1 = min(n, n0 + tile)
                    y[:, n0:n1] = torch.mm(xg, gguf_dequantize(w.blocks, w.code, k, n0, n1, bf16).t())
            y = y.to(x2.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*shape[:-1], w.out_features)

    return linear


def gguf_kernel_path(isa: Iterable[str]) -> str:
    """The code path a build for these instruction sets compiles (the same
    choice as the #if chain of quant_ops.cpp; a test checks they agree)."""
    isa = set(isa)
    if {"avx2", "fma"} <= isa:
        if {"avx512_vnni", "avx512vl"} <= isa:
            return "avx512-vnni (256-bit vpdpbusd)"
        if "avx_vnni" in isa:
            return "avx-vnni (vpdpbusd)"
        return "avx2+fma (vpmaddubsw)"
    return "scalar"


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


#: the share of the memory available at the first GGUF weight that dense
#: copies for large batches (and their fused records) may take
DENSE_COPY_SHARE = 0.25
#: deterministic mode's path for GGUF weights: "dense" (the default: their
#: dense copies where they fit) or "integer" (GGUFOps)
DETERMINISTIC_PATH_ENV = "PLINTH_CPU_DETERMINISTIC_GGUF"


class GGUFOps:
    """pack and linear for GGUF weights; the kernels are built on the first
    GGUF weight (a model without one never waits for that compiler run).

    Dequantizing a tile on every call makes a batch of 16 rows cost twice a
    dense bf16 step (each call writes the whole weight out again), so while
    they fit in a quarter of the memory available at load, weights also keep
    a dequantized copy in oneDNN's packed layout (``dense_pack``) that the
    backend's linear takes for batches of ``GEMM_MIN_ROWS`` rows and more
    (prefill, concurrent decode); decode batches still read only the blocks.
    Beyond that budget, the tiles.

    Deterministic mode (``invariant``): the integer kernel and the dense copy
    round differently, so each weight keeps one path for every batch: its
    dense copy (the streaming kernel, batch-invariant, gemm.py) while copies
    fit the budget, else the integer kernel, each row summed in one order
    whatever M. Measured (bench/batch_invariant.py, SmolLM2-135M's step of
    121 linears, Q4_1 + Q8_0 head, bf16, one thread, loaded 2-core AMD EPYC
    Zen 4): the dense copy costs 2.2x the default at 1 row (it reads 16 bits
    a weight, not 4.5) and 1.1x / 1.0x at 16 / 64 rows; the integer kernel
    1.09x at 1 row but 2.0x / 2.8x at 16 / 64 (about 56 GFLOP/s where bf16
    streams at ~190). ``PLINTH_CPU_DETERMINISTIC_GGUF=integer`` takes the
    integer kernel for every weight (small batches, little memory). With a
    dense copy, ``fused_pack`` (gemm.py) also repacks the blocks for a kernel
    bit-identical to the dense copy's that small batches take (it reads the
    blocks, not 16 bits a weight)."""

    def __init__(
        self,
        isa: Iterable[str],
        bf16_gemm: bool,
        *,
        dense_pack: Callable[[Any], Any] | None = None,
        dense_dtype: Any = None,
        invariant: bool = False,
        fused_pack: Callable[[GGUFLinear], Any] | None = None,
    ) -> None:
        self.isa = tuple(isa)
        self.bf16_gemm = bf16_gemm
        #: deterministic mode: each weight takes one path for every batch (see the class doc)
        self.invariant = invariant
        if invariant and os.environ.get(DETERMINISTIC_PATH_ENV, "dense") == "integer":
            dense_pack = dense_dtype = None
        self.dense_pack, self.dense_dtype = dense_pack, dense_dtype
        #: a weight's records for the fused kernel, beside its dense copy (``fused_pack`` decides where)
        self.fused_pack = fused_pack
        self.dense_budget: int | None = None
        self._kernels: Any = None
        self._linear: Callable[..., Any] | None = None

    def pack(self, weight: Any) -> GGUFLinear:
        if self._linear is None:
            self._kernels = load_quant_kernels(self.isa)
            self._linear = make_gguf_linear(self._kernels, bf16_gemm=self.bf16_gemm, invariant=self.invariant)
            self.dense_budget = int(_available_memory() * DENSE_COPY_SHARE)
        packed = pack(weight)
        assert packed is not None
        # a copy on 2 MB pages (csrc/common.h): decode steps stream the blocks,
        # which the loader leaves in the file's memory map on 4 KB pages
        blocks = self._kernels.zeros_on_large_pages(list(packed.blocks.shape), packed.blocks.dtype)
        packed.blocks = blocks.copy_(packed.blocks)
        if self.dense_pack is not None and self.dense_dtype is not None:
            import torch

            bf16 = self.dense_dtype == torch.bfloat16
            size = packed.out_features * packed.in_features * (2 if bf16 else 4)
            if self.dense_budget is not None and size <= self.dense_budget:
                self.dense_budget -= size
                packed.dense = self.dense_pack(packed.dequantize(self._kernels, bf16))
                if packed.dense is not None and self.fused_pack is not None:
                    packed.fused = self.fused_pack(packed)
                    if packed.fused is not None:  # its records (~0.3-0.5x the blocks' dense size) share the budget
                        self.dense_budget -= packed.fused.numel() * packed.fused.element_size()
        return packed

    def linear(self, x: Any, weight: GGUFLinear, bias: Any = None) -> Any:
        assert self._linear is not None, "a GGUFLinear comes from pack"
        return self._linear(x, weight, bias)
