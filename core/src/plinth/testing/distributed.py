"""Run a function on N real processes joined in one torch.distributed group
(127.0.0.1, a free port), for tests of parallel code: every rank's result
comes back, and a rank that raises, dies or overstays fails the whole run,
loudly and within the timeout, with every rank stopped."""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(target: str, rank: int, world: int, port: int, backend: str, args: tuple, timeout: float, results: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        module, _, attr = target.partition(":")
        fn = getattr(importlib.import_module(module), attr)
        out = fn(rank, world, *args)
        results.put((rank, True, out))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(target: str | Callable[..., Any], world: int, *args: Any, backend: str = "gloo", timeout: float = 120.0) -> list[Any]:
    """``target(rank, world, *args)`` on ``world`` processes (spawned; target
    a module-level function or its ``"module:attr"``); returns the results by
    rank, or raises AssertionError with every failed rank's traceback."""
    if not isinstance(target, str):
        target = f"{target.__module__}:{target.__qualname__}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(target, r, world, port, backend, args, timeout, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout

    def gather_failures() -> None:
        time.sleep(0.5)  # other ranks' tracebacks may still be on their way
        while not results.empty():
            rank, ok, out = results.get()
            got[rank] = (ok, out)
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0) and r not in got:
                got[r] = (False, f"rank {r} died (exit code {p.exitcode})")

    try:
        while len(got) < world:
            try:
                rank, ok, out = results.get(timeout=0.2)
                got[rank] = (ok, out)
                if not ok:  # one failure fails the run: stop the others now
                    gather_failures()
                    break
                continue
            except queue_mod.Empty:
                pass
            if any(p.exitcode not in (None, 0) and r not in got for r, p in enumerate(procs)):
                gather_failures()
                break
            if time.monotonic() > deadline:
                for r in range(world):
                    got.setdefault(r, (False, f"rank {r} gave no result within {timeout:.0f} s"))
                break
    finally:
        for p in procs:
            p.join(timeout=5 if all(ok for ok, _ in got.values()) and len(got) == world else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    failures = {r: out for r, (ok, out) in sorted(got.items()) if not ok}
    if failures or len(got) < world:
        raise AssertionError(f"{target} on {world} ranks failed:\n" + "\n".join(f"--- rank {r}:\n{out}" for r, out in failures.items()))
    return [got[r][1] for r in range(world)]
