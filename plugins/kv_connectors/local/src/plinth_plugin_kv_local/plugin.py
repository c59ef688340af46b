"""Entry point: registers the ``local`` KV connector; imports nothing heavy."""

from plinth.api import KVConnectorDescriptor, hookimpl


@hookimpl
def plinth_register_kv_connectors():
    return [
        KVConnectorDescriptor(
            name="local",
            impl="plinth_plugin_kv_local.connector:LocalConnector",
            priority=10,
            description="KV pages in CPU memory (byte budget, LRU), then an optional disk directory shared across processes",
        )
    ]
