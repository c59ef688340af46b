"""The kernels are built for the instruction sets the accelerator reports,
and a build is keyed by them: one made for another set is never loaded."""

import platform

import pytest
import torch
from plinth_plugin_cpukernels.kernels import build_name, isa_cflags, load_kernels

X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_flags_follow_the_isa():
    avx2 = ("sse4_2", "avx", "avx2", "fma")
    flags = isa_cflags(avx2, machine="x86_64")
    assert "-mavx2" in flags and "-mfma" in flags and not any("avx512" in f for f in flags)
    assert "-march=native" not in flags  # native would use what a narrowed set excludes
    assert "-mavx512bf16" in isa_cflags(avx2 + ("avx512f", "avx512bw", "avx512_bf16"), machine="x86_64")
    assert isa_cflags(("asimd", "sve", "bf16"), machine="aarch64") == ["-march=armv8.2-a+sve+bf16"]
    assert isa_cflags((), machine="riscv64") == []


def test_builds_are_keyed_by_the_isa():
    assert build_name(("avx2", "fma")) != build_name(("avx2", "fma", "avx512f"))
    assert build_name(("fma", "avx2")) == build_name(("avx2", "fma"))


@pytest.mark.skipif(not X86, reason="an x86 build")
def test_a_build_without_avx_runs():
    """SSE4.2 only, no AVX at all (the set tests/test_cpu_isa.py narrows to as well)."""
    k = load_kernels(("sse4_2",))
    x = torch.randn(3, 2 * 8)
    torch.testing.assert_close(k.silu_and_mul(x), torch.nn.functional.silu(x[:, :8]) * x[:, 8:], rtol=1e-5, atol=1e-5)
