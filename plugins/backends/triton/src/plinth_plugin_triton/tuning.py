"""Launch tuning of the kernels on the GPU they run on.

``triton.autotune`` over num_warps x num_stages, keyed by what is fixed for
a model (head group, head dims, block rows, hidden sizes), so each kernel is
timed once per model shape on the first call, on whatever GPU this is
(Ampere sm_80 and Hopper sm_90 pick differently: more stages pay on
Hopper's larger shared memory). Under Triton's interpreter (tests on CPU)
the kernels stay plain ``@triton.jit``: there autotune needs a single
config and there is nothing to time.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import triton

#: (num_warps, num_stages) tried per kernel kind
CONFIGS = {
    "decode": [(w, s) for w in (2, 4, 8) for s in (1, 2, 3)],
    "prefill": [(w, s) for w in (4, 8) for s in (1, 2, 3)],
    "moe": [(w, s) for w in (4, 8) for s in (2, 3, 4)],
}


def tuned(kind: str, key: list[str]) -> Callable[[Any], Any]:
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        return lambda kernel: kernel
    configs = [triton.Config({}, num_warps=w, num_stages=s) for w, s in CONFIGS[kind]]
    return triton.autotune(configs=configs, key=key)
