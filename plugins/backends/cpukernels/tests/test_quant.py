"""GGUF weights in their quantized blocks (csrc/quant_ops.cpp): every format
on every code path this CPU can run (the native build, the AVX2 build of a
narrowed instruction set, the portable scalar build).

Tolerances:
* dequantization is exact (bit for bit against the ``gguf`` package's numpy
  dequantizer);
* the integer kernel against the same arithmetic done in float64 on the
  activations quantized as the kernel does, by llama.cpp's rules (int8 per
  block of 32 with a float16 scale, or per 256 for K-quants with
  d = 1 / (-127 / max)): 1e-4 of the largest output. This checks the
  integer dot products and offsets exactly, up to float rounding;
* against plain ``x @ dequantized.T``: 2e-2 of the largest output, the error
  8-bit activation quantization brings (half a step, amax / 254, per value;
  llama.cpp has the same).
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from plinth.api import QuantizedWeight, SelectionContext
from plinth_plugin_cpukernels.quant import (
    GGUF_FORMATS,
    GGUFLinear,
    gguf_kernel_path,
    load_quant_kernels,
    make_gguf_linear,
)

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

X86 = platform.machine().lower() in ("x86_64", "amd64")
AVX2_ISA = ("sse4_2", "avx", "avx2", "fma", "f16c")


def _native_isa() -> tuple[str, ...]:
    from plinth_plugin_cpu.isa import effective_isa

    return tuple(effective_isa())


def _paths() -> list:
    paths = [pytest.param("native", id="native")]
    if X86 and set(AVX2_ISA) <= set(_native_isa()):
        paths.append(pytest.param("avx2", id="avx2"))
    paths.append(pytest.param("scalar", id="scalar"))
    return paths


def _isa(path: str) -> tuple[str, ...]:
    return {"native": _native_isa(), "avx2": AVX2_ISA, "scalar": ()}[path]


@pytest.fixture(scope="module", params=_paths())
def kernels(request):
    return request.param, load_quant_kernels(_isa(request.param))


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return np.frombuffer(a.astype(np.float16).tobytes(), np.uint8).reshape(*a.shape, 2)


def random_blocks(name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [n, row bytes], the same dequantized by gguf, float32 [n, k]).
    Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 by gguf's quantizer; K-quants (gguf has no quantizer for
    them) as random bytes with sane scales: every byte pattern is a valid block."""
    rng = np.random.default_rng(seed)
    qtype = getattr(GGMLQuantizationType, name)
    _, block, nbytes = GGUF_FORMATS[name]
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        q = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    else:
        q = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
        if name in ("Q4_K", "Q5_K"):
            q[..., 0:2] = _f16_bytes(rng.uniform(0.001, 0.01, (n, k // block)))
            q[..., 2:4] = _f16_bytes(rng.uniform(0.001, 0.01, (n, k // block)))
        else:
            q[..., 208:210] = _f16_bytes(rng.uniform(0.0005, 0.002, (n, k // block)))
        q = q.reshape(n, -1)
    dense = torch.from_numpy(np.ascontiguousarray(quants.dequantize(q, qtype), dtype=np.float32)).reshape(n, k)
    return torch.from_numpy(np.ascontiguousarray(q)), dense


def quantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x as the kernel sees it, by llama.cpp's rules (float64 out). Blocks of
    32 (quantize_row_q8_0): d = amax / 127 rounded to float16, q = round(x *
    (127 / amax)). Blocks of 256 (quantize_row_q8_K_ref): max the signed value
    of largest magnitude, iscale = -127 / max, q = round(iscale * x), d = 1 / iscale.
    (Divisions by a tensor: torch computes ``scalar / t`` as a reciprocal times
    the scalar, which rounds differently.)"""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    amax, at = xb.abs().max(-1, keepdim=True)
    if block == 32:
        d = (amax / 127).half().float()
        q = torch.round(xb * torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax)))
    else:
        top = torch.gather(xb, -1, at)
        iscale = torch.where(amax > 0, torch.full_like(top, -127.0) / top, torch.zeros_like(top))
        q = torch.round(xb * iscale).clamp(max=127)
        d = torch.where(amax > 0, torch.ones_like(iscale) / iscale, torch.zeros_like(iscale))
    return (q * d).reshape(m, k).double()


def q8_1_minimum_term(x: torch.Tensor, blocks: torch.Tensor, name: str) -> torch.Tensor:
    """Q4_1/Q5_1: what llama.cpp's q8_1 changes in the minimum's term
    (m times the activation block's d * sum, float16-rounded from the
    unrounded d) against ``quantized_activations`` (float16 d times the sum),
    [M, N] float64; zeros for the other formats."""
    m, k = x.shape
    n = blocks.shape[0]
    if name not in ("Q4_1", "Q5_1"):
        return torch.zeros(m, n, dtype=torch.float64)
    nbytes = GGUF_FORMATS[name][2]
    mins = torch.from_numpy(blocks.numpy().reshape(n, k // 32, nbytes)[..., 2:4].copy().view(np.float16)[..., 0]).double()
    xb = x.float().reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1)
    q = torch.round(xb * torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))[..., None])
    d32 = amax / 127
    sums = q.sum(-1)
    s_f16 = (d32 * sums).half().double()
    return (s_f16 - d32.half().double() * sums.double()) @ mins.t()


def _k(name: str) -> int:
    return 768 if name.endswith("_K") else 288  # 3 super-blocks / 9 blocks: odd counts


@pytest.mark.parametrize("name", list(GGUF_FORMATS))
def test_dequantize_is_exact(kernels, name):
    _, k = kernels
    code = GGUF_FORMATS[name][0]
    blocks, dense = random_blocks(name, 37, _k(name))
    assert torch.equal(k.gguf_dequantize(blocks, code, _k(name), 0, 37, False), dense)
    torch.testing.assert_close(k.gguf_dequantize(blocks, code, _k(name), 5, 20, True), dense[5:20].bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("m", [1, 3, 5, 11, 64])
@pytest.mark.parametrize("name", list(GGUF_FORMATS))
def test_integer_kernel(kernels, name, m, invariant):
    _, k = kernels
    code, block, _ = GGUF_FORMATS[name]
    K, N = _k(name), 37
    blocks, dense = random_blocks(name, N, K, seed=m)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    y = k.gguf_linear(x, blocks, code, invariant)
    exact = quantized_activations(x, 256 if block == 256 else 32) @ dense.double().t() + q8_1_minimum_term(x, blocks, name)
    scale = exact.abs().max().item()
    assert (y.double() - exact).abs().max().item() <= 1e-4 * scale
    plain = x.double() @ dense.double().t()
    assert (y.double() - plain).abs().max().item() <= 2e-2 * plain.abs().max().item()
    yb = k.gguf_linear(x.bfloat16(), blocks, code, invariant)  # bf16 in and out
    assert yb.dtype == torch.bfloat16
    assert (yb.double() - plain).abs().max().item() <= 3e-2 * plain.abs().max().item()


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_linear_switches_to_a_gemm_for_large_batches(kernels, name):
    """M >= gemm_min_rows: tiles dequantized, then a GEMM (float32 here:
    exact up to summation order); tiles smaller than the weight too."""
    import plinth_plugin_cpukernels.quant as quant

    _, k = kernels
    K, N = _k(name), 37
    blocks, dense = random_blocks(name, N, K)
    w = GGUFLinear(blocks, name, (N, K))
    x = torch.randn(2, 33, K)
    linear = make_gguf_linear(k, bf16_gemm=False, gemm_min_rows=32)
    bias = torch.randn(N)
    torch.testing.assert_close(linear(x, w, bias), x @ dense.t() + bias, rtol=1e-4, atol=1e-4)
    old = quant.GEMM_TILE_BYTES
    quant.GEMM_TILE_BYTES = 10 * K * 4  # 10 rows a tile
    try:
        torch.testing.assert_close(linear(x, w), x @ dense.t(), rtol=1e-4, atol=1e-4)
    finally:
        quant.GEMM_TILE_BYTES = old
    small = linear(x[:, :3], w)  # the integer kernel
    assert small.shape == (2, 3, N)


def test_the_compiled_path_is_the_predicted_one(kernels):
    path, k = kernels
    assert k.gguf_kernel_path() == gguf_kernel_path(_isa(path))
    if path == "scalar":
        assert k.gguf_kernel_path() == "scalar"
    if path == "avx2":
        assert k.gguf_kernel_path().startswith("avx2")


def test_a_weight_that_does_not_fit_is_refused():
    blocks, _ = random_blocks("Q4_1", 4, 64)
    with pytest.raises(ValueError, match="blocks must be uint8"):
        GGUFLinear(blocks, "Q4_1", (4, 96))


def test_the_backend_keeps_gguf_weights_in_blocks():
    """pack_linear takes a QuantizedWeight of format gguf_<type> to a
    GGUFLinear; its capabilities name the types and the path; other formats and
    plain tensors are packed as before."""
    from plinth.api import load_accelerator
    from plinth_plugin_cpukernels.backend import CPUKernelsBackend

    accelerator = load_accelerator("cpu")
    ctx = SelectionContext(accelerator=accelerator, dtype=torch.float32)
    from plinth_plugin_torch.backend import TorchBackend

    reference = TorchBackend(SelectionContext(accelerator=accelerator, dtype=torch.float32)).ops()
    backend = CPUKernelsBackend(ctx, reference)
    ops = backend.ops()
    formats, path = CPUKernelsBackend.capabilities(ctx).gguf_formats, CPUKernelsBackend.capabilities(ctx).gguf_path
    assert "gguf_formats" not in ops
    assert set(formats) >= {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    assert gguf_kernel_path(accelerator.info().isa) in path
    blocks, dense = random_blocks("Q8_0", 40, 96)
    packed = ops["pack_linear"](QuantizedWeight(format="gguf_q8_0", qweight=blocks, scale=torch.empty(0), shape=(40, 96), block_size=(1, 32)))
    assert type(packed) is GGUFLinear and packed.nbytes() == blocks.numel()
    x = torch.randn(2, 96)
    torch.testing.assert_close(ops["linear"](x, packed), x @ dense.t(), rtol=0, atol=2e-2 * (x @ dense.t()).abs().max().item())
    plain = ops["pack_linear"](dense)
    torch.testing.assert_close(ops["linear"](x, plain), x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_platform_plugins_shows_the_gguf_formats_and_path(capsys):
    """What start-up hands the GGUF loader, as `platform plugins` shows it for this CPU."""
    import json

    from plinth.api import load_accelerator
    from plinth.cli import main

    assert main(["plugins", "--json", "--device", "cpu"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out)["plugins"] if r["name"] == "cpukernels")
    path = gguf_kernel_path(load_accelerator("cpu").info().isa)
    assert row["status"] == "ok" and row["capabilities"], row
    for caps in row["capabilities"].values():
        assert set(caps["gguf_formats"]) >= {"Q4_0", "Q8_0", "Q4_K", "Q6_K"} and path in caps["gguf_path"]
        assert caps["fp8"] == ""
    assert main(["plugins", "--device", "cpu"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("backend") and " cpukernels " in ln)
    assert "kept in blocks: integer dot products on the blocks, " + path in line, line
    # --deterministic runs the blocks another way (a dense copy per weight, quant.GGUFOps): said apart
    det = row["deterministic_capabilities"]
    assert set(det) == set(row["capabilities"]), det
    for caps in det.values():
        assert caps["gguf_path"].startswith("a dense copy per weight") and path in caps["gguf_path"], caps
    assert "--deterministic in bfloat16, GGUF blocks: a dense copy per weight" in line, line


def test_large_batches_use_the_dense_copy_and_small_ones_the_blocks(monkeypatch):
    """With the model's dtype known, pack keeps a dequantized, packed copy
    (within the memory budget; streaming and oneDNN layouts, as a dense
    weight) that batches of GEMM_MIN_ROWS rows and more multiply exactly as
    the dequantized weight; smaller batches run the
    integer kernel on the blocks. Without budget, no copy: the tiles."""
    from plinth.api import load_accelerator
    from plinth_plugin_cpukernels import quant
    from plinth_plugin_cpukernels.backend import CPUKernelsBackend
    from plinth_plugin_cpukernels.gemm import SMALL_ROWS, PackedLinear, linear_kernel_path
    from plinth_plugin_torch.backend import TorchBackend

    accelerator = load_accelerator("cpu")
    ctx = SelectionContext(accelerator=accelerator, dtype=torch.float32)
    blocks, dense = random_blocks("Q4_1", 48, 128, seed=3)
    weight = QuantizedWeight(format="gguf_q4_1", qweight=blocks, scale=torch.empty(0), shape=(48, 128), block_size=(1, 32))
    ops = CPUKernelsBackend(ctx, TorchBackend(ctx).ops()).ops()
    packed = ops["pack_linear"](weight)
    assert type(packed.dense) is PackedLinear
    # the dense copy has its streaming copy too (up to small_rows rows), and oneDNN's beyond
    if SMALL_ROWS[linear_kernel_path(accelerator.info().isa)]["float32"] > 0:  # not on the scalar build
        assert packed.dense.small is not None and packed.dense.small_rows >= quant.GEMM_MIN_ROWS
    for rows in (quant.GEMM_MIN_ROWS, packed.dense.small_rows + 1):
        big = torch.randn(rows, 128)
        torch.testing.assert_close(ops["linear"](big, packed), big @ dense.t(), rtol=1e-5, atol=1e-4)
    small = torch.randn(3, 128)
    want = small @ dense.t()
    got = ops["linear"](small, packed)  # int8 activations: close, not exact as the dense copy is
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())
    assert (got - want).abs().max().item() > 1e-4
    monkeypatch.setattr(quant, "DENSE_COPY_SHARE", 0.0)
    ops = CPUKernelsBackend(ctx, TorchBackend(ctx).ops()).ops()
    assert ops["pack_linear"](weight).dense is None
    torch.testing.assert_close(ops["linear"](big, ops["pack_linear"](weight)), big @ dense.t(), rtol=1e-5, atol=1e-4)
