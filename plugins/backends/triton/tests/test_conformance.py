"""The plinth conformance kit against the torch reference, under the interpreter:
registration, a cheap entry point, and every op this backend provides
(attention at page sizes 16 and 7, GQA and MHA, a sliding window, a fork;
rms_norm with and without the residual; linear; fused_moe with experts
that get no tokens and ids of other ranks) in float32 and bfloat16."""

from plinth.testing import BackendConformance


class TestConformance(BackendConformance):
    name = "triton"
