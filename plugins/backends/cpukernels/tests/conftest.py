"""Fixtures shared by the cpukernels tests."""

import pytest
from plinth.api import SelectionContext, load_accelerator


@pytest.fixture
def native_kernels():
    """The attention kernels built for this CPU's instruction sets."""
    from plinth_plugin_cpukernels.backend import accelerator_isa
    from plinth_plugin_cpukernels.kernels import load_kernels

    return load_kernels(accelerator_isa(SelectionContext(accelerator=load_accelerator("cpu"))))


@pytest.fixture
def attention_path(native_kernels):
    """use(on): bf16 pages on AMX tiles (on) or vector registers for the
    calls that follow, as PLINTH_CPU_AMX_ATTENTION sets it at start-up (one
    path per process); skips where this build, CPU or kernel has no tiles.
    Back to vector registers after the test."""

    def use(on: bool) -> None:
        if native_kernels.set_amx_attention(on) != on:
            pytest.skip("no AMX tiles in this build, CPU or kernel")

    yield use
    native_kernels.set_amx_attention(False)
