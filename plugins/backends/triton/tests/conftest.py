"""The kernels run in Triton's interpreter on CPU tensors here: the variable
must be set before the first @triton.jit function runs (before the plugin's
modules are imported)."""

import os
import pathlib
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import pytest  # noqa: E402
from triton_kernel_guard import guard_kernel_launches  # noqa: E402


@pytest.fixture(autouse=True)
def kernels_see_only_device_tensors(monkeypatch):
    """Every launch of a triton kernel in these tests hands it tensors on the
    accelerator's device only (triton_kernel_guard)."""
    guard_kernel_launches(monkeypatch)
