"""The parallel layout: tensor (tp), data (dp) and expert (ep) parallelism
over one torch.distributed world, and its process groups.

    world = tp x dp            rank = dp_rank * tp + tp_rank
    ep    = 1 or world         (ep > tp with no dp given means dp = ep / tp)

    dp_rank 0:  rank 0  rank 1   <- tp group 0 (attention heads, dense MLPs,
    dp_rank 1:  rank 2  rank 3   <- tp group 1  vocabulary split over it)
                  |       |
               dp group  dp group (same tp_rank: the same shard of the weights)
                \\______ep group (every rank; experts split over it)______/

Each dp rank serves its own requests; the tp ranks of a dp rank hold the same
tokens. TP, DP and EP are separate groups (``new_group`` is collective: every
rank creates every group, in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plinth.errors import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    dp: int
    ep: int

    @classmethod
    def resolve(cls, tp: int, dp: int | None, ep: int) -> "ParallelLayout":
        """The layout of ``--tp``, ``--dp`` (None: from ep) and ``--ep``."""
        if tp < 1 or ep < 1 or (dp is not None and dp < 1):
            raise ConfigError("tp, dp and ep must be >= 1")
        if dp is None:
            if ep > tp:
                if ep % tp:
                    raise ConfigError(f"ep={ep} is not a multiple of tp={tp}")
                dp = ep // tp
            else:
                dp = 1
        layout = cls(tp, dp, ep)
        if ep not in (1, layout.world):
            raise ConfigError(f"ep must be 1 or the world size tp x dp = {layout.world}, got ep={ep}")
        return layout

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of a global rank."""
        return divmod(rank, self.tp)

    def tp_ranks(self, dp_rank: int) -> list[int]:
        return [dp_rank * self.tp + t for t in range(self.tp)]

    def dp_ranks(self, tp_rank: int) -> list[int]:
        return [d * self.tp + tp_rank for d in range(self.dp)]


@dataclass
class ParallelGroups:
    layout: ParallelLayout
    rank: int
    dp_rank: int
    tp_rank: int
    tp_group: Any
    dp_group: Any
    ep_group: Any  # None when ep = 1

    @property
    def ep_rank(self) -> int:
        return self.rank if self.layout.ep > 1 else 0


def init_groups(layout: ParallelLayout, rank: int, timeout: Any = None) -> ParallelGroups:
    """Create the TP, DP and EP groups (after ``init_process_group``; every
    rank calls this, and creates every group in the same order). ``timeout``
    (a timedelta) bounds every collective of these groups: the engine gives a
    short one, so a hung rank is an error, not a hang."""
    import torch.distributed as dist

    if dist.get_world_size() != layout.world:
        raise ConfigError(f"the world has {dist.get_world_size()} ranks, the layout {layout} needs {layout.world}")
    dp_rank, tp_rank = layout.coords(rank)
    tp_group = dp_group = None
    for d in range(layout.dp):
        group = dist.new_group(layout.tp_ranks(d), timeout=timeout)
        if d == dp_rank:
            tp_group = group
    for t in range(layout.tp):
        group = dist.new_group(layout.dp_ranks(t), timeout=timeout)
        if t == tp_rank:
            dp_group = group
    ep_group = dist.new_group(list(range(layout.world)), timeout=timeout) if layout.ep > 1 else None
    return ParallelGroups(layout, rank, dp_rank, tp_rank, tp_group, dp_group, ep_group)


def warm_up_group(group: Any, device: Any) -> None:
    """One collective on ``group`` with a tensor on ``device``: a backend
    that forms its communicator lazily (NCCL without a bound device) forms it
    now. A plugin that reuses the group's communicator (DeepEP V2 reads
    ``_comm_ptr()``, 0 on a group that has none) finds one; every rank of
    the group calls this together. The one place start-up warms a group, so
    a test (or a fake library) can watch it."""
    import torch
    import torch.distributed as dist

    if group is None:
        return
    dist.all_reduce(torch.zeros(1, device=device), group=group)
