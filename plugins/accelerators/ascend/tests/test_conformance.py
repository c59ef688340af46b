"""plinth-plugin-ascend against the conformance kit (device checks run where
an Ascend NPU is usable, and are skipped with the reason elsewhere)."""

from plinth.testing import AcceleratorConformance


class TestConformance(AcceleratorConformance):
    name = "ascend"
