"""plinth-plugin-tpu against the conformance kit (device checks run where a
TPU is usable, and are skipped with the reason elsewhere)."""

from plinth.testing import AcceleratorConformance


class TestConformance(AcceleratorConformance):
    name = "tpu"
