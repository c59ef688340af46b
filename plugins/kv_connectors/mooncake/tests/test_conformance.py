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
    staging buffers (batch_put_from / batch_get_into), each area unregistered
    after its call; otherwise through bytes. Same bytes back either way."""
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
    if zero_copy:
        assert {"register_buffer", "batch_put_from", "batch_get_into", "unregister_buffer"} <= set(spy.calls), spy.calls
        assert spy.calls.count("register_buffer") == spy.calls.count("unregister_buffer") == 2
        assert "put_batch" not in spy.calls and "get_batch" not in spy.calls
    else:
        assert {"put_batch", "get_batch"} <= set(spy.calls) and "register_buffer" not in spy.calls
    conn.close()
