"""Building and loading the C++ kernels (csrc/cpu_ops.cpp).

Compiled at first use with ``torch.utils.cpp_extension.load_inline``
(``-O3 -march=native -ffast-math -fopenmp``; about 30-40 s on 2 cores) and
cached by torch in ``$TORCH_EXTENSIONS_DIR``, keyed by the source, the flags
and this CPU's feature flags (the build is tuned to the CPU it runs on).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
from pathlib import Path
from typing import Any

from plinth.api import PluginError

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
FUNCTIONS = ["paged_decode_attention", "rms_norm", "silu_and_mul", "rotary"]
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_kernels: Any = None


def _cpu_tag() -> str:
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.blake2b(flags.encode(), digest_size=4).hexdigest()


def compiler_missing() -> str | None:
    """Why the kernels cannot be built here, or None."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx}) to build its kernels"
    if importlib.util.find_spec("ninja") is None:
        return "ninja is not installed (pip install ninja) to build its kernels"
    return None


def load_kernels(verbose: bool = False) -> Any:
    """The compiled kernel module (built once per machine and source)."""
    global _kernels
    if _kernels is None:
        from torch.utils.cpp_extension import load_inline

        source = SOURCE.read_text()
        digest = hashlib.blake2b((source + " ".join(CFLAGS)).encode(), digest_size=4).hexdigest()
        try:
            _kernels = load_inline(
                name=f"plinth_cpukernels_{digest}_{_cpu_tag()}",
                cpp_sources=[source],
                functions=FUNCTIONS,
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                verbose=verbose,
            )
        except Exception as exc:  # a missing or failing compiler: say so, never fall back silently
            raise PluginError(
                f"cpukernels could not build its kernels ({type(exc).__name__}: {str(exc)[-400:]}); "
                "install a C++ compiler and ninja, or choose --backend torch"
            ) from exc
    return _kernels
