"""Entry point: registers the backend; imports nothing heavy."""

from plinth.api import BackendDescriptor, hookimpl


@hookimpl
def plinth_register_backends():
    return [
        BackendDescriptor(
            name="cpukernels",
            impl="plinth_plugin_cpukernels.backend:CPUKernelsBackend",
            priority=10,
            description="CPU: oneDNN pre-packed GEMMs, GGUF weights in their quantized blocks (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K), C++ paged attention; other ops from the reference",
        )
    ]
