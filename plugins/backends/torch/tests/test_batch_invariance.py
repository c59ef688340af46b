"""Deterministic mode (``SelectionContext.deterministic``): the reference's
linear (dense and dequantized weights), rms_norm, silu_and_mul, rotary and
fused_moe give each row bit for bit the same result alone and among 1-64
other rows, at any position (``plinth.testing.invariance``). The reference
serves every op a backend declines in this mode."""

from __future__ import annotations

import pytest
import torch
from plinth.api import QuantizedWeight, SelectionContext
from plinth.testing.invariance import batch_invariance_problems
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
@pytest.mark.parametrize("hidden", [576, 4096])  # 4096: a batch of 16 leaves the small-input route
def test_rms_norm(dtype, hidden):
    ops = _ops(dtype)
    torch.manual_seed(2)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    x, residual = torch.randn(POOL, hidden).to(dtype), torch.randn(POOL, hidden).to(dtype)
    _assert_invariant(lambda x: ops["rms_norm"](x, weight, 1e-5), x)
    _assert_invariant(lambda x, r: ops["rms_norm"](x, weight, 1e-5, r), x, residual)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype):
    ops = _ops(dtype)
    torch.manual_seed(3)
    _assert_invariant(ops["silu_and_mul"], torch.randn(POOL, 2 * 1536).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary(dtype, is_neox):
    ops = _ops(dtype)
    torch.manual_seed(4)
    d = 64
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(256).float()[:, None] * inv[None]
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1)
    q, k = torch.randn(POOL, 9, d).to(dtype), torch.randn(POOL, 3, d).to(dtype)
    positions = torch.randint(0, 256, (POOL,))
    _assert_invariant(lambda q, k, p: ops["rotary"](q, k, p, cos_sin, is_neox), q, k, positions)


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
