"""Registration and cheap import of the entry point (no torch at import)."""

from plinth.testing import PluginConformance


class TestConformance(PluginConformance):
    category = "model"
    name = "deepseek"
