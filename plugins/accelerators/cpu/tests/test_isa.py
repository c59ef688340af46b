"""The instruction sets the cpu accelerator reports: found, narrowed by
PLINTH_CPU_ISA, never widened; the default dtype follows them."""

import logging

import pytest
from plinth_plugin_cpu import isa as isa_mod
from plinth_plugin_cpu.accelerator import CPUAccelerator

ZEN4 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
                  "avx512_bf16", "avx512_vnni"})
ZEN3 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})


@pytest.fixture
def hardware(monkeypatch):
    """Pretend to be a given x86 CPU."""
    def use(flags):
        monkeypatch.setattr(isa_mod, "hardware_isa", lambda: frozenset(flags))
        monkeypatch.setattr(isa_mod, "machine", lambda: "x86_64")
        monkeypatch.setattr("plinth_plugin_cpu.accelerator.hardware_isa", lambda: frozenset(flags))
        monkeypatch.setattr("plinth_plugin_cpu.accelerator.machine", lambda: "x86_64")
        monkeypatch.setattr("plinth_plugin_cpu.accelerator.effective_isa", isa_mod.effective_isa)
    return use


def test_reads_this_machine():
    found = isa_mod.hardware_isa()
    with open("/proc/cpuinfo") as f:
        text = f.read()
    for name in found:  # everything reported is really in cpuinfo
        assert f" {name}" in text
    assert set(found) <= set(isa_mod.KNOWN_ISA.get(isa_mod.machine(), ()))


def test_full_set_and_default_dtype(hardware, monkeypatch):
    monkeypatch.delenv(isa_mod.ISA_ENV, raising=False)
    hardware(ZEN4)
    info = CPUAccelerator().info()
    assert set(info.isa) == ZEN4 and info.default_dtype == "bfloat16"
    hardware(ZEN3)
    info = CPUAccelerator().info()
    assert set(info.isa) == ZEN3 and info.default_dtype == "float32"  # bf16 matmuls are emulated there


def test_narrowed_keeps_what_the_names_imply(hardware, monkeypatch):
    hardware(ZEN4)
    monkeypatch.setenv(isa_mod.ISA_ENV, "avx2,fma")
    info = CPUAccelerator().info()
    assert info.isa == ("sse4_2", "avx", "avx2", "fma")
    assert info.default_dtype == "float32" and "narrowed" in info.capability


def test_never_widened(hardware, monkeypatch, caplog):
    hardware(ZEN3)
    monkeypatch.setenv(isa_mod.ISA_ENV, "avx2,avx512_bf16,amx_bf16")
    with caplog.at_level(logging.WARNING, logger="plinth.cpu"):
        info = CPUAccelerator().info()
    assert "avx512_bf16" not in info.isa and "amx_bf16" not in info.isa and "avx2" in info.isa
    assert info.default_dtype == "float32"
    assert "only ever narrowed" in caplog.text


def test_empty_setting_means_everything(hardware, monkeypatch):
    hardware(ZEN4)
    monkeypatch.setenv(isa_mod.ISA_ENV, " ")
    assert set(CPUAccelerator().info().isa) == ZEN4
