"""numpyops against the conformance kit: every op it brings and its attention
against the reference backend's, on random inputs, on the chosen
accelerator's device (`auto`: the best available)."""

from plinth.testing import BackendConformance


class TestConformance(BackendConformance):
    name = "numpyops"
    dtypes = ("float32", "bfloat16")  # the dtypes to compare in
    page_sizes = (16, 7)  # the page sizes attention is checked at (those your kernels take)
