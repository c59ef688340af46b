"""The plinth conformance kit against the fake dlinfer, on the fake NPU:
registration, a cheap entry point, and every op the backend provides against
the torch reference (its attention backend's declarations, attention at the
page sizes it declares, GQA and MHA, a fork, sliding-window models declined; rms_norm with and without the residual; linear; silu_and_mul;
rotary; fused_moe with experts that get no tokens and ids of other ranks) in
float16 and bfloat16, the dtypes the Ascend kernels take."""

import pytest
from plinth.testing import BackendConformance


class TestConformance(BackendConformance):
    name = "dlinfer"
    dtypes = ("float16", "bfloat16")
    accelerator = "fakenpu"
    # page sizes (16 and 32: the vendor's powers of two) and no window: what its attention backend declares

    @pytest.fixture(autouse=True)
    def _fakes(self, fake_npu):
        yield
