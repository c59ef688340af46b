"""The CPU's instruction-set extensions, as the kernels need to know them.

Read from /proc/cpuinfo (the names Linux uses there), never assumed. The set
can be narrowed with ``PLINTH_CPU_ISA`` (comma-separated names) so that a run
on a big CPU takes exactly the paths a smaller one would; it is never widened:
a name the hardware lacks is dropped with a warning.
"""

from __future__ import annotations

import functools
import logging
import os
import platform

log = logging.getLogger("plinth.cpu")

ISA_ENV = "PLINTH_CPU_ISA"

#: what the backends decide from, per architecture (Linux's cpuinfo names)
KNOWN_ISA: dict[str, tuple[str, ...]] = {
    "x86_64": (
        "sse4_2", "avx", "avx2", "fma", "f16c",
        "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
        "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx_vnni", "avx_ne_convert",
        "amx_tile", "amx_bf16", "amx_int8",
    ),
    "aarch64": ("asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm"),
}
_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}

#: what each extension implies, so that a narrowed ``avx2,fma`` keeps avx and
#: sse4_2 (no CPU has AVX2 without them)
IMPLIES: dict[str, tuple[str, ...]] = {
    "avx": ("sse4_2",), "avx2": ("avx",), "fma": ("avx",), "f16c": ("avx",),
    "avx512f": ("avx2", "fma", "f16c"), "avx512bw": ("avx512f",), "avx512vl": ("avx512f",),
    "avx512dq": ("avx512f",), "avx512cd": ("avx512f",), "avx512_bf16": ("avx512bw", "avx512vl", "avx512dq"),
    "avx512_vnni": ("avx512bw", "avx512vl", "avx512dq"), "avx512_fp16": ("avx512bw", "avx512vl", "avx512dq"),
    "avx_vnni": ("avx2",), "avx_ne_convert": ("avx2",), "amx_bf16": ("amx_tile",), "amx_int8": ("amx_tile",),
    "asimdhp": ("asimd",), "asimddp": ("asimd",), "sve": ("asimd",), "sve2": ("sve",), "bf16": ("asimd",),
    "i8mm": ("asimd",),
}


def _closure(names: set[str]) -> set[str]:
    todo, out = list(names), set()
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(IMPLIES.get(n, ()))
    return out


def machine() -> str:
    m = platform.machine().lower()
    return _ALIASES.get(m, m)


@functools.lru_cache(maxsize=1)
def hardware_isa() -> frozenset[str]:
    """Every extension this CPU reports that the backends know of."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features"):  # x86, aarch64
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return frozenset(flags & set(KNOWN_ISA.get(machine(), ())))


def effective_isa(setting: str | None = None) -> tuple[str, ...]:
    """The hardware set, narrowed by ``setting`` (default: ``$PLINTH_CPU_ISA``)."""
    hw = hardware_isa()
    setting = os.environ.get(ISA_ENV) if setting is None else setting
    if setting is None or not setting.strip():
        chosen = set(hw)
    else:
        asked = {s.strip().lower() for s in setting.split(",") if s.strip()}
        _warn_beyond(setting, tuple(sorted(asked - hw)))
        chosen = _closure(asked) & hw
    order = KNOWN_ISA.get(machine(), ())
    return tuple(f for f in order if f in chosen)


def native_bf16(isa: tuple[str, ...] | frozenset[str]) -> bool:
    """bfloat16 dot products in hardware (else bf16 matmuls are emulated and,
    measured on an AVX2-only EPYC, 5-8x slower than float32)."""
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(isa))


@functools.lru_cache(maxsize=8)
def _warn_beyond(setting: str, beyond: tuple[str, ...]) -> None:
    """Once per setting: names that would widen the set are dropped."""
    if beyond:
        log.warning(
            "%s=%s names %s, which this CPU does not have (it has %s): ignored, the set is only ever narrowed",
            ISA_ENV, setting, ", ".join(beyond), ",".join(sorted(hardware_isa())) or "none known",
        )
