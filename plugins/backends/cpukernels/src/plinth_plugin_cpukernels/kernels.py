"""Building and loading the C++ kernels (csrc/cpu_ops.cpp).

The code is plain C++ (no intrinsics); the compiler vectorizes it for the
instruction sets the accelerator reports, passed as explicit ``-m`` flags
rather than ``-march=native``. The build is cached by torch in
``$TORCH_EXTENSIONS_DIR`` under a name keyed by the source, the flags (so by
the instruction sets) and torch's version: a cache made on another CPU (a
shared ``.venv``, a container image) is used only if it was built for the same
extensions, and otherwise a new build is made, so it never executes an
instruction this CPU lacks. A narrowed set (``PLINTH_CPU_ISA``) builds with
the narrowed flags. About 30-40 s on 2 cores.

Builds go in ``$TORCH_EXTENSIONS_DIR/plinth/<name>`` (torch's default root
when unset), one process at a time under an ``flock`` that the kernel drops
when its holder dies: torch's own lock is a file that a build killed midway
(Ctrl-C, a timeout) leaves behind, and every later start would wait on it
forever; holding the flock, such a file can only be stale, so it goes.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator

from plinth.api import PluginError

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
#: what every source shares (the threads' work queue, a transpose): put before each source's text
SHARED = Path(__file__).parent / "csrc" / "common.h"
FUNCTIONS = [
    "paged_attention", "paged_decode_attention", "paged_qkv_attention", "rms_norm", "silu_and_mul", "rotary", "set_amx_attention",
    "zeros_on_large_pages", "take_schedule",
]
BASE_CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]

#: x86 extension (Linux's name) -> the GCC/Clang flag that lets the compiler use it
X86_FLAGS = {
    "sse4_2": "-msse4.2", "avx": "-mavx", "avx2": "-mavx2", "fma": "-mfma", "f16c": "-mf16c",
    "avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl", "avx512dq": "-mavx512dq",
    "avx512cd": "-mavx512cd", "avx512_bf16": "-mavx512bf16", "avx512_vnni": "-mavx512vnni",
    "avx_vnni": "-mavxvnni", "amx_tile": "-mamx-tile", "amx_bf16": "-mamx-bf16",
}
#: aarch64 extension -> its -march modifier
ARM_EXTENSIONS = {"asimdhp": "fp16", "asimddp": "dotprod", "sve": "sve", "bf16": "bf16", "i8mm": "i8mm"}

_kernels: dict[str, Any] = {}
#: the file torch's builder creates (and removes) in the build directory while it builds
TORCH_LOCK_FILE = "lock"


def isa_cflags(isa: Iterable[str], machine: str | None = None) -> list[str]:
    """Compiler flags for exactly these extensions (none known: a generic build)."""
    isa = set(isa)
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        # -mtune only schedules: safe on any CPU with these extensions
        return [flag for name, flag in X86_FLAGS.items() if name in isa] + ["-mtune=native"]
    if machine in ("aarch64", "arm64"):
        mods = [m for name, m in ARM_EXTENSIONS.items() if name in isa]
        return [f"-march=armv8.2-a+{'+'.join(mods)}"] if mods else ["-march=armv8-a"]
    return []


#: how every kernel is bound to Python: torch's error handling, and the GIL
#: released while it runs (load_inline's own bindings keep it held), so the
#: server's event loop, on another thread, streams and parses requests while
#: a step's kernels run instead of waiting for the next Python line between
#: them. The kernels take tensors and numbers only, never a Python object.
BINDING = "torch::wrap_pybind_function_no_gil"


def bindings(functions: list[str]) -> str:
    """The pybind11 module that binds ``functions`` with ``BINDING``."""
    lines = [f'  m.def("{name}", {BINDING}({name}), "{name}");' for name in functions]
    return "\n".join(["PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {", *lines, "}"])


def build_name(isa: Iterable[str], source: Path = SOURCE, prefix: str = "plinth_cpukernels", functions: list[str] | None = None) -> str:
    """The build's name: a hash of everything compiled into it (the shared
    header, the source, the bindings of ``functions``, default ``FUNCTIONS``),
    the flags, the machine and torch. The bindings too: two checkouts that
    bind other functions of one source would otherwise rebuild each other's
    directory on every load."""
    import torch

    flags = BASE_CFLAGS + isa_cflags(isa)
    binds = bindings(FUNCTIONS if functions is None else functions)
    key = "|".join([SHARED.read_text(), source.read_text(), binds, " ".join(flags), platform.machine(), torch.__version__])
    return f"{prefix}_{hashlib.blake2b(key.encode(), digest_size=6).hexdigest()}"


def build_directory(name: str) -> Path:
    """Where the build called ``name`` lives (created)."""
    from torch.utils.cpp_extension import get_default_build_root

    path = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "plinth" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Held while this process builds or loads ``build_dir``: another process
    building it is waited for; a torch lock file left there by a dead build
    is removed (every live builder holds this lock first)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's lock file alone
        yield
        return
    with open(build_dir.parent / f"{build_dir.name}.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / TORCH_LOCK_FILE).unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compiler_missing() -> str | None:
    """Why the kernels cannot be built here, or None."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx}) to build its kernels"
    if importlib.util.find_spec("ninja") is None:
        return "ninja is not installed (pip install ninja) to build its kernels"
    return None


#: the C++ standard torch's extension builds use (torch 2.13: c++20)
CXX_STD = "-std=c++20"


def compile_assembly(source: Path, isa: Iterable[str], *, extra_flags: Iterable[str] = (), machine: str | None = None) -> str:
    """The assembly the compiler makes of ``source`` (with ``SHARED``) for
    these extensions, with the flags ``load_extension`` builds it with, plus
    ``extra_flags``; nothing is loaded, so it works for extensions this CPU
    lacks (the AMX assembly test reads it)."""
    import subprocess
    import sysconfig
    import tempfile

    from torch.utils.cpp_extension import include_paths

    flags = BASE_CFLAGS + isa_cflags(isa, machine) + list(extra_flags)
    includes = [f"-isystem{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "unit.cpp"
        text.write_text("\n".join(["#include <torch/extension.h>", SHARED.read_text(), source.read_text()]))
        out = Path(tmp) / "unit.s"
        cxx = os.environ.get("CXX", "c++")
        cmd = [cxx, "-S", CXX_STD, "-fPIC", "-DTORCH_EXTENSION_NAME=assembly", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes, *flags, str(text), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise PluginError(f"cpukernels: {' '.join(cmd[:3])} ... failed: {done.stderr[-2000:]}")
        return out.read_text()


def load_kernels(isa: Iterable[str], verbose: bool = False) -> Any:
    """The compiled kernel module for these extensions (built once per set and source)."""
    return load_extension(SOURCE, FUNCTIONS, isa, verbose=verbose)


def load_extension(source: Path, functions: list[str], isa: Iterable[str], *, prefix: str = "plinth_cpukernels", verbose: bool = False) -> Any:
    """One C++ source built as its own extension for these extensions, keyed
    by the source, the flags and torch (built once per key)."""
    isa = tuple(sorted(set(isa)))
    name = build_name(isa, source, prefix, functions)
    if name not in _kernels:
        from torch.utils.cpp_extension import load_inline

        flags = BASE_CFLAGS + isa_cflags(isa)
        build_dir = build_directory(name)
        try:
            with build_lock(build_dir):
                _kernels[name] = load_inline(
                    name=name,
                    cpp_sources=[SHARED.read_text(), source.read_text(), bindings(functions)],
                    extra_cflags=flags,
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir),
                    verbose=verbose,
                )
        except Exception as exc:  # a missing or failing compiler: say so, never fall back silently
            raise PluginError(
                f"cpukernels could not build its kernels with {' '.join(flags)} "
                f"({type(exc).__name__}: {str(exc)[-400:]}); install a C++ compiler and ninja, or choose --backend torch"
            ) from exc
    return _kernels[name]
