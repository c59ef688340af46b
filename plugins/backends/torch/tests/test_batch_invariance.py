"""Deterministic mode (``SelectionContext.deterministic``): the reference's
linear (dense and dequantized weights), rms_norm, silu_and_mul, rotary and
fused_moe give each row bit for bit the same result alone and among 1-64
other rows, at any position (``plinth.testing.invariance``). The reference
serves every op a backend declines in this mode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from plinth.api import QuantizedWeight, SelectionContext
from plinth.testing.invariance import ROWWISE_OPS, batch_invariance_problems, rowwise_invariance_problems
from plinth_plugin_torch.backend import TorchBackend

DTYPES = [torch.bfloat16, torch.float32]
POOL = 64


def _ops(dtype):
    return TorchBackend(SelectionContext(dtype=dtype, deterministic=True)).ops()


def _assert_invariant(fn, *rows):
    problems = batch_invariance_problems(fn, rows)
    assert not problems, f"{len(problems)} batches differ: " + "; ".join(problems[:6])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(576, 576), (200, 1537)], ids=str)
def test_linear(dtype, shape):
    ops = _ops(dtype)
    torch.manual_seed(0)
    n, k = shape
    weight = ops["pack_linear"](torch.randn(n, k).to(dtype) / k**0.5)
    bias = torch.randn(n).to(dtype)
    x = torch.randn(POOL, k).to(dtype)
    _assert_invariant(lambda x: ops["linear"](x, weight, bias), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_quantized_linear(dtype, fmt):
    ops = _ops(dtype)
    torch.manual_seed(1)
    n, k = 192, 256
    dense = torch.randn(n, k)
    qweight = dense.to(torch.float8_e4m3fn) if fmt == "fp8_e4m3" else (dense * 40).clamp(-127, 127).to(torch.int8)
    weight = ops["pack_linear"](QuantizedWeight(format=fmt, qweight=qweight, scale=torch.rand(n) / 50, shape=(n, k)))
    _assert_invariant(lambda x: ops["linear"](x, weight), torch.randn(POOL, k).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ROWWISE_OPS)
def test_rowwise_op(dtype, op):
    ops = SimpleNamespace(**_ops(dtype))
    # 4096: a batch of 16 leaves rms_norm's small-input route
    for hidden in (576, 4096) if op.startswith("rms_norm") else (576,):
        problems = rowwise_invariance_problems(ops, op, dtype, hidden=hidden, pool=POOL)
        assert not problems, f"{op} (hidden {hidden}): {len(problems)} batches differ: " + "; ".join(problems[:6])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_moe(dtype):
    ops = _ops(dtype)
    torch.manual_seed(5)
    experts, hidden, inter, top_k = 8, 128, 96, 2
    w13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype)
    x = torch.randn(POOL, hidden).to(dtype)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(POOL)])
    weights = torch.rand(POOL, top_k).to(dtype)
    _assert_invariant(lambda x, w, i: ops["fused_moe"](x, w13, w2, w, i), x, weights, ids)
