"""The oneDNN linear against the reference F.linear (bit-identical in
bfloat16), and which GEMMs it takes on which instruction sets."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from plinth.api import SelectionContext, load_accelerator
from plinth_plugin_cpukernels.backend import CPUKernelsBackend, accelerator_isa, bf16_gemm_missing
from plinth_plugin_cpukernels.gemm import PackedLinear

CPU = load_accelerator("cpu")  # the real one: its instruction sets, narrowed or not
AVX2 = ("sse4_2", "avx", "avx2", "fma")
AVX512 = AVX2 + ("f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")


def fake_cpu(isa):
    return SimpleNamespace(device_type="cpu", info=lambda: SimpleNamespace(isa=tuple(isa)))


def _ops(dtype=torch.float32, ref_linear=F.linear):
    ctx = SelectionContext(accelerator=CPU, dtype=dtype)
    return CPUKernelsBackend(ctx, {"pack_linear": lambda w: w, "linear": ref_linear}).ops()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 3, 32, 200])
def test_packed_linear_equals_reference(dtype, batch):
    torch.manual_seed(batch)
    if dtype == torch.bfloat16 and bf16_gemm_missing(accelerator_isa(SelectionContext(accelerator=CPU))):
        pytest.skip("this CPU (or PLINTH_CPU_ISA) cannot run oneDNN bf16 GEMMs: see test_gemm_follows_the_isa")
    ops = _ops(dtype)
    w = torch.randn(96, 40, dtype=dtype)
    b = torch.randn(96, dtype=dtype)
    x = torch.randn(batch, 40, dtype=dtype)
    packed = ops["pack_linear"](w)
    assert isinstance(packed, PackedLinear)
    # same products, maybe another summation order: float32 agrees to rounding
    exact = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops["linear"](x, packed), F.linear(x, w), **exact)
    torch.testing.assert_close(ops["linear"](x, packed, b), F.linear(x, w, b), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-2)
    x3 = x.view(1, batch, 40)
    assert ops["linear"](x3, packed).shape == (1, batch, 96)


def test_unpacked_weights_take_the_reference_path():
    seen = []

    def ref_linear(x, w, bias=None):
        seen.append(w)
        return F.linear(x, w.float() if w.dtype == torch.float16 else w, bias)

    ops = _ops(torch.float32, ref_linear)
    w16 = torch.randn(8, 4, dtype=torch.float16)  # not a dtype it packs
    packed = ops["pack_linear"](w16)
    assert packed is w16
    ops["linear"](torch.randn(2, 4), packed)
    assert seen == [w16]


def test_check_gives_reasons_off_cpu():
    gpu = SimpleNamespace(device_type="cuda")
    reasons = CPUKernelsBackend.check(SelectionContext(accelerator=gpu, dtype=torch.float16))
    assert any("CPUs only" in r for r in reasons) and any("float16" in r for r in reasons)
    assert CPUKernelsBackend.check(SelectionContext()) == []


@pytest.mark.parametrize("isa, dtype, unsupported", [
    (AVX2, torch.bfloat16, {"pack_linear", "linear"}),  # Zen 3 class: oneDNN refuses bf16 there
    (AVX2, torch.float32, set()),
    (AVX512, torch.bfloat16, set()),
    (AVX2 + ("avx_ne_convert",), torch.bfloat16, set()),
    ((), torch.bfloat16, {"pack_linear", "linear"}),
])
def test_gemm_follows_the_isa(isa, dtype, unsupported):
    ctx = SelectionContext(accelerator=fake_cpu(isa), dtype=dtype)
    limits = CPUKernelsBackend.unsupported_ops(ctx)
    assert set(limits) == unsupported
    assert all("avx512bw" in why and "this CPU reports" in why for why in limits.values())
    assert CPUKernelsBackend.check(ctx) == []  # the rest of the backend still serves


def test_bf16_gemm_never_reaches_onednn_without_the_isa():
    """On an AVX2-only set the bf16 linear ops are left to the reference, so
    oneDNN's bf16 path (which raises there) is never called."""
    ctx = SelectionContext(accelerator=fake_cpu(AVX2), dtype=torch.bfloat16)
    ops = CPUKernelsBackend(ctx, {"pack_linear": lambda w: w, "linear": F.linear}).ops()
    assert "linear" not in ops and "pack_linear" not in ops
    # float32 on the same set packs through oneDNN
    ops = CPUKernelsBackend(SelectionContext(accelerator=fake_cpu(AVX2), dtype=torch.float32), {}).ops()
    assert isinstance(ops["pack_linear"](torch.randn(8, 4)), PackedLinear)
    assert ops["pack_linear"](torch.randn(8, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16  # not packed


def test_ops_need_the_accelerator():
    with pytest.raises(Exception, match="instruction sets"):
        CPUKernelsBackend(SelectionContext(), {}).ops()
