"""numpyops against the conformance kit: every op it brings against the
reference backend's, on random inputs, on the chosen accelerator's device
(`auto`: the best available), and the ops it declines with why."""

import torch
from plinth.api import SelectionContext, load_accelerator
from plinth.testing import BackendConformance, resolve_op_table


class TestConformance(BackendConformance):
    name = "numpyops"
    dtypes = ("float32", "bfloat16")  # in bfloat16 it declines every op: the reference's run
    page_sizes = (16, 7)  # attention is the reference's


def test_float32_ops_are_numpys_and_the_rest_the_references() -> None:
    ctx = SelectionContext(accelerator=load_accelerator(), dtype=torch.float32)
    _, sources = resolve_op_table("numpyops", ctx)
    assert {op for op, src in sources.items() if src == "numpyops"} == {"rms_norm", "pack_linear", "linear", "silu_and_mul"}
    assert sources["rotary"] != "numpyops" and sources["fused_moe"] != "numpyops"
