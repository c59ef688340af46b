"""The local connector passes the conformance kit: memory only, and disk only."""

import pytest
from plinth.testing import KVConnectorConformance


class TestMemoryTier(KVConnectorConformance):
    name = "local"
    distribution = "plinth-plugin-kv-local"
    naming = False  # plinth-plugin-kv-local: the kv_ prefix keeps the name apart from other categories'

    def connector_config(self):
        return {"cpu_bytes": 1 << 20}


class TestDiskTier(KVConnectorConformance):
    name = "local"
    distribution = "plinth-plugin-kv-local"
    naming = False

    @pytest.fixture(autouse=True)
    def _dir(self, tmp_path):
        self.dir = str(tmp_path / "kv")

    def connector_config(self):
        return {"cpu_bytes": 0, "disk_dir": self.dir}
