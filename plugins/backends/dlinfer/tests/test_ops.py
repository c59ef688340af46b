"""The compute ops on the fake dlinfer: fused_moe hands the vendor's routing
only the (token, expert) pairs of this rank's experts (ids of other ranks and
a2a padding computed nothing: they once went to expert 0 with weight 0), and
gives the reference's result."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def ops(fake_dlinfer):
    from plinth.api import SelectionContext
    from plinth.testing import op_table
    from plinth_plugin_dlinfer.ops import make_ops

    reference = op_table(SelectionContext())
    return make_ops({name: getattr(reference, name) for name in reference.names()}), reference


def _count_rows(monkeypatch) -> list[tuple[int, ...]]:
    """The (token, expert) pairs the vendor's routing gets, per call: [(rows, topk), ...]."""
    from dlinfer.vendor.ascend import kernels

    seen: list[tuple[int, ...]] = []
    real = kernels.moe_init_routing_and_mlp

    def counted(hidden_states, gate_up_weights, down_weights, topk_ids, num_experts):
        seen.append(tuple(topk_ids.shape))
        return real(hidden_states, gate_up_weights, down_weights, topk_ids, num_experts)

    monkeypatch.setattr(kernels, "moe_init_routing_and_mlp", counted)
    return seen


def test_pairs_of_other_ranks_and_padding_cost_nothing(ops, monkeypatch):
    mine, reference = ops
    g = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens = 4, 16, 8, 6
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / 4).half()
    w2 = (torch.randn(experts, hidden, inter, generator=g) / 4).half()
    x = torch.randn(tokens, hidden, generator=g).half()
    ids = torch.tensor([[0, 5], [-1, 2], [7, -1], [3, 1], [-1, -1], [2, 9]])  # 5, 7, 9: other ranks; -1: padding
    weights = torch.rand(tokens, 2, generator=g).half()
    seen = _count_rows(monkeypatch)
    got = mine["fused_moe"](x, w13, w2, weights, ids)
    valid = int(((ids >= 0) & (ids < experts)).sum())
    assert sum(r * k for r, k in seen) == valid == 5, seen  # was tokens * topk = 12, the rest at expert 0
    want = reference.fused_moe(x.float(), w13.float(), w2.float(), weights.float(), ids)
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)
    assert got[4].abs().max() == 0  # a token with no expert here

    seen.clear()
    all_here = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2], [1, 3]])
    mine["fused_moe"](x, w13, w2, weights, all_here)
    assert seen == [(tokens, 2)]  # every pair here (ep = 1): the kernel's call as it is
