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
    elif got.layout == "padded":
        y = padded_experts(ops, got.x, got.counts, w13, w2, top_k=topk_ids.shape[1])
    else:
        raise ValueError(f"a2a plugin returned an unknown layout {got.layout!r}")
    out = a2a.combine(y, handle).to(x.dtype)
    if tp_size > 1:
        full = torch.zeros_like(x)
        full[part] = out
        return full
    return out


def padded_experts(ops: Any, x: "torch.Tensor", counts: "torch.Tensor", w13: "torch.Tensor", w2: "torch.Tensor", *, top_k: int) -> "torch.Tensor":
    """The experts over the "padded" layout (x [E_local, M, H], expert e's
    tokens in rows 0 .. counts[e] - 1): each row's own expert, unweighted,
    [E_local, M, H] with zero padding rows.

    Only rows that can hold a token are computed: a token of the M slots
    reaches at most min(top_k, E_local) of this rank's experts, so at most
    ``M * min(top_k, E_local)`` rows are real, against E_local * M padded
    ones (4x fewer at DeepSeek-V3's 32 local experts and top-8). They are
    gathered to the front on the device (a stable sort of the padding
    flags: no host read), where ``fused_moe`` runs on them alone (its float32
    [rows, H] buffer with them); rows of the bound past the real ones get
    expert -1 and stay zero."""
    import torch

    num_local, slots, hidden = x.shape
    device = x.device
    real = (torch.arange(slots, device=device).unsqueeze(0) < counts.to(device).unsqueeze(1)).reshape(-1)
    bound = min(num_local * slots, slots * min(top_k, num_local))
    take = torch.argsort((~real).to(torch.int8), stable=True)[:bound]  # the real rows first, in order
    ids = torch.where(real.index_select(0, take), take // slots, -1).unsqueeze(1)
    ones = torch.ones(ids.shape, dtype=torch.float32, device=device)
    y = ops.fused_moe(x.reshape(-1, hidden).index_select(0, take), w13, w2, ones, ids)
    out = torch.zeros(num_local * slots, hidden, dtype=y.dtype, device=device)  # combine reads padding rows as zeros
    out.index_copy_(0, take, y)
    return out.reshape(num_local, slots, hidden)
