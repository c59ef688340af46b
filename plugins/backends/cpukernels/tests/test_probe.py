"""The start-up probes (probe.py): each kernel path the CPU claims runs once
in a child process; one that dies, hangs or disagrees is dropped with its
reason, and the server serves on the next path."""

from __future__ import annotations

import json

import pytest
from plinth.api import SelectionContext, load_accelerator
from plinth_plugin_cpukernels import probe
from plinth_plugin_cpukernels.backend import CPUKernelsBackend, claimed_isa
from plinth_plugin_cpukernels.probe import FAULT_ENV, ChildOutcome, check_tier, run_child

NATIVE = claimed_isa(SelectionContext(accelerator=load_accelerator("cpu"))) or ()
#: an Intel Xeon with AMX, as the cpu plugin reports it
SAPPHIRE_RAPIDS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
    "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
)


class ScriptedChildren:
    """probe()'s runner: the outcomes of successive children, and the sets they were run for."""

    def __init__(self, *outcomes: ChildOutcome) -> None:
        self.outcomes = list(outcomes)
        self.runs: list[tuple[str, ...]] = []

    def __call__(self, isa: tuple[str, ...]) -> ChildOutcome:
        self.runs.append(isa)
        return self.outcomes.pop(0) if self.outcomes else ChildOutcome(None)


def test_a_dying_amx_kernel_drops_amx_and_keeps_the_rest():
    children = ScriptedChildren(ChildOutcome("linear_amx bfloat16 on amx tiles rows=16", "probe died with SIGILL"))
    result = probe.probe(SAPPHIRE_RAPIDS, run=children)
    assert result.error is None
    assert result.isa == tuple(n for n in SAPPHIRE_RAPIDS if not n.startswith("amx_"))
    assert result.dropped == ("amx: probe died with SIGILL in linear_amx bfloat16 on amx tiles rows=16; using avx512-bf16 (vdpbf16ps)",)
    assert children.runs == [SAPPHIRE_RAPIDS, result.isa]  # the narrowed build was probed again


def test_paths_fall_one_at_a_time_down_to_what_runs():
    children = ScriptedChildren(
        ChildOutcome("gguf_fused_linear_amx Q4_1 on amx tiles rows=2", "probe disagreed (max difference 3.1 over the bound 0.02)"),
        ChildOutcome("linear_small bfloat16 on avx512-bf16 (vdpbf16ps) rows=7", "probe died with SIGSEGV"),
        ChildOutcome("gguf_linear Q4_0 on avx512-vnni (256-bit vpdpbusd) rows=1", "probe hung (no answer in 180 s)"),
    )
    result = probe.probe(SAPPHIRE_RAPIDS, run=children)
    assert [line.split(":")[0] for line in result.dropped] == ["amx", "avx512-bf16", "avx512-vnni"]
    assert result.dropped[1].endswith("; using avx512f (fp32 fma)")
    assert "avx512f" in result.isa and not {"avx512_bf16", "avx512_vnni", "amx_tile"} & set(result.isa)
    assert len(children.runs) == 4


def test_nothing_left_is_an_error_that_makes_the_backend_unavailable(monkeypatch):
    failing = ChildOutcome("rms_norm float32 on portable loops", "probe died with SIGBUS")
    result = probe.probe(("sse4_2",), run=ScriptedChildren(failing))
    assert result.error == "no kernel path runs here: probe died with SIGBUS in rms_norm float32 on portable loops, on the portable build"
    monkeypatch.setattr("plinth_plugin_cpukernels.backend.usable_isa", lambda isa: result)
    reasons = CPUKernelsBackend.check(SelectionContext(accelerator=load_accelerator("cpu")))
    assert result.error in reasons


@pytest.mark.parametrize(
    ("check", "isa", "tier"),
    [
        ("linear_amx bfloat16 on amx tiles rows=1", SAPPHIRE_RAPIDS, "amx"),
        ("amx_attention bfloat16 on amx tiles rows=1,2", SAPPHIRE_RAPIDS, "amx"),
        ("linear_small bfloat16 on avx512-bf16 (vdpbf16ps) rows=1", SAPPHIRE_RAPIDS, "avx512-bf16"),
        ("linear_small float32 on avx512-bf16 (vdpbf16ps) rows=1", SAPPHIRE_RAPIDS, "avx512"),
        ("gguf_linear Q4_1 on avx512-vnni (256-bit vpdpbusd) rows=1", SAPPHIRE_RAPIDS, "avx512-vnni"),
        ("gguf_linear Q4_1 on avx-vnni (vpdpbusd) rows=1", ("sse4_2", "avx", "avx2", "fma", "avx_vnni"), "avx-vnni"),
        ("paged_attention bfloat16 on avx512-bf16 rows=1", SAPPHIRE_RAPIDS, "avx512-bf16"),
        ("paged_attention float32 on avx2 rows=1", ("sse4_2", "avx", "avx2", "fma"), "avx2"),
        ("rms_norm float32 on portable loops", ("sse4_2",), None),
    ],
)
def test_each_check_names_the_path_it_runs(check, isa, tier):
    assert check_tier(check, isa) == tier


@pytest.mark.skipif(not NATIVE, reason="no instruction sets reported")
def test_the_child_passes_on_this_cpu():
    """The real checks, on this CPU's build (the AMX ones too where it has them)."""
    assert run_child(NATIVE) == ChildOutcome(None)


@pytest.mark.skipif(not NATIVE, reason="no instruction sets reported")
@pytest.mark.parametrize(("fault", "why"), [("SIGILL", "probe died with SIGILL"), ("SIGSEGV", "probe died with SIGSEGV"), ("mismatch", "probe disagreed")])
def test_the_child_reports_where_it_died(monkeypatch, fault, why):
    monkeypatch.setenv(FAULT_ENV, f"paged_attention float32={fault}")
    outcome = run_child(NATIVE)
    assert outcome.failed_check is not None and outcome.failed_check.startswith("paged_attention float32 on ")
    assert outcome.why.startswith(why)


@pytest.mark.skipif(not NATIVE, reason="no instruction sets reported")
def test_a_hung_child_is_stopped(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "rms_norm=SIGSTOP")  # the child stops itself, as a kernel that never returns
    outcome = run_child(NATIVE, timeout=60)
    assert outcome.why == "probe hung (no answer in 60 s)"


def test_the_answer_is_cached_per_machine_and_build(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(probe, "probe", lambda isa: calls.append(isa) or probe.ProbeResult(tuple(isa), ("amx: scripted; using x",)))
    probe.usable_isa.cache_clear()
    try:
        first = probe.usable_isa(("sse4_2",))
        probe.usable_isa.cache_clear()  # a new process: the file answers
        assert probe.usable_isa(("sse4_2",)) == first and len(calls) == 1
        monkeypatch.setenv(FAULT_ENV, "x=SIGILL")  # another setting: another answer
        probe.usable_isa.cache_clear()
        probe.usable_isa(("sse4_2",))
        assert len(calls) == 2
        assert json.loads(next(tmp_path.glob("plinth/probes/*.json")).read_text())["dropped"] == ["amx: scripted; using x"]
    finally:
        probe.usable_isa.cache_clear()


@pytest.mark.skipif(not {"amx_tile", "amx_bf16"} <= set(NATIVE), reason="needs a CPU with AMX (its paths are read from the assembly elsewhere: test_amx_assembly.py)")
def test_every_amx_entry_point_agrees_with_avx512_from_the_thread_pool():
    """Wherever the CPU has AMX: the dense linear, the fused GGUF linear of
    every format the build has, and AMX attention, at 1, 2, 7, 16, 33 and 64
    rows from 2 threads, against the AVX-512 path (the fused records bit for
    bit against the dense copy on AMX tiles), in a child so a fault fails
    this test instead of killing pytest."""
    from plinth_plugin_cpukernels.gemm import load_linear_kernels
    from plinth_plugin_cpukernels.quant import GGUF_FORMATS

    if not load_linear_kernels(NATIVE).linear_amx_available():
        pytest.fail("the CPU reports AMX but Linux does not grant this process the tiles (arch_prctl)")
    outcome = run_child(NATIVE)
    assert outcome.failed_check is None, f"{outcome.failed_check}: {outcome.why}"
    amx = [c for c in outcome.checks if " on amx tiles " in c]
    fused = {int(c) for c in load_linear_kernels(NATIVE).gguf_fused_formats()}
    for rows in probe.ROWS:
        assert f"linear_amx bfloat16 on amx tiles rows={rows}" in amx
        for name, (code, _, _) in GGUF_FORMATS.items():
            if code in fused:
                assert f"gguf_fused_linear_amx {name} on amx tiles rows={rows}" in amx
    assert any(c.startswith("amx_attention bfloat16 on amx tiles") for c in amx)
