"""The sparse MLP of Mixtral, Qwen2-MoE and Qwen3-MoE, through the backend's
``fused_moe`` op (and the a2a plugin when experts live on other ranks).

Routing as each architecture defines it: router logits in the activation
dtype, softmax over all experts in float32, top-k, then (Mixtral always,
Qwen when ``norm_topk_prob``) the k weights renormalized to sum 1; Qwen
casts the weights back to the activation dtype, Mixtral keeps them in
float32. Qwen2-MoE adds a shared expert scaled by sigmoid(shared_expert_gate(x)).
"""

from __future__ import annotations

from typing import Any

import torch
from plinth.api import routed_experts

from plinth_plugin_llama.parallel import Parallel


class MoEBlock:
    """One layer's experts. ``__call__`` returns this rank's part of the
    output: the caller all-reduces it over tp when tp > 1."""

    __slots__ = (
        "ops", "par", "router", "w13", "w2", "top_k", "renormalize", "weights_in_activation_dtype",
        "shared_gate_up", "shared_down", "shared_gate",
    )

    def __init__(self, ops: Any, par: Parallel, *, router: Any, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                 renormalize: bool, weights_in_activation_dtype: bool, shared_gate_up: Any = None,
                 shared_down: Any = None, shared_gate: Any = None) -> None:
        self.ops, self.par = ops, par
        self.router, self.w13, self.w2 = router, w13, w2
        self.top_k, self.renormalize = top_k, renormalize
        self.weights_in_activation_dtype = weights_in_activation_dtype
        self.shared_gate_up, self.shared_down, self.shared_gate = shared_gate_up, shared_down, shared_gate

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights, topk_ids) [T, K], global expert ids."""
        probs = torch.softmax(self.ops.linear(x, self.router).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_activation_dtype:
            weights = weights.to(x.dtype)
        return weights, ids

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, decode: bool) -> torch.Tensor:
        par = self.par
        return routed_experts(self.ops, x, self.w13, self.w2, weights, ids, a2a=par.a2a, decode=decode,
                              tp_rank=par.tp_rank, tp_size=par.tp_size)

    def __call__(self, x: torch.Tensor, decode: bool = False) -> torch.Tensor:
        ops = self.ops
        weights, ids = self.route(x)
        y = self.experts(x, weights, ids, decode)
        if self.shared_gate_up is not None:
            shared = ops.linear(ops.silu_and_mul(ops.linear(x, self.shared_gate_up)), self.shared_down)
            y = y + torch.sigmoid(ops.linear(x, self.shared_gate)) * shared
        return y

    def weights(self) -> list[Any]:
        return [w for w in (self.router, self.w13, self.w2, self.shared_gate_up, self.shared_down, self.shared_gate) if w is not None]
