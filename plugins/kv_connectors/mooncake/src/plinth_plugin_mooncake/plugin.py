"""Entry point: registers the ``mooncake`` KV connector. Never imports mooncake."""

from plinth.api import KVConnectorDescriptor, hookimpl


@hookimpl
def plinth_register_kv_connectors():
    return [
        KVConnectorDescriptor(
            name="mooncake",
            impl="plinth_plugin_mooncake.connector:MooncakeConnector",
            priority=5,
            description="KV pages in Mooncake Store (mooncake-transfer-engine; tcp or rdma)",
        )
    ]
