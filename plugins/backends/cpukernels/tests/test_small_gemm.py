"""The streaming small-M linear kernel (csrc/linear_ops.cpp, gemm.py) against
F.linear in float32 on the same inputs, for each code path a build can take
(this CPU's set, AVX2+FMA, no AVX at all), and its place in the backend."""

import os
import platform
import sys

import pytest
import torch
import torch.nn.functional as F
from plinth.api import SelectionContext, load_accelerator
from plinth_plugin_cpukernels.backend import CPUKernelsBackend, accelerator_isa, bf16_gemm_missing
from plinth_plugin_cpukernels.gemm import (
    AMX_ENV,
    AMX_ROWS,
    ROWS_ENV,
    PackedLinear,
    SmallGemm,
    linear_kernel_path,
    load_linear_kernels,
)

CPU = load_accelerator("cpu")  # the real one: its instruction sets, narrowed or not
NATIVE = tuple(CPU.info().isa)
X86 = platform.machine().lower() in ("x86_64", "amd64")
AVX2 = ("sse4_2", "avx", "avx2", "fma")
BUILDS = [NATIVE]
if X86 and {"avx2", "fma"} <= set(NATIVE):
    BUILDS += [AVX2, ("sse4_2",)]  # the AVX2 path, and the portable scalar one
SHAPES = [(1, 1), (17, 33), (37, 40), (96, 64), (200, 577)]  # (N, K): N not a multiple of 16, K odd


def _close(got, x, w, bias=None):
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert got.dtype == x.dtype and got.shape == ref.shape
    if x.dtype == torch.bfloat16:  # fp32 sums of the same bf16 products, one bf16 rounding
        torch.testing.assert_close(got.float(), ref, rtol=1.6e-2, atol=1e-2 * max(1.0, ref.abs().amax().item() if ref.numel() else 1.0) / 4)
    else:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", BUILDS, ids=lambda isa: linear_kernel_path(isa))
def test_kernel_matches_f_linear(isa):
    k = load_linear_kernels(isa)
    assert k.linear_kernel_path() == linear_kernel_path(isa)  # the Python mirror of the #if chain
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for n, kdim in SHAPES:
            w = torch.randn(n, kdim).to(dtype)
            b = torch.randn(n).to(dtype)
            packed = k.linear_pack(w)
            for m in range(0, 18):
                x = torch.randn(m, kdim).to(dtype)
                _close(k.linear_small(x, packed, n, kdim, b if m % 2 else None), x, w, b if m % 2 else None)


def test_kernel_paths_follow_the_isa():
    assert linear_kernel_path(AVX2 + ("avx512f", "avx512bw", "avx512_bf16")) == "avx512-bf16 (vdpbf16ps)"
    assert linear_kernel_path(AVX2 + ("avx512f", "avx512bw")) == "avx512f (fp32 fma)"
    assert linear_kernel_path(AVX2) == "avx2+fma (fp32 fma)"
    assert linear_kernel_path(("sse4_2", "avx")) == linear_kernel_path(("asimd", "sve")) == "scalar"
    assert SmallGemm(("sse4_2",)).rows_for(torch.float32) == 0  # oneDNN's JIT beats portable code


def _ops(dtype):
    return CPUKernelsBackend(SelectionContext(accelerator=CPU, dtype=dtype), {"pack_linear": lambda w: w, "linear": F.linear}).ops()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backend_takes_it_for_few_rows(dtype):
    if dtype == torch.bfloat16 and bf16_gemm_missing(accelerator_isa(SelectionContext(accelerator=CPU))):
        pytest.skip("this CPU (or PLINTH_CPU_ISA) cannot run oneDNN bf16 GEMMs, so the backend leaves bf16 linear to the reference")
    ops = _ops(dtype)
    torch.manual_seed(1)
    w, b = torch.randn(50, 70).to(dtype), torch.randn(50).to(dtype)
    packed = ops["pack_linear"](w)
    assert isinstance(packed, PackedLinear)
    rows = SmallGemm(NATIVE).rows_for(dtype)
    assert packed.small_rows == rows and (packed.small is None) == (rows == 0)
    for m in (1, 2, 5, 16, 17, 40):
        x = torch.randn(2, m, 70).to(dtype)  # leading dims are flattened: 2m rows
        y = ops["linear"](x, packed, b)
        assert y.shape == (2, m, 50)
        _close(y.view(-1, 50), x.view(-1, 70), w, b)
        if 2 * m > rows and dtype == torch.bfloat16:  # oneDNN's: bit-identical to F.linear
            torch.testing.assert_close(ops["linear"](x, packed), F.linear(x, w), rtol=0, atol=0)


def test_no_budget_or_no_rows_keeps_onednn_only(monkeypatch):
    w = torch.randn(32, 16)
    assert PackedLinear(w, SmallGemm(NATIVE, budget=0)).small is None
    monkeypatch.setenv(ROWS_ENV, "0")
    gemm = SmallGemm(NATIVE)
    assert gemm.rows_for(torch.float32) == 0 and PackedLinear(w, gemm).small_rows == 0
    monkeypatch.setenv(ROWS_ENV, "3")
    assert SmallGemm(("sse4_2",)).rows_for(torch.bfloat16) == 3


@pytest.mark.parametrize("rows", ["", "0"], ids=["streaming", "onednn-only"])
def test_greedy_tokens_match_transformers(rows, tmp_path_factory, monkeypatch):
    """A tiny random Llama in float32 with cpukernels, decode batches of 3
    (the streaming kernel) and 1 against transformers' greedy tokens."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "tests"))
    from plinth import LLM, SamplingParams
    from tiny_models import reference_greedy, tiny_model_dir

    monkeypatch.setenv(ROWS_ENV, rows)
    path = tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny")))
    llm = LLM(path, dtype="float32", backend="cpukernels", load_progress=False, num_pages=64)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [9, 8, 7, 6, 5]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(path, prompt, 10)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params)] == [outs[0].outputs[0].token_ids]


def amx_kernels():
    """The native build's kernels where it runs AMX tiles here, else the test is skipped."""
    k = load_linear_kernels(NATIVE)
    if not k.linear_amx_available():
        pytest.skip("no AMX here: this CPU (or PLINTH_CPU_ISA) lacks amx_tile/amx_bf16, or the kernel does not grant the tiles")
    return k


#: (N, K) with K a multiple of 32 (the AMX kernel's rule); N not a multiple of 16
AMX_SHAPES = [(1, 32), (17, 64), (96, 288), (200, 576)]


def test_amx_kernel_matches_f_linear():
    k = amx_kernels()
    torch.manual_seed(2)
    for n, kdim in AMX_SHAPES:
        w, b = torch.randn(n, kdim).bfloat16(), torch.randn(n).bfloat16()
        packed = k.linear_pack(w)
        for m in (0, 1, 2, 5, 15, 16, 17, 31, 40):
            x = torch.randn(m, kdim).bfloat16()
            bias = b if m % 2 else None
            _close(k.linear_amx(x, packed, n, kdim, bias), x, w, bias)


def test_amx_kernel_rejects_bad_input():
    k = amx_kernels()
    packed = k.linear_pack(torch.randn(20, 64).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        k.linear_amx(torch.randn(2, 64), packed, 20, 64, None)
    with pytest.raises(RuntimeError, match="does not match"):
        k.linear_amx(torch.randn(2, 64).bfloat16(), packed, 40, 64, None)
    odd = k.linear_pack(torch.randn(20, 48).bfloat16())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        k.linear_amx(torch.randn(2, 48).bfloat16(), odd, 20, 48, None)


@pytest.mark.skipif(not (X86 and {"avx2", "fma"} <= set(NATIVE)), reason="needs an x86 CPU with AVX2+FMA")
def test_builds_without_amx_say_so():
    k = load_linear_kernels(AVX2)
    assert not k.linear_amx_available()
    with pytest.raises(RuntimeError, match="no AMX kernel"):
        k.linear_amx(torch.randn(1, 32).bfloat16(), k.linear_pack(torch.randn(16, 32).bfloat16()), 16, 32, None)
    assert not SmallGemm(AVX2).amx()


AMX_ISA = ("avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")


def test_deterministic_default_follows_the_linear_kernels(monkeypatch):
    """On by default in bf16 where the tiles really run (the CPU's flags,
    PLINTH_CPU_AMX, and Linux's grant, refused before 5.16: the same grant
    the built kernels ask for) or, on CPUs without AMX, where the vdpbf16ps
    kernels do; off on a CPU whose tiles stay unused, and elsewhere."""
    from plinth_plugin_cpukernels import backend
    from plinth_plugin_cpukernels.gemm import kernel_grants_amx

    if {"amx_tile", "amx_bf16"} <= set(NATIVE) and X86 and sys.platform == "linux":
        assert kernel_grants_amx() == bool(load_linear_kernels(NATIVE).linear_amx_available())
    monkeypatch.setattr(backend, "kernel_grants_amx", lambda: True)
    assert backend.deterministic_default(AMX_ISA, torch.bfloat16) == (True, backend.AMX_COST)
    # AVX512-BF16 without AMX (AMD Zen 4): the vdpbf16ps kernels, measured no cost
    assert backend.deterministic_default(AMX_ISA[:3], torch.bfloat16) == (True, backend.VDPBF16PS_COST)
    # AVX-512F without BF16, AVX2: not measured, off
    assert backend.deterministic_default(("avx512f", "avx512bw"), torch.bfloat16) == (False, backend.NOT_MEASURED)
    assert backend.deterministic_default(AVX2, torch.bfloat16) == (False, backend.NOT_MEASURED)
    assert not backend.deterministic_default(AMX_ISA, torch.float32)[0]
    assert not backend.deterministic_default(AMX_ISA[:3], torch.float32)[0]
    # tiles on the CPU but unused: its vdpbf16ps is slow against oneDNN's AMX GEMMs, off
    monkeypatch.setattr(backend, "kernel_grants_amx", lambda: False)
    assert backend.deterministic_default(AMX_ISA, torch.bfloat16) == (False, backend.AMX_OFF)
    monkeypatch.setattr(backend, "kernel_grants_amx", lambda: True)
    monkeypatch.setenv(AMX_ENV, "0")
    assert backend.deterministic_default(AMX_ISA, torch.bfloat16) == (False, backend.AMX_OFF)


def test_backend_routes_bf16_weights_to_amx(monkeypatch):
    """bf16 weights whose K is a multiple of 32 take the AMX kernel up to
    AMX_ROWS rows (oneDNN above); other K, and PLINTH_CPU_AMX=0, the vdpbf16ps one."""
    k = amx_kernels()
    if bf16_gemm_missing(accelerator_isa(SelectionContext(accelerator=CPU))):
        pytest.skip("this CPU cannot run oneDNN bf16 GEMMs")
    torch.manual_seed(3)
    w, b = torch.randn(40, 64).bfloat16(), torch.randn(40).bfloat16()
    ops = _ops(torch.bfloat16)
    packed = ops["pack_linear"](w)
    assert packed.amx and packed.small_rows == AMX_ROWS
    assert not ops["pack_linear"](torch.randn(40, 70).bfloat16()).amx
    for m in (1, AMX_ROWS):
        x = torch.randn(m, 64).bfloat16()
        assert torch.equal(ops["linear"](x, packed, b), k.linear_amx(x, packed.small, 40, 64, b))
    x = torch.randn(AMX_ROWS + 1, 64).bfloat16()  # oneDNN's: bit-identical to F.linear
    torch.testing.assert_close(ops["linear"](x, packed), F.linear(x, w), rtol=0, atol=0)
    monkeypatch.setenv(AMX_ENV, "0")
    off = _ops(torch.bfloat16)["pack_linear"](w)
    assert not off.amx and off.small_rows == SmallGemm(NATIVE).rows_for(torch.bfloat16)
