"""plinth-plugin-cpu against the conformance kit: it must be available everywhere."""

import torch
from plinth.testing import AcceleratorConformance, check_accelerator


class TestConformance(AcceleratorConformance):
    name = "cpu"
    require_available = True  # every machine has a CPU: never skip its device checks


def test_cpu_threads_option_reaches_torch() -> None:
    from plinth_plugin_cpu.accelerator import CPUAccelerator

    before = torch.get_num_threads()
    try:
        CPUAccelerator().init_process(local_rank=0, options={"cpu_threads": 1})
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_report_says_what_it_checked() -> None:
    report = check_accelerator("cpu")
    assert report.available and report.info is not None
    # bf16 by default only where the CPU multiplies it natively
    native = {"avx512_bf16", "amx_bf16", "bf16"} & set(report.info.isa)
    assert report.info.default_dtype == ("bfloat16" if native else "float32")
    assert any("round-trips" in line for line in report.passed)
    assert "process_env: GOMP_SPINCOUNT=2000" in report.passed  # what the CLI sets before torch loads
