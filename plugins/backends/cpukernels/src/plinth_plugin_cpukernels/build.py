"""`python -m plinth_plugin_cpukernels.build`: compile the kernels now for the
instruction sets the chosen accelerator reports, and run their start-up
probes (make setup runs it, so the first `platform serve` waits for neither
the compiler nor a probe)."""

import sys
import time


def main() -> int:
    from plinth.api import load_accelerator

    from plinth_plugin_cpukernels.kernels import compiler_missing, isa_cflags, load_kernels
    from plinth_plugin_cpukernels.probe import usable_isa

    missing = compiler_missing()
    if missing:
        print(f"cpukernels: not built: {missing}", file=sys.stderr)
        return 0  # the plugin then reports itself unavailable; the torch backend serves
    accelerator = load_accelerator("auto")
    if accelerator.device_type != "cpu":
        print(f"cpukernels: not built: the accelerator is {accelerator.device_type}, not cpu")
        return 0
    t = time.perf_counter()
    # each kernel path the CPU claims runs once in a child process (probe.py); what
    # dies or disagrees is dropped here, once per machine and build, not at a first request
    probed = usable_isa(tuple(accelerator.info().isa))
    for line in probed.dropped:
        print(f"cpukernels: dropped {line}", file=sys.stderr)
    if probed.error:
        print(f"cpukernels: not usable here: {probed.error}", file=sys.stderr)
        return 0  # the plugin then reports itself unavailable; the torch backend serves
    isa = probed.isa
    load_kernels(isa)
    from plinth_plugin_cpukernels.quant import load_quant_kernels

    load_quant_kernels(isa)  # the GGUF kernels, built otherwise on the first GGUF model
    from plinth_plugin_cpukernels.gemm import load_linear_kernels

    load_linear_kernels(isa)  # the small-batch linear kernels, built otherwise on the first dense weight
    flags = " ".join(isa_cflags(isa)) or "a generic build"
    print(f"cpukernels: kernels ready for {','.join(isa) or 'no known extensions'} ({flags}; {time.perf_counter() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
