"""Registration and cheap import (the round trips need a GPU: bench/gpu/deepep.sh)."""

from plinth.testing import PluginConformance


class TestConformance(PluginConformance):
    category = "a2a"
    name = "deepep"
