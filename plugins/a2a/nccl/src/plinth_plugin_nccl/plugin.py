"""Entry point: registers the `nccl` all-to-all; imports nothing heavy (no torch)."""

from plinth.api import A2ADescriptor, hookimpl


@hookimpl
def plinth_register_a2a():
    return [
        A2ADescriptor(
            name="nccl",
            impl="plinth_plugin_nccl.a2a:CollectiveAllToAll",
            priority=10,
            description="torch.distributed all_to_all_single over the ep group (NCCL on GPU, gloo on CPU, HCCL on Ascend)",
        )
    ]
