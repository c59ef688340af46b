"""The plinth conformance kit against the fake dlinfer, on the fake NPU:
registration, a cheap entry point, and every op the backend provides against
the torch reference (attention at the page sizes the vendor allows, GQA and
MHA, a fork; rms_norm with and without the residual; linear; silu_and_mul;
rotary; fused_moe with experts that get no tokens and ids of other ranks) in
float16 and bfloat16, the dtypes the Ascend kernels take."""

import pytest
from plinth.testing import BackendConformance


class TestConformance(BackendConformance):
    name = "dlinfer"
    dtypes = ("float16", "bfloat16")
    accelerator = "fakenpu"
    page_sizes = (16, 32)
    sliding_window = False  # refused in check(): dlinfer's attention takes no window

    @pytest.fixture(autouse=True)
    def _fakes(self, fake_npu):
        yield
