"""Running a layer's routed experts, here or through the a2a plugin: the one
path every MoE model plugin calls (the llama plugin's Mixtral / Qwen-MoE
and the deepseek plugin's DeepSeek-V3), so each a2a layout is handled once.

torch is imported by the caller's tensors only; importing this module stays
cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from plinth.contract.a2a import AllToAll


def local_experts(num_experts: int, ep_rank: int, ep_size: int, *, has_a2a: bool) -> range:
    """The routed experts ep rank ``ep_rank`` keeps (all of them at ep = 1),
    split as ``expert_ranges`` says; a ``ConfigError`` where ep cannot work:
    ep > 1 without an a2a plugin to move the tokens, or more ranks than
    experts (a rank would own none)."""
    from plinth.contract.a2a import expert_ranges
    from plinth.errors import ConfigError

    if ep_size > 1 and num_experts:
        if not has_a2a:
            raise ConfigError("ep > 1 needs an a2a plugin (--a2a) to move tokens between the ranks' experts")
        if ep_size > num_experts:
            raise ConfigError(f"ep={ep_size} is more than the model's {num_experts} routed experts: a rank would own none")
    return expert_ranges(num_experts, ep_size)[ep_rank] if num_experts else range(0)


def tp_token_slice(num_tokens: int, tp_rank: int, tp_size: int) -> slice:
    """The tokens tp rank ``tp_rank`` dispatches to the experts when ep > 1:
    the tp ranks of a group hold the same tokens, so each sends 1/tp of them
    and the layer's tp all-reduce puts the slices together."""
    per = -(-num_tokens // tp_size)
    return slice(min(num_tokens, tp_rank * per), min(num_tokens, (tp_rank + 1) * per))


def routed_experts(ops: Any, x: "torch.Tensor", w13: "torch.Tensor", w2: "torch.Tensor", topk_weights: "torch.Tensor",
                   topk_ids: "torch.Tensor", *, a2a: "AllToAll | None" = None, decode: bool = False, tp_rank: int = 0,
                   tp_size: int = 1) -> "torch.Tensor":
    """The weighted sum of each token's chosen experts, [T, H] in x's dtype.

    ``a2a`` None: every expert is here (w13 [E, 2I, H], w2 [E, H, I], whole or
    each expert's tp slice), one ``fused_moe``. Otherwise w13 / w2 hold this
    ep rank's experts whole and ``topk_ids`` are global: the tokens travel
    through ``a2a.dispatch`` in the layout the plugin chooses ("flat" or
    "padded", see ``DispatchedTokens``) and back through ``combine``. With
    tp > 1 the result holds only this tp rank's token slice (zeros
    elsewhere): the caller's tp all-reduce completes it, as it completes a
    row-parallel projection. ``decode`` must agree over the expert group
    (``AttentionMetadata.moe_decode``)."""
    import torch

    if a2a is None:
        return ops.fused_moe(x, w13, w2, topk_weights, topk_ids)
    part = tp_token_slice(x.shape[0], tp_rank, tp_size) if tp_size > 1 else slice(None)
    got, handle = a2a.dispatch(x[part], topk_ids[part], topk_weights[part], decode=decode)
    if got.layout == "flat":
        y = ops.fused_moe(got.x, w13, w2, got.topk_weights, got.topk_ids)
    elif got.layout == "padded":  # [E_local, M, H]: expert e's rows first, padding after
        num_local, slots, hidden = got.x.shape
        device = got.x.device
        rows = torch.arange(slots, device=device).unsqueeze(0) < got.counts.to(device).unsqueeze(1)
        ids_padded = torch.where(rows, torch.arange(num_local, device=device).unsqueeze(1), -1).reshape(-1, 1)
        ones = torch.ones(ids_padded.shape, dtype=torch.float32, device=device)
        y = ops.fused_moe(got.x.reshape(-1, hidden), w13, w2, ones, ids_padded).reshape(num_local, slots, hidden)
    else:
        raise ValueError(f"a2a plugin returned an unknown layout {got.layout!r}")
    out = a2a.combine(y, handle).to(x.dtype)
    if tp_size > 1:
        full = torch.zeros_like(x)
        full[part] = out
        return full
    return out
