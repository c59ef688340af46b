"""Entry point: registers the accelerator; imports nothing heavy (no torch,
no torch_npu, no dlinfer)."""

from plinth.api import AcceleratorDescriptor, hookimpl


@hookimpl
def plinth_register_accelerators():
    return [
        AcceleratorDescriptor(
            name="ascend",
            impl="plinth_plugin_ascend.accelerator:AscendAccelerator",
            priority=90,
            description="Huawei Ascend NPUs (torch_npu + dlinfer, HCCL)",
        )
    ]
