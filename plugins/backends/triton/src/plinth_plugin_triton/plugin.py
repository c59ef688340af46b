"""Entry point: registers the backend; imports nothing heavy (no torch, no triton)."""

from plinth.api import BackendDescriptor, hookimpl


@hookimpl
def plinth_register_backends():
    return [
        BackendDescriptor(
            name="triton",
            impl="plinth_plugin_triton.backend:TritonBackend",
            priority=5,  # the cuda accelerator names it first; never an accident elsewhere
            description="Triton kernels: paged attention, fused MoE, rms_norm, FP8 GEMMs; other ops from the reference",
        )
    ]
