"""Entry point: registers the backend; imports nothing heavy."""

from plinth.api import BackendDescriptor, hookimpl


@hookimpl
def plinth_register_backends():
    return [
        BackendDescriptor(
            name="cpukernels",
            impl="plinth_plugin_cpukernels.backend:CPUKernelsBackend",
            priority=10,
            description="CPU: oneDNN pre-packed GEMMs, C++ paged-decode attention; other ops from the reference",
        )
    ]
