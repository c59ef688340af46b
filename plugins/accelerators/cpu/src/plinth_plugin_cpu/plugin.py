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
            # libgomp's threads spin this many pauses at the end of a parallel
            # region before they sleep (default 300000: 7 ms on Zen 4, 25 ns a
            # pause). A served step's threads then kept both cores spinning
            # between steps while the event loop and the client waited for
            # one. 2000 (49 us there) still spans the Python between a step's
            # ops (300, 7 us, did not: 10% slower), and lets a thread whose
            # partner the client preempted sleep, so the OS moves the partner
            # onto its core: served 16-stream throughput +4% over 20000
            # (median of 14 pairs, docs/benchmarks.md)
            process_env=(("GOMP_SPINCOUNT", "2000"),),
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
