"""Entry point: registers the torch backend; imports nothing heavy (no torch)."""

from plinth.api import BackendDescriptor, hookimpl


@hookimpl
def plinth_register_backends():
    return [
        BackendDescriptor(
            name="torch",
            impl="plinth_plugin_torch.backend:TorchBackend",
            reference=True,
            priority=0,
            description="reference ops in plain PyTorch (paged attention via SDPA), any torch device",
        )
    ]
