"""plinth::parallel_take (csrc/common.h), the split of a kernel's work items
over the threads: every item runs exactly once, each thread starts on its own
contiguous run and takes it in order (a weight stream's prefetches run into
the same thread's next item), and a thread that is done takes what another
has left (a preempted or slower thread does not hold the team).

``take_schedule(n, slow, slow_us)`` runs the real scheduler on n items and
reports, per item, the thread that took it, how many times it was taken and
its place among that thread's takes; items below ``slow`` sleep ``slow_us``."""

import pytest
import torch


@pytest.fixture
def torch_threads():
    """use(n): torch's thread count for the test, set back after it; skips where n cannot run."""
    before = torch.get_num_threads()

    def use(n: int) -> None:
        torch.set_num_threads(n)
        if torch.get_num_threads() != n:
            pytest.skip(f"torch cannot run {n} threads here")

    yield use
    torch.set_num_threads(before)


def runs_of(schedule: torch.Tensor, thread: int) -> list[list[int]]:
    """The items ``thread`` took, in the order it took them, cut where the next item does not follow."""
    rows = [(int(p), i) for i, (t, _, p) in enumerate(schedule.tolist()) if t == thread]
    items = [i for _, i in sorted(rows)]
    runs: list[list[int]] = []
    for i in items:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def test_each_item_once_in_contiguous_runs(native_kernels, torch_threads):
    torch_threads(2)
    n = 1000
    schedule = native_kernels.take_schedule(n, 0, 0)
    assert schedule[:, 1].tolist() == [1] * n  # every item, exactly once
    # each thread walks its own share in order and moves only to take the back
    # half of what another has left: a few runs, where a shared counter
    # handing out the next item to whoever asks interleaves the two threads
    runs = runs_of(schedule, 0) + runs_of(schedule, 1)
    assert len(runs) <= 24, [(r[0], len(r)) for r in runs]
    # thread 1's share starts at n / 2: that item begins a run, whoever took it
    assert any(r[0] == n // 2 for r in runs)


def test_a_slow_thread_leaves_its_items_to_the_other(native_kernels, torch_threads):
    torch_threads(2)
    # thread 0's share (items 0..99) sleeps 2 ms an item, thread 1's (100..199)
    # is instant: thread 1 runs out first and takes from the back of thread 0's
    # run. Scheduling on a loaded machine can keep thread 1 off the CPU for a
    # whole run, so up to three tries
    n = 200
    for _ in range(3):
        schedule = native_kernels.take_schedule(n, n // 2, 2000)
        assert schedule[:, 1].tolist() == [1] * n
        takers = schedule[:, 0].tolist()
        stolen = [i for i in range(n // 2) if takers[i] == 1]
        if len(stolen) >= 20:
            break
    assert len(stolen) >= 20, f"thread 1 took only {stolen} of the slow run"
    # what it took is the back of the run: it started at the middle of what was left
    thread1_runs = runs_of(schedule, 1)
    assert any(n // 4 <= r[0] < n // 2 for r in thread1_runs), thread1_runs


def test_one_thread_takes_everything_in_order(native_kernels, torch_threads):
    torch_threads(1)
    schedule = native_kernels.take_schedule(50, 0, 0)
    assert schedule[:, 0].tolist() == [0] * 50
    assert schedule[:, 1].tolist() == [1] * 50
    assert schedule[:, 2].tolist() == list(range(50))
