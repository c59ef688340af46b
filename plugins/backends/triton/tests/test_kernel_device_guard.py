"""The tests' guard (triton_kernel_guard, on every test here through
conftest) refuses a kernel launch with a tensor off the accelerator's device.
The other tests run the kernels through the production placement code (the
llama loader's LoadContext.device, LLM(...)) under it: on a GPU runner a
weight or scale the loader left on the host fails there. Under the
interpreter the device is the CPU, so only a tensor elsewhere (here: meta)
can show the guard biting."""

from __future__ import annotations

import pytest
import torch
from plinth_plugin_triton import norm
from triton_kernel_guard import KERNEL_DEVICE


def test_a_tensor_off_the_device_is_refused():
    x = torch.randn(4, 64, device=KERNEL_DEVICE)
    w = torch.ones(64, device=KERNEL_DEVICE)
    norm.rms_norm(x, w, 1e-6)  # on the device: runs
    with pytest.raises(AssertionError, match="off the accelerator.s device"):
        norm.rms_norm(x.to("meta"), w, 1e-6)
