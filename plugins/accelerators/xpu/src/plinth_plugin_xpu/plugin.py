"""Entry point: registers the accelerator; imports nothing heavy (no torch)."""

from plinth.api import AcceleratorDescriptor, hookimpl


@hookimpl
def plinth_register_accelerators():
    return [
        AcceleratorDescriptor(
            name="xpu",
            impl="plinth_plugin_xpu.accelerator:XPUAccelerator",
            priority=70,
            description="Intel GPUs (torch.xpu, XCCL)",
        )
    ]
