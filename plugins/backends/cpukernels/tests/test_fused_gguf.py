"""The fused-dequant GGUF kernel (csrc/linear_ops.cpp ``gguf_fused_linear``,
deterministic mode's path for few rows): bit for bit the dense streaming
kernel on the weight's bfloat16 dense copy, for every M, so deterministic
mode can split batches between the two by size; builds without it (AVX2)
do not offer it, and the backend takes it only where it exists."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from plinth.api import QuantizedWeight, SelectionContext, load_accelerator
from plinth.testing import op_table
from plinth_plugin_cpukernels.backend import accelerator_isa, bf16_gemm_missing
from plinth_plugin_cpukernels.gemm import (
    AMX_ENV,
    FUSED_GGUF_ROWS,
    FUSED_GGUF_ROWS_ENV,
    VDPBF16PS_PATH,
    SmallGemm,
    fused_gguf_rows,
    linear_kernel_path,
    load_linear_kernels,
)
from plinth_plugin_cpukernels.quant import GEMM_MIN_ROWS, GGUF_FORMATS, load_quant_kernels

sys.path.insert(0, os.path.dirname(__file__))
from test_quant import random_blocks  # noqa: E402
from test_small_gemm import AVX2, NATIVE, X86, amx_kernels  # noqa: E402

CPU = load_accelerator("cpu")
FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
#: (N, K): N not a multiple of 16, K not a multiple of 256; SmolLM2's o projection
SHAPES = [(17, 32), (40, 96), (100, 288), (33, 800), (576, 576)]
ROWS = [1, 2, 3, 4, 7, 8, 9, 16]
NATIVE_HAS_IT = linear_kernel_path(NATIVE) == VDPBF16PS_PATH


def _blocks(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Quantized by gguf, with every 7th block's scale an f16 subnormal (the
    dequantized values' smallest magnitudes) and Q4_1/Q5_1 minimums of both signs."""
    blocks, _ = random_blocks(name, n, k, seed)
    _, _, nbytes = GGUF_FORMATS[name]
    view = blocks.view(n, k // 32, nbytes)
    rng = np.random.default_rng(seed)
    view[:, ::7, 0:2] = torch.from_numpy(np.frombuffer(rng.integers(1, 0x3FF, view[:, ::7, 0].numel()).astype(np.uint16).tobytes(), np.uint8).copy()).view(view[:, ::7, 0:2].shape)
    if name in ("Q4_1", "Q5_1"):
        m = rng.uniform(-2, 2, (n, k // 32)).astype(np.float16)
        view[:, :, 2:4] = torch.from_numpy(np.frombuffer(m.tobytes(), np.uint8).copy()).view(n, k // 32, 2)
    return blocks


def _check_fused_equals_dense(lin, name: str, dense_linear, fused_linear, rows: list[int]):
    """For each shape: ``fused_linear`` on the records gives ``dense_linear``'s
    bits on the dense copy (with and without bias); returns each shape's (N, K, blocks, records)."""
    quant = load_quant_kernels(NATIVE)
    code = GGUF_FORMATS[name][0]
    packed = []
    for i, (n, k) in enumerate(SHAPES):
        blocks = _blocks(name, n, k, seed=i)
        dense = lin.linear_pack(quant.gguf_dequantize(blocks, code, k, 0, n, True))
        fused = lin.gguf_fused_pack(blocks, code, n, k)
        torch.manual_seed(i)
        bias = torch.randn(n).to(torch.bfloat16)
        for m in rows:
            x = (torch.randn(m, k) * 3).to(torch.bfloat16)
            for b in (None, bias):
                want = dense_linear(x, dense, n, k, b)
                got = fused_linear(x, fused, code, n, k, b)
                assert torch.equal(got, want), f"{name} N={n} K={k} M={m} bias={b is not None}: max diff {(got.float() - want.float()).abs().max()}"
        packed.append((n, k, blocks, fused))
    return packed


@pytest.mark.skipif(not NATIVE_HAS_IT, reason="the fused kernel needs the AVX512-BF16 build (this CPU lacks avx512_bf16 or avx512bw)")
@pytest.mark.parametrize("name", FORMATS)
def test_fused_equals_the_dense_streaming_kernel(name):
    lin, quant = load_linear_kernels(NATIVE), load_quant_kernels(NATIVE)
    code = GGUF_FORMATS[name][0]
    assert code in list(lin.gguf_fused_formats())
    for n, k, blocks, fused in _check_fused_equals_dense(lin, name, lin.linear_small, lin.gguf_fused_linear, ROWS):
        # and it is the weight: against F.linear on the dense copy, to bf16 rounding
        x = torch.randn(3, k).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), quant.gguf_dequantize(blocks, code, k, 0, n, True).float())
        torch.testing.assert_close(lin.gguf_fused_linear(x, fused, code, n, k, None).float(), ref, rtol=1.6e-2, atol=1e-2 * ref.abs().amax().item())


def test_fused_amx_equals_the_dense_amx_kernel():
    """On AMX tiles: the records dequantized into B tiles give the bits of
    the AMX kernel on the dense copy, so deterministic mode splits batches
    between the two there too."""
    lin = amx_kernels()
    for name in FORMATS:
        packed = _check_fused_equals_dense(lin, name, lin.linear_amx, lin.gguf_fused_linear_amx, ROWS + [17, 33])
    fused = packed[-1][3]
    with pytest.raises(RuntimeError, match="do not match"):
        lin.gguf_fused_linear_amx(torch.randn(2, 64).bfloat16(), fused, GGUF_FORMATS[FORMATS[-1]][0], 40, 64, None)


@pytest.mark.skipif(not NATIVE_HAS_IT, reason="the fused kernel needs the AVX512-BF16 build")
def test_fused_rejects_bad_input():
    lin = load_linear_kernels(NATIVE)
    blocks = _blocks("Q4_1", 20, 64, seed=0)
    fused = lin.gguf_fused_pack(blocks, 1, 20, 64)
    with pytest.raises(RuntimeError, match="bfloat16"):
        lin.gguf_fused_linear(torch.randn(2, 64), fused, 1, 20, 64, None)
    with pytest.raises(RuntimeError, match="do not match"):
        lin.gguf_fused_linear(torch.randn(2, 64).bfloat16(), fused, 1, 40, 64, None)
    with pytest.raises(RuntimeError, match="Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0"):
        lin.gguf_fused_pack(blocks, 3, 20, 64)


@pytest.mark.skipif(not (X86 and {"avx2", "fma"} <= set(NATIVE)), reason="needs an x86 CPU with AVX2+FMA")
def test_avx2_build_does_not_offer_it():
    """Narrowed to AVX2+FMA the dense streaming kernel widens pairs to fp32:
    no fused kernel there, so deterministic mode keeps the dense copy."""
    lin = load_linear_kernels(AVX2)
    assert list(lin.gguf_fused_formats()) == []
    blocks = _blocks("Q4_1", 20, 64, seed=0)
    with pytest.raises(RuntimeError, match="no fused GGUF kernel"):
        lin.gguf_fused_linear(torch.randn(1, 64).bfloat16(), lin.gguf_fused_pack(blocks, 1, 20, 64), 1, 20, 64, None)
    assert SmallGemm(AVX2, invariant=True).fused_gguf_pack(blocks, 1, 20, 64) is None


def test_the_default_mode_takes_it_on_amx_tiles_only(monkeypatch):
    """Deterministic mode always (where the build has it); the default mode
    only where the records run on AMX tiles, which beat the integer kernel."""
    blocks = _blocks("Q4_1", 20, 64, seed=0)
    det = SmallGemm(NATIVE, invariant=True)
    assert det.fused_gguf_rows == FUSED_GGUF_ROWS["amx" if det.amx() else "vdpbf16ps"] == fused_gguf_rows(det.amx())
    assert SmallGemm(NATIVE).fused_gguf_rows == 0
    monkeypatch.setenv(FUSED_GGUF_ROWS_ENV, "3")
    assert det.fused_gguf_rows == 3
    monkeypatch.delenv(FUSED_GGUF_ROWS_ENV)
    small = SmallGemm(NATIVE)
    assert (small.fused_gguf_pack(blocks, 1, 20, 64) is not None) == small.amx()
    # Q5_0: deterministic mode takes its records, the default mode keeps the integer kernel (faster at 1 row)
    q5 = _blocks("Q5_0", 20, 64, seed=0)
    assert (SmallGemm(NATIVE, invariant=True).fused_gguf_pack(q5, 6, 20, 64) is not None) == NATIVE_HAS_IT
    assert small.fused_gguf_pack(q5, 6, 20, 64) is None
    monkeypatch.setenv(AMX_ENV, "0")
    assert SmallGemm(NATIVE).fused_gguf_pack(blocks, 1, 20, 64) is None


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_default_mode_runs_small_batches_on_the_records_with_amx(name):
    """Default mode, bf16, on AMX tiles: up to GEMM_MIN_ROWS - 1 rows on the
    fused records (the same bits as the AMX kernel on the records), more on
    the dense copy; without AMX the records are not kept."""
    if bf16_gemm_missing(accelerator_isa(SelectionContext(accelerator=CPU))):
        pytest.skip("this CPU cannot run oneDNN bf16 GEMMs: cpukernels leaves bf16 linear to the reference")
    ops = op_table(SelectionContext(accelerator=CPU, dtype=torch.bfloat16), "cpukernels")
    n, k = 100, 512
    blocks, _ = random_blocks(name, n, k)
    weight = ops.pack_linear(QuantizedWeight(format=f"gguf_{name.lower()}", qweight=blocks, scale=torch.empty(0), shape=(n, k), block_size=(1, 32)))
    assert weight.dense is not None
    if not SmallGemm(NATIVE).amx():
        assert weight.fused is None
        return
    lin = load_linear_kernels(NATIVE)
    torch.manual_seed(0)
    for m in (1, GEMM_MIN_ROWS - 1):
        x = torch.randn(m, k).to(torch.bfloat16)
        assert torch.equal(ops.linear(x, weight), lin.gguf_fused_linear_amx(x, weight.fused, weight.code, n, k, None))
    x = torch.randn(GEMM_MIN_ROWS, k).to(torch.bfloat16)  # the dense copy: the AMX kernel up to 32 rows, the same bits
    assert torch.equal(ops.linear(x, weight), lin.gguf_fused_linear_amx(x, weight.fused, weight.code, n, k, None))


@pytest.mark.parametrize("amx", ["", "0"], ids=["amx-if-here", "amx-off"])
@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "Q8_0", "Q4_K"])
def test_backend_splits_batches_between_fused_and_dense(name, amx, monkeypatch):
    """Through the op table: few rows on the fused records, more on the dense
    copy, and every row the same bits alone or in any batch (the split is at
    fused_gguf_rows rows, by where the records run); K-quants have no fused kernel."""
    if bf16_gemm_missing(accelerator_isa(SelectionContext(accelerator=CPU))):
        pytest.skip("this CPU cannot run oneDNN bf16 GEMMs: cpukernels leaves bf16 linear to the reference")
    monkeypatch.setenv(AMX_ENV, amx)
    ops = op_table(SelectionContext(accelerator=CPU, dtype=torch.bfloat16, deterministic=True), "cpukernels")
    n, k = 100, 512
    blocks, _ = random_blocks(name, n, k)
    block = 256 if name.endswith("_K") else 32
    weight = ops.pack_linear(QuantizedWeight(format=f"gguf_{name.lower()}", qweight=blocks, scale=torch.empty(0), shape=(n, k), block_size=(1, block)))
    assert weight.dense is not None
    assert (weight.fused is not None) == (NATIVE_HAS_IT and name in FORMATS)
    rows = fused_gguf_rows(SmallGemm(NATIVE).amx())  # PLINTH_CPU_AMX as set above
    torch.manual_seed(0)
    x = torch.randn(2 * rows + 3, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    whole = ops.linear(x, weight, bias)
    for i in range(x.shape[0]):
        assert torch.equal(ops.linear(x[i : i + 1], weight, bias), whole[i : i + 1]), f"row {i}"
    small = ops.linear(x[:rows], weight, bias)
    assert torch.equal(small, whole[:rows])
    # leading dims are flattened (2-D inputs skip the reshape): the same rows, the same bits
    assert torch.equal(ops.linear(x[: rows - rows % 2].view(2, -1, k), weight, bias).reshape(-1, n), whole[: rows - rows % 2])
    if weight.fused is not None:  # which path ran: zeroed records give the bias alone, to few rows only
        weight.fused = torch.zeros_like(weight.fused)
        assert torch.equal(ops.linear(x[:rows], weight, bias), bias.expand(rows, n))
        assert torch.equal(ops.linear(x[: rows + 1], weight, bias), whole[: rows + 1])
        assert torch.equal(ops.linear(x, weight, bias), whole)


def test_dense_copy_budget_counts_the_fused_records(monkeypatch):
    """The dense copies' share of memory pays for their fused records too: a
    budget of two dense copies and a little holds one copy and its records,
    and the second weight keeps its blocks alone."""
    from plinth_plugin_cpukernels import quant

    n, k = 100, 512
    dense = n * k * 2
    records = torch.zeros(123, dtype=torch.uint8)
    monkeypatch.setattr(quant, "_available_memory", lambda: int((2 * dense + 100) / quant.DENSE_COPY_SHARE))
    ops = quant.GGUFOps(NATIVE, True, dense_pack=lambda w: w, dense_dtype=torch.bfloat16, invariant=True, fused_pack=lambda w: records)
    blocks, _ = random_blocks("Q4_1", n, k)
    packed = [ops.pack(QuantizedWeight(format="gguf_q4_1", qweight=blocks, scale=torch.empty(0), shape=(n, k), block_size=(1, 32))) for _ in range(2)]
    assert packed[0].dense is not None and packed[0].fused is records
    assert ops.dense_budget == dense + 100 - records.numel()
    assert packed[1].dense is None and packed[1].fused is None
