"""Entry point: registers the accelerator; imports nothing heavy (no torch)."""

from plinth.api import AcceleratorDescriptor, hookimpl


@hookimpl
def plinth_register_accelerators():
    return [
        AcceleratorDescriptor(
            name="cuda",
            impl="plinth_plugin_cuda.accelerator:CUDAAccelerator",
            priority=100,
            description="NVIDIA GPUs (torch.cuda, NCCL)",
        )
    ]
