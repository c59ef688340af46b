"""Entry point: registers the accelerator; imports nothing heavy."""

from plinth.api import AcceleratorDescriptor, hookimpl


@hookimpl
def plinth_register_accelerators():
    return [
        AcceleratorDescriptor(
            name="cpu",
            impl="plinth_plugin_cpu.accelerator:CPUAccelerator",
            priority=0,  # the fallback every machine has
            description="host CPU (torch, gloo)",
        )
    ]


@hookimpl
def plinth_add_cli_arguments(parser):
    parser.add_argument("--cpu-threads", type=int, default=None, help="cpu: torch intra-op threads")
