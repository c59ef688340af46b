"""The mooncake connector passes the conformance kit against a real mooncake_master."""

import pytest
from plinth.testing import KVConnectorConformance


class TestMooncake(KVConnectorConformance):
    name = "mooncake"
    distribution = "plinth-plugin-mooncake"
    deadline_s = 1.0

    @pytest.fixture(autouse=True)
    def _master(self, master):
        self.master = master

    def connector_config(self):
        return self.master.config
