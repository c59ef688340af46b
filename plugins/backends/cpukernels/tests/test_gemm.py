"""The oneDNN linear against the reference F.linear: bit-identical in bfloat16."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from plinth.api import SelectionContext
from plinth_plugin_cpukernels.backend import CPUKernelsBackend
from plinth_plugin_cpukernels.gemm import PackedLinear


def _ops():
    return CPUKernelsBackend(SelectionContext(), {"pack_linear": lambda w: w, "linear": F.linear}).ops()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 3, 32, 200])
def test_packed_linear_equals_reference(dtype, batch):
    torch.manual_seed(batch)
    ops = _ops()
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

    ops = CPUKernelsBackend(SelectionContext(), {"pack_linear": lambda w: w, "linear": ref_linear}).ops()
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
