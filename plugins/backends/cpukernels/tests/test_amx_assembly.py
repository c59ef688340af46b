"""The AMX tile configuration, read from the compiled code on any x86 CPU.

LDTILECFG reads 64 bytes: the palette, then the bytes per row (colsb) and the
rows of each tile. GCC 12's ``_tile_loadconfig`` hands its asm an 8-byte
operand, so the compiler took the rest of a stack configuration for never
read and deleted the stores of colsb and rows: an Intel Xeon with AMX then
died at ``ldtilecfg`` (#GP) or at the first tile instruction (#UD). Whether it
happened depended on inlining, so these tests compile both kernel sources for
an AMX CPU as the build does and with inlining off (where the old code lost
the stores), and check that before every ``ldtilecfg`` the code stores
non-zero values into the colsb and rows of tiles 0-7 (every kernel uses 8
tiles), and that the tiles are released. They need a compiler, not AMX."""

from __future__ import annotations

import platform
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from plinth_plugin_cpukernels.gemm import LINEAR_SOURCE
from plinth_plugin_cpukernels.kernels import SOURCE, compile_assembly, compiler_missing

CSRC = Path(SOURCE).parent
#: Sapphire Rapids' extensions as the cpu plugin reports them
AMX_ISA = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
    "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
)
#: as the build compiles (tuned for the CPU that has AMX), and with inlining off
VARIANTS = {"as-built": ["-mtune=sapphirerapids"], "out-of-line": ["-fno-inline"]}
#: config bytes that must be written with non-zero values: colsb and rows of tiles 0-7
NEEDED = {"colsb of tiles 0-7": range(16, 32), "rows of tiles 0-7": range(48, 56)}

pytestmark = [
    pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="AMX is x86's"),
    pytest.mark.skipif(compiler_missing() is not None, reason=str(compiler_missing())),
]


def _compiler_has_amx() -> bool:
    try:
        done = subprocess.run(["c++", "-mamx-tile", "-x", "c++", "-fsyntax-only", "-"], input="int main(){}", capture_output=True, text=True)
    except OSError:
        return False
    return done.returncode == 0


MEMORY = re.compile(r"^(-?\d*)\((%\w+)\)$")
VECTOR_WIDTH = {"xmm": 16, "ymm": 32, "zmm": 64}
GPR_WIDTH = {"b": 1, "w": 2, "l": 4, "q": 8}
#: plain moves to memory; their width comes from the suffix or the source register
MOVES = re.compile(r"^(v?mov(dq[au](8|16|32|64)?|[au]p[sd]|d|q|b|w|l|ss|sd)|mov[bwlq]?)$")


def _family(reg: str) -> str:
    """A register's architectural name (xmm3/ymm3/zmm3 -> v3; eax/rax/ax/al -> a)."""
    reg = reg.lstrip("%")
    m = re.match(r"^[xyz]mm(\d+)$", reg)
    if m:
        return f"v{m.group(1)}"
    m = re.match(r"^r(\d+)[dwb]?$", reg)
    if m:
        return f"r{m.group(1)}"
    return {"al": "a", "ah": "a", "bl": "b", "cl": "c", "dl": "d", "sil": "si", "dil": "di"}.get(reg, reg.lstrip("er").rstrip("x") or reg)


def _width(mnemonic: str, source: str) -> int | None:
    reg = source.lstrip("%")
    if reg[:3] in VECTOR_WIDTH and reg[3:].isdigit():
        if mnemonic in ("vmovd", "movd"):
            return 4
        if mnemonic in ("vmovq", "movq") and not mnemonic.endswith("dqa"):
            return 8
        if mnemonic.endswith("ss"):
            return 4
        if mnemonic.endswith("sd"):
            return 8
        return VECTOR_WIDTH[reg[:3]]
    if mnemonic.startswith("mov") and mnemonic[-1] in GPR_WIDTH:
        return GPR_WIDTH[mnemonic[-1]]
    return None


@dataclass
class ConfigLoad:
    """One ldtilecfg: its function, its operand, and per config byte whether
    the last store before it (in the function, in program order) was non-zero."""

    function: str
    operand: str
    written: dict[int, bool] = field(default_factory=dict)

    def missing(self) -> list[str]:
        return [what for what, span in NEEDED.items() if not all(self.written.get(i) for i in span)]


def config_loads(asm: str) -> list[ConfigLoad]:
    """Every ldtilecfg of an assembly listing, with the stores into its operand before it."""
    loads = []
    function, window = "?", []
    for raw in asm.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line:
            continue
        label = re.match(r"^([A-Za-z_.$][\w.$]*):", line)
        if label and not label.group(1).startswith(".L"):
            function, window = label.group(1), []
            continue
        if not line.startswith("\t") or line.lstrip().startswith("."):
            continue
        parts = line.split(None, 1)
        mnemonic, operands = parts[0], (parts[1] if len(parts) > 1 else "")
        args = [a.strip() for a in re.split(r",(?![^(]*\))", operands)] if operands else []
        if mnemonic == "ldtilecfg":
            m = MEMORY.match(args[0])
            load = ConfigLoad(function, args[0])
            if m:
                base, offset = m.group(2), int(m.group(1) or 0)
                zero: set[str] = set()
                for mn, ops in window:
                    if len(ops) == 3 and ops[0] == ops[1] == ops[2] and re.match(r"^v?p?xor", mn):  # vpxor x, x, x
                        zero.add(_family(ops[2]))
                        continue
                    if len(ops) == 2 and ops[0] == ops[1] and mn.startswith("xor"):
                        zero.add(_family(ops[1]))
                        continue
                    dest = ops[-1] if ops else ""
                    dm = MEMORY.match(dest)
                    if dm and dm.group(2) == base and MOVES.match(mn) and len(ops) == 2:
                        width = _width(mn, ops[0]) if not ops[0].startswith("$") else GPR_WIDTH.get(mn[-1])
                        if width:
                            nonzero = not (ops[0] == "$0" or (not ops[0].startswith("$") and _family(ops[0]) in zero))
                            start = int(dm.group(1) or 0) - offset
                            for i in range(max(0, start), min(64, start + width)):
                                load.written[i] = nonzero
                    elif dest.startswith("%"):
                        zero.discard(_family(dest))
            loads.append(load)
        window.append((mnemonic, args))
    return loads


@pytest.fixture(scope="module")
def assemblies():
    if not _compiler_has_amx():
        pytest.skip("this compiler has no -mamx-tile")
    from concurrent.futures import ThreadPoolExecutor

    jobs = {(source.name, variant): (source, flags) for source in (LINEAR_SOURCE, SOURCE) for variant, flags in VARIANTS.items()}
    with ThreadPoolExecutor(2) as pool:  # compiler processes, two at a time (about 30 s of CPU each)
        futures = {key: pool.submit(compile_assembly, source, AMX_ISA, extra_flags=flags, machine="x86_64") for key, (source, flags) in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("source", [LINEAR_SOURCE.name, SOURCE.name])
def test_every_tile_config_is_stored_whole_before_it_loads(assemblies, source, variant):
    asm = assemblies[(source, variant)]
    loads = config_loads(asm)
    assert loads, f"{source} ({variant}) has no ldtilecfg: its AMX kernels were not compiled"
    bad = [f"{load.function} ({load.operand}): {', '.join(load.missing())} not stored" for load in loads if load.missing()]
    assert not bad, "ldtilecfg reads a configuration whose stores the compiler dropped: " + "; ".join(bad)
    assert "tilerelease" in asm, f"{source} ({variant}) never releases its tiles"


def test_the_analysis_catches_the_gcc12_intrinsic():
    """The check itself, on GCC's own output for the helper as it was: an
    out-of-line function that fills a stack config and calls
    _tile_loadconfig (its stores deleted), beside the same with the whole
    struct as the operand (kept)."""
    if not _compiler_has_amx():
        pytest.skip("this compiler has no -mamx-tile")
    body = """
#include <immintrin.h>
#include <cstdint>
struct alignas(64) Cfg { uint8_t palette = 1, start = 0, reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
#define FILL Cfg cfg; for (int t = 0; t < 8; ++t) { cfg.rows[t] = uint8_t(t < 5 ? rows : 16); cfg.colsb[t] = 64; }
__attribute__((noinline)) void intrinsic(int rows) { FILL _tile_loadconfig(&cfg); }
__attribute__((noinline)) void whole(int rows) { FILL __asm__ volatile("ldtilecfg %0" :: "m"(cfg)); }
"""
    done = subprocess.run(["c++", "-S", "-O3", "-mamx-tile", "-mavx512f", "-x", "c++", "-", "-o", "-"], input=body, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    loads = config_loads(done.stdout)
    intrinsic = next(load for load in loads if "intrinsic" in load.function)
    whole = next(load for load in loads if "whole" in load.function)
    assert whole.missing() == [], whole.written
    if intrinsic.missing() == []:
        pytest.skip("this compiler keeps the stores for _tile_loadconfig (not GCC 12's 8-byte operand)")
    assert set(intrinsic.missing()) == set(NEEDED)


def test_no_source_uses_the_intrinsic():
    """Every config load goes through plinth::load_tile_config (common.h)."""
    for path in CSRC.glob("*.*"):
        text = path.read_text()
        assert "_tile_loadconfig" not in re.sub(r"//.*", "", text), f"{path.name} calls _tile_loadconfig: use plinth::load_tile_config"
