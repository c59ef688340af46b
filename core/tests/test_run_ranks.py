"""plinth.testing.run_ranks: real processes over gloo; a rank that raises,
dies or hangs fails the run loudly and in bounded time, leaving no process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from plinth.testing import run_ranks


def sum_of_ranks(rank: int, world: int) -> int:
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t)


def misbehave(rank: int, world: int, how: str) -> int:
    if rank == 1:
        if how == "raise":
            raise RuntimeError("rank 1 broke")
        if how == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang":
            time.sleep(600)
    t = torch.tensor([1])
    dist.all_reduce(t)  # rank 0 waits here for a rank that never comes
    return int(t)


def test_results_by_rank():
    assert run_ranks(sum_of_ranks, 3, timeout=60) == [6, 6, 6]


@pytest.mark.parametrize("how", ["raise", "die", "hang"])
def test_a_failed_rank_fails_the_run_within_the_timeout(how):
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1"):
        run_ranks(misbehave, 2, how, timeout=8)
    assert time.monotonic() - start < 20
    assert not multiprocessing.active_children()
