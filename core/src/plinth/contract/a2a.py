"""The a2a category (``--a2a``): MoE all-to-all dispatch and combine."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from plinth.contract.base import PluginDescriptor, PluginImpl, SelectionContext

if TYPE_CHECKING:
    import torch



@dataclass(frozen=True)
class A2ADescriptor(PluginDescriptor):
    """MoE all-to-all (``--a2a``). impl -> an ``AllToAll`` subclass."""

    category: ClassVar[str] = "a2a"


@dataclass
class DispatchedTokens:
    """What ``AllToAll.dispatch`` hands this rank's experts, in one of the two
    layouts DeepEP's kernels produce (expert ids here are local:
    ``0 .. num_local_experts - 1``).

    layout "flat" (DeepEP's normal mode, prefill): x [N, H] are the tokens
        received, each once however many of this rank's experts it chose;
        topk_ids / topk_weights [N, K] its choices, local ids, -1 where the
        expert lives on another rank. The experts return y [N, H], the
        weighted sum over the token's local experts:
        ``ops.fused_moe(x, w13, w2, topk_weights, topk_ids)``.
    layout "padded" (DeepEP's low-latency mode, decode): x [E_local, M, H],
        expert e's tokens in rows 0 .. counts[e] - 1 of x[e] (the rest is
        padding); topk_ids / topk_weights None. The experts return y
        [E_local, M, H], each row its expert's output, unweighted (combine
        applies the weights); padding rows are ignored.
    counts [E_local]: tokens per local expert (int, on the device).
    """

    layout: str
    x: "torch.Tensor"
    counts: "torch.Tensor"
    topk_ids: "torch.Tensor | None" = None
    topk_weights: "torch.Tensor | None" = None


@dataclass(frozen=True)
class PlannedLayout:
    """What start-up knows of a parallel run before any rank exists: the
    process layout, the device kind and the model's MoE shape. An a2a
    plugin's ``check`` judges this (the launcher asks before it spawns a
    rank); what only a live group can tell (buffer allocation, NVSHMEM) is
    the plugin's ``reserve_buffers`` in each rank, before weights load."""

    world: int = 1
    tp: int = 1
    dp: int = 1
    ep: int = 1
    nnodes: int = 1
    #: ranks (devices) per node
    local_world: int = 1
    #: the chosen accelerator's torch device type ("cuda", "cpu", ...)
    device_type: str = ""
    #: its compute capability as the accelerator reports it ("sm_90"), "" if none
    capability: str = ""
    dtype: str = ""
    hidden_size: int = 0
    num_experts: int = 0
    #: experts chosen per token
    top_k: int = 0
    #: the most tokens one rank runs in a step (the step token budget)
    max_tokens_per_step: int = 0
    #: the most sequences in a step (a decode-only step has at most this many tokens)
    max_num_seqs: int = 0


class AllToAll(PluginImpl):
    """Moves MoE tokens to the ranks owning their experts and back.

    Experts are split contiguously over the group by ``expert_ranges``: when
    the group does not divide E, the first ``E % size`` ranks own one expert
    more (vLLM's rule). Every rank of
    the group calls dispatch and combine the same number of times, in the
    same order (a rank with no tokens passes empty tensors). ``check`` runs
    in the launcher before any rank exists, judging ``ctx.layout`` (a
    ``PlannedLayout``: world, tp/dp/ep, nodes, device, dtype, hidden size,
    experts, top-k, tokens per step); ``ctx.layout`` is None in
    ``platform plugins``, where a check answers what it can.
    """

    def __init__(self, ctx: SelectionContext, *, group: Any, num_experts: int, hidden_size: int) -> None:
        self.ctx = ctx
        self.group = group
        self.num_experts = num_experts
        self.hidden_size = hidden_size

    @abc.abstractmethod
    def dispatch(self, hidden: "torch.Tensor", topk_ids: "torch.Tensor", topk_weights: "torch.Tensor", *, decode: bool) -> "tuple[DispatchedTokens, Any]":
        """hidden [T, H], topk_ids [T, K] global expert ids, topk_weights
        [T, K] -> (the tokens this rank's experts must process, a handle for
        combine). ``decode``: the step is decode-only on every rank (a plugin
        may then choose its low-latency layout)."""
        raise NotImplementedError

    @abc.abstractmethod
    def combine(self, expert_out: "torch.Tensor", handle: Any) -> "torch.Tensor":
        """The experts' output in the layout dispatch gave -> hidden [T, H]
        for the tokens this rank dispatched, the weighted sum over top-k."""
        raise NotImplementedError

    def reserve_buffers(self) -> int:
        """Allocate the communication buffers now (collective: every rank of
        the group calls it together, at start-up before weights load) and
        return the device bytes they hold, which the KV budget leaves free.
        A failure here (NVSHMEM init, out of memory) is raised with its reason."""
        return 0

def expert_ranges(num_experts: int, size: int) -> list[range]:
    """The global experts each of ``size`` ranks owns, contiguous and in rank
    order; the first ``num_experts % size`` ranks own one more (as vLLM's
    ``determine_expert_map``). Every MoE model and a2a plugin splits so."""
    base, extra = divmod(num_experts, size)
    out: list[range] = []
    start = 0
    for rank in range(size):
        n = base + (rank < extra)
        out.append(range(start, start + n))
        start += n
    return out
