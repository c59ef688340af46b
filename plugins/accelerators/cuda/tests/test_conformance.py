"""plinth-plugin-cuda against the conformance kit (device checks run where a
GPU is visible, and are skipped with the reason elsewhere)."""

from plinth.testing import AcceleratorConformance


class TestConformance(AcceleratorConformance):
    name = "cuda"
