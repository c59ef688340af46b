"""Deterministic mode (``SelectionContext.deterministic``): every linear and
row-wise op of the cpukernels op table (as start-up merges it with the
reference's) gives each row bit for bit the same result alone and among
1-64 other rows, at any position (``plinth.testing.invariance``): dense
weights in bfloat16 and float32, the GGUF formats kept in their blocks with
bfloat16 and float32 activations (through their dense copies or the
integer kernel), rms_norm (with and without the fused
residual), silu_and_mul and rotary."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from plinth.api import QuantizedWeight, SelectionContext, load_accelerator
from plinth.testing import op_table
from plinth.testing.invariance import ROWWISE_OPS, batch_invariance_problems, rowwise_invariance_problems
from plinth_plugin_cpukernels.backend import CPUKernelsBackend, accelerator_isa, bf16_gemm_missing
from plinth_plugin_cpukernels.gemm import ALL_ROWS, AMX_ENV, linear_kernel_path, load_linear_kernels
from plinth_plugin_cpukernels.quant import DETERMINISTIC_PATH_ENV

sys.path.insert(0, os.path.dirname(__file__))
from test_quant import random_blocks  # noqa: E402
from test_small_gemm import BUILDS, NATIVE, amx_kernels  # noqa: E402

CPU = load_accelerator("cpu")
DTYPES = [torch.bfloat16, torch.float32]
POOL = 64
#: (N, K): SmolLM2's o projection; a K that is odd and an N not a multiple of 16
DENSE_SHAPES = [(576, 576), (200, 577)]
GGUF_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]


def _ops(dtype):
    if dtype == torch.bfloat16 and bf16_gemm_missing(accelerator_isa(SelectionContext(accelerator=CPU))):
        pytest.skip("this CPU cannot run oneDNN bf16 GEMMs: cpukernels leaves bf16 linear to the reference")
    ctx = SelectionContext(accelerator=CPU, dtype=dtype, deterministic=True)
    assert "linear" not in CPUKernelsBackend.unsupported_ops(ctx)
    return op_table(ctx, "cpukernels")


def _assert_invariant(fn, *rows):
    problems = batch_invariance_problems(fn, rows)
    assert not problems, f"{len(problems)} batches differ: " + "; ".join(problems[:6])


@pytest.mark.parametrize("amx", ["", "0"], ids=["amx-if-here", "amx-off"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=str)
def test_dense_linear(dtype, shape, amx, monkeypatch):
    """bf16 weights with K a multiple of 32 run on AMX tiles where the CPU
    has them (PLINTH_CPU_AMX=0: the vdpbf16ps kernel), the rest streams."""
    monkeypatch.setenv(AMX_ENV, amx)
    ops = _ops(dtype)
    torch.manual_seed(0)
    n, k = shape
    weight = ops.pack_linear(torch.randn(n, k).to(dtype) / k**0.5)
    assert weight.packed is None and weight.small_rows == ALL_ROWS  # every batch streams, no oneDNN copy
    amx_here = amx != "0" and bool(load_linear_kernels(NATIVE).linear_amx_available())
    assert weight.amx == (amx_here and dtype == torch.bfloat16 and k % 32 == 0)
    bias = torch.randn(n).to(dtype)
    x = torch.randn(POOL, k).to(dtype)
    _assert_invariant(lambda x: ops.linear(x, weight), x)
    _assert_invariant(lambda x: ops.linear(x, weight, bias), x)


@pytest.mark.parametrize("n", [16, 200])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("isa", BUILDS, ids=lambda isa: linear_kernel_path(isa))
def test_streaming_kernel_on_every_code_path(isa, dtype, n):
    """The kernel deterministic mode runs for every batch, built for each
    code path this CPU can run (the scalar one too: aarch64 takes it). 16
    outputs are one block, which every row group then takes alone (the
    scalar code once summed it in another order next to 3 or more rows)."""
    k = load_linear_kernels(isa)
    torch.manual_seed(5)
    kdim = 577
    packed = k.linear_pack(torch.randn(n, kdim).to(dtype))
    _assert_invariant(lambda x: k.linear_small(x, packed, n, kdim, None), torch.randn(POOL, kdim).to(dtype))


def test_amx_kernel():
    """The kernel bf16 weights take on CPUs with AMX, directly: 1-64 rows (row tiles of 16, a padded last one)."""
    k = amx_kernels()
    torch.manual_seed(6)
    n, kdim = 200, 576
    packed = k.linear_pack(torch.randn(n, kdim).bfloat16())
    bias = torch.randn(n).bfloat16()
    _assert_invariant(lambda x: k.linear_amx(x, packed, n, kdim, bias), torch.randn(POOL, kdim).bfloat16())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("path", ["dense", "integer"])
def test_gguf_linear(dtype, type_name, path, monkeypatch):
    """Both paths of deterministic mode: the weight's dense copy for every
    batch (the default), or the integer kernel for every batch."""
    monkeypatch.setenv(DETERMINISTIC_PATH_ENV, path)
    ops = _ops(dtype)
    k = 512 if type_name.endswith("_K") else 576
    blocks, _ = random_blocks(type_name, 96, k)
    block = 256 if type_name.endswith("_K") else 32
    weight = ops.pack_linear(
        QuantizedWeight(format=f"gguf_{type_name.lower()}", qweight=blocks, scale=torch.empty(0), shape=(96, k), block_size=(1, block))
    )
    assert type(weight).__name__ == "GGUFLinear"  # kept in its blocks
    assert (weight.dense is None) == (path == "integer")
    torch.manual_seed(1)
    x = torch.randn(POOL, k).to(dtype)
    _assert_invariant(lambda x: ops.linear(x, weight), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ROWWISE_OPS)
def test_rowwise_op(dtype, op):
    ops = _ops(dtype)
    for hidden in (576, 100) if op.startswith("rms_norm") else (576,):
        problems = rowwise_invariance_problems(ops, op, dtype, hidden=hidden, pool=POOL)
        assert not problems, f"{op} (hidden {hidden}): {len(problems)} batches differ: " + "; ".join(problems[:6])
