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
    parser.add_argument(
        "--cpu-bind", default=None, metavar="auto|none|LIST",
        help="cpu: pin the model's OpenMP threads one per core: auto (the process's allowed cores; each rank of a node "
        "its own slice), a cpulist such as 0-3, or none (the default; also PLINTH_CPU_BIND)",
    )
