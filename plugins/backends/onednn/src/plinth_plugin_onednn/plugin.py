"""Entry point: registers the backend; imports nothing heavy."""

from plinth.api import BackendDescriptor, hookimpl


@hookimpl
def plinth_register_backends():
    return [
        BackendDescriptor(
            name="onednn",
            impl="plinth_plugin_onednn.backend:OneDNNBackend",
            priority=10,
            description="oneDNN pre-packed GEMMs on CPUs; other ops from the reference",
        )
    ]
