"""Entry point: registers the accelerator; imports nothing heavy (no torch,
no torch_xla)."""

from plinth.api import AcceleratorDescriptor, hookimpl


@hookimpl
def plinth_register_accelerators():
    return [
        AcceleratorDescriptor(
            name="tpu",
            impl="plinth_plugin_tpu.accelerator:TPUAccelerator",
            priority=80,
            description="Google TPUs (torch_xla, PJRT)",
        )
    ]
