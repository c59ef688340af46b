"""The experts over the "padded" a2a layout (DeepEP's low-latency mode):
only the rows that can hold a token reach ``fused_moe`` (at most
M x min(top_k, E_local) of the E_local x M), the result equal to running
every row's own expert, padding rows zero, and no host read."""

from __future__ import annotations

import torch
from plinth.api import DispatchedTokens, routed_experts
from plinth.moe import padded_experts
from plinth_plugin_torch.ops import fused_moe


class Ops:
    """The reference fused_moe, recording the rows each call gets."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def fused_moe(self, x, w13, w2, weights, ids):
        self.rows.append(x.shape[0])
        return fused_moe(x, w13, w2, weights, ids)


def _padded(num_local: int, slots: int, hidden: int, counts: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_local, slots, hidden, generator=g)
    for e, c in enumerate(counts):
        x[e, c:] = float("nan")  # padding is garbage (DeepEP's receive buffer): it must never be read
    return x, torch.tensor(counts, dtype=torch.int32)


def _weights(num_local: int, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(num_local, 2 * inter, hidden, generator=g) / 4, torch.randn(num_local, hidden, inter, generator=g) / 4


def test_only_rows_that_can_hold_a_token_are_computed():
    num_local, slots, hidden, inter, top_k = 8, 12, 16, 24, 2
    counts = [12, 0, 3, 5, 0, 1, 2, 1]  # 24 real rows: 12 slots x top-2 at most
    x, c = _padded(num_local, slots, hidden, counts)
    w13, w2 = _weights(num_local, hidden, inter)
    ops = Ops()
    y = padded_experts(ops, x, c, w13, w2, top_k=top_k)
    assert ops.rows == [slots * top_k]  # not num_local * slots = 96
    assert y.shape == x.shape and torch.isfinite(y).all()
    ones = torch.ones(1, 1)
    for e, n in enumerate(counts):
        for r in range(slots):
            want = fused_moe(x[e, r : r + 1], w13, w2, ones, torch.tensor([[e]])) if r < n else torch.zeros(1, hidden)
            torch.testing.assert_close(y[e, r : r + 1], want, rtol=1e-5, atol=1e-5)


def test_the_bound_is_every_row_when_top_k_reaches_every_local_expert():
    x, c = _padded(2, 4, 8, [4, 2])
    w13, w2 = _weights(2, 8, 8)
    ops = Ops()
    padded_experts(ops, x, c, w13, w2, top_k=8)
    assert ops.rows == [8]


class PaddedA2A:
    """An a2a that hands the padded layout (one rank: every expert here)."""

    def __init__(self, num_local: int, slots: int) -> None:
        self.num_local, self.slots = num_local, slots

    def dispatch(self, hidden, topk_ids, topk_weights, *, decode):
        x = torch.full((self.num_local, self.slots, hidden.shape[1]), float("nan"))
        counts = torch.zeros(self.num_local, dtype=torch.int32)
        src = []
        for t in range(hidden.shape[0]):
            for k in range(topk_ids.shape[1]):
                e = int(topk_ids[t, k])
                x[e, counts[e]] = hidden[t]
                src.append((e, int(counts[e]), t, float(topk_weights[t, k])))
                counts[e] += 1
        return DispatchedTokens("padded", x, counts), (src, hidden.shape[0])

    def combine(self, y, handle):
        src, n = handle
        out = torch.zeros(n, y.shape[-1])
        for e, r, t, w in src:
            out[t] += w * y[e, r]
        return out


def test_routed_experts_over_the_padded_layout_equals_the_local_experts():
    g = torch.Generator().manual_seed(2)
    tokens, num_local, hidden, inter, top_k = 6, 8, 16, 24, 2
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.rand(tokens, num_local, generator=g).topk(top_k, -1).indices
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    w13, w2 = _weights(num_local, hidden, inter)
    ops = Ops()
    got = routed_experts(ops, x, w13, w2, weights, ids, a2a=PaddedA2A(num_local, tokens), decode=True)
    torch.testing.assert_close(got, fused_moe(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)
    assert ops.rows == [tokens * top_k]
