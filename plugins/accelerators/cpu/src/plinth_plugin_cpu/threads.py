"""OpenMP threads bound to cores, as vLLM's CPU build binds them
(``VLLM_CPU_OMP_THREADS_BIND``).

Unbound, the kernel's scheduler moves torch's OpenMP threads between cores,
and two of them can share one while another idles; each thread of the team
that runs the model (the calling thread and its workers) is pinned to one
core of the process's allowed set instead. libgomp keeps one team per thread
that starts parallel work, so this runs on the thread that will run the
model, and finds the team's workers as the threads that appear when it first
runs a parallel op. Nothing here assumes a core count: the cores are the
process's affinity mask (or the list given), a rank of several on one node
takes its own slice of them, and binding is skipped, with the reason, when
the team cannot be told apart or there are fewer cores than threads.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("plinth.cpu")

BIND_ENV = "PLINTH_CPU_BIND"


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (Linux's cpulist format)."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    if not cpus or len(set(cpus)) != len(cpus) or min(cpus) < 0:
        raise ValueError(f"not a list of distinct cores: {text!r}")
    return cpus


def _tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def bind_threads(setting: str, *, threads: int, local_rank: int = 0) -> str:
    """Pin the calling thread's OpenMP team, one thread per core; returns
    what was done (for the log). ``setting``: "auto" (the allowed cores),
    "none", or a cpulist for this process."""
    import torch

    if setting == "none":
        return "not bound (none)"
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return "not bound: this OS has no per-thread affinity"
    if setting == "auto":
        allowed = sorted(os.sched_getaffinity(0))
        cpus = allowed[local_rank * threads : (local_rank + 1) * threads]
    else:
        cpus = parse_cpu_list(setting)
    if len(cpus) < threads:
        return f"not bound: {threads} threads, {len(cpus)} cores for them"
    before = _tids()
    x = torch.ones(1 << 22)
    for _ in range(3):  # parallel ops: the team's workers start now if they have not
        x.mul_(1.0)
    workers = sorted(_tids() - before)
    if threads > 1 and len(workers) != threads - 1:
        return f"not bound: expected {threads - 1} new OpenMP workers on this thread, saw {len(workers)}"
    me = threading.get_native_id()
    os.sched_setaffinity(0, {cpus[0]})  # 0: the calling thread (the team's master)
    for tid, cpu in zip(workers, cpus[1:]):
        try:
            os.sched_setaffinity(tid, {cpu})
        except OSError as exc:
            os.sched_setaffinity(0, set(os.sched_getaffinity(os.getpid())))
            return f"not bound: {exc}"
    return f"bound {threads} OpenMP threads (master tid {me}) to cores {','.join(map(str, cpus[:threads]))}"
