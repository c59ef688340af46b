"""Entry point: registers the backend; imports nothing heavy (no torch, no dlinfer)."""

from plinth.api import BackendDescriptor, hookimpl


@hookimpl
def plinth_register_backends():
    return [
        BackendDescriptor(
            name="dlinfer",
            impl="plinth_plugin_dlinfer.backend:DlinferBackend",
            priority=5,  # the ascend accelerator names it first; never an accident elsewhere
            description="DeepLink dlinfer kernels (Ascend NPUs): paged attention, norms, rotary, MoE, linear; other ops from the reference",
        )
    ]
