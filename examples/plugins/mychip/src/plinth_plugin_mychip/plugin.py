"""Entry point: registers the accelerator. Every `platform` command imports
this on every machine, so it imports nothing but plinth.api (no torch, no
vendor runtime); the implementation is named lazily in `impl`."""

from plinth.api import AcceleratorDescriptor, hookimpl


@hookimpl
def plinth_register_accelerators() -> list[AcceleratorDescriptor]:
    return [
        AcceleratorDescriptor(
            name="mychip",
            impl="plinth_plugin_mychip.accelerator:MychipAccelerator",
            # `--device auto` takes the highest priority that can run: cuda 100, ascend 90, tpu 80, xpu 70, cpu 0;
            # this example is the host CPU too, so below cpu: chosen by name, or where it is the only one
            priority=-10,
            api=">=2.0,<3",
            description="mychip: the host CPU as an example device (torch cpu, gloo)",
        )
    ]
