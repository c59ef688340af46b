"""plinth-plugin-xpu against the conformance kit (device checks run where an
Intel GPU is usable, and are skipped with the reason elsewhere)."""

from plinth.testing import AcceleratorConformance


class TestConformance(AcceleratorConformance):
    name = "xpu"
