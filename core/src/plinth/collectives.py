"""The sum over a model's tensor-parallel group, the one collective whose
result depends on its order.

A ring all-reduce (gloo's, NCCL's) cuts the tensor into one chunk per rank
and starts each chunk's sum at another rank, so with three ranks or more an
element's order of addition depends on which chunk it falls in, that is on
the tensor's size: on how many tokens share the step. Deterministic serving
(``--deterministic``) therefore gathers every rank's part and adds them in
rank order (in float32), the same order for every element whatever the
batch. With two ranks both orders give the same bits (a + b == b + a), but
the float32 sum is kept for every size so that one rule holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def all_reduce_sum(x: "torch.Tensor", group: Any, *, fixed_order: bool = False) -> "torch.Tensor":
    """Sum ``x`` over ``group`` into ``x`` (returned); ``group`` None: x as
    it is. ``fixed_order``: every element summed in rank order."""
    if group is None:
        return x
    import torch
    import torch.distributed as dist

    if not fixed_order:
        dist.all_reduce(x, group=group)
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    total = parts[0].float()
    for part in parts[1:]:
        total += part.float()
    x.copy_(total)
    return x
