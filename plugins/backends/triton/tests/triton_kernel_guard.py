"""A guard for the triton backend's tests: every launch of a triton kernel
hands it tensors on the accelerator's device only (a weight left on the
host by a loader, an FP8 scale the placement code forgot, fails at the
launcher, before the kernel runs, where a GPU would read a host pointer)."""

from __future__ import annotations

import os

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

#: the accelerator's device the kernels' tensors must be on: cuda on a GPU runner, cpu under the interpreter
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") in (None, "", "0") else "cpu"


def off_device(name: str, args: tuple, kwargs: dict, device: str) -> list[str]:
    """The tensors of a kernel launch that are not on ``device``."""
    items = [(f"arg {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    return [f"{name} {what}: {t.device}" for what, t in items if isinstance(t, torch.Tensor) and t.device.type != device]


def guard_kernel_launches(monkeypatch) -> None:
    for cls in (JITFunction, InterpretedFunction):
        real = cls.run

        def run(self, *args, _real=real, **kwargs):
            bad = off_device(getattr(self, "__name__", "kernel"), args, kwargs, KERNEL_DEVICE)
            if bad:
                raise AssertionError("a triton kernel got tensors off the accelerator's device: " + "; ".join(bad))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", run)
