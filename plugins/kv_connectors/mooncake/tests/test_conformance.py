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


class TestMooncakeCopying(TestMooncake):
    """The same through Python bytes (get_batch / put_batch)."""

    def connector_config(self):
        return {**self.master.config, "zero_copy": False}


class _Spy:
    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if callable(attr):
            self.calls.append(name)
        return attr


@pytest.mark.parametrize("zero_copy", [True, False])
def test_the_data_path_taken(master, zero_copy):
    """zero_copy: values go straight between the store and the registered
    staging buffers (batch_put_from / batch_get_into), an area registered
    once and kept until the thread registers another (then the old one is
    unregistered); otherwise through bytes. Same bytes back either way."""
    import torch
    from plinth.api import SelectionContext
    from plinth.testing import kv_test_layout, kv_value_bytes
    from plinth_plugin_mooncake.connector import MooncakeConnector

    layout = kv_test_layout(page_bytes=4096)
    conn = MooncakeConnector(SelectionContext(), config={**master.config, "zero_copy": zero_copy}, layout=layout)
    assert conn.health() == (True, "ok")
    spy = conn._store = _Spy(conn._store)
    keys = [f"plinth/test/zc{zero_copy}/{i}" for i in range(4)]
    src = torch.randint(0, 256, (4, kv_value_bytes(4096)), dtype=torch.uint8)
    conn.register_buffer(src)
    conn.save(keys, [src[i] for i in range(4)])
    dst = torch.zeros(5, src.shape[1], dtype=torch.uint8)
    conn.register_buffer(dst)
    assert conn.load(keys + ["plinth/test/missing"], [dst[i] for i in range(5)]) == [src.shape[1]] * 4 + [0]
    assert torch.equal(src, dst[:4])
    assert conn.load(keys, [dst[i] for i in range(4)]) == [src.shape[1]] * 4  # the same area again: no registration
    if zero_copy:
        assert {"register_buffer", "batch_put_from", "batch_get_into", "unregister_buffer"} <= set(spy.calls), spy.calls
        assert spy.calls.count("register_buffer") == 2 and spy.calls.count("unregister_buffer") == 1
        assert spy.calls.count("batch_get_into") == 2 and conn.registrations == 2
        assert "put_batch" not in spy.calls and "get_batch" not in spy.calls
    else:
        assert {"put_batch", "get_batch"} <= set(spy.calls) and "register_buffer" not in spy.calls
    conn.close()


def test_size_strings_and_local_hostname(monkeypatch):
    """Sizes as Mooncake's config reader (mooncake_config.py:127) takes them;
    local_hostname from the interface that reaches a master on another host,
    never loopback there."""
    from plinth.api import ConfigError
    from plinth_plugin_mooncake import connector

    base = {"metadata_server": "http://127.0.0.1:1/metadata", "master_server_address": "127.0.0.1:2"}
    cfg = connector.load_config({**base, "global_segment_size": "3GB", "local_buffer_size": "1.5 m"})
    assert cfg["global_segment_size"] == 3 << 30 and cfg["local_buffer_size"] == int(1.5 * (1 << 20))
    assert cfg["local_hostname"] == "127.0.0.1"
    assert connector.load_config({**base, "global_segment_size": "4096"})["global_segment_size"] == 4096
    assert connector.load_config({**base, "global_segment_size": "2 KB"})["global_segment_size"] == 2048
    for bad in ("3 parsecs", "GB", ""):
        with pytest.raises(ConfigError, match="size string"):
            connector.load_config({**base, "global_segment_size": bad})

    remote = {**base, "master_server_address": "192.0.2.10:50051"}
    monkeypatch.setattr(connector, "route_to", lambda address: "192.0.2.77")
    assert connector.load_config(remote)["local_hostname"] == "192.0.2.77"
    assert connector.load_config({**remote, "local_hostname": "node3"})["local_hostname"] == "node3"
    with pytest.raises(ConfigError, match="loopback"):
        connector.load_config({**remote, "local_hostname": "127.0.0.1"})

    def unroutable(address):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(connector, "route_to", unroutable)
    with pytest.raises(ConfigError, match="give local_hostname"):
        connector.load_config(remote)
