"""The plugin's own behaviour beyond the kit: check() before any world
exists, a token sent once per rank however many of its experts live there,
and the flat layout forced for decode."""

from __future__ import annotations

import torch
import torch.distributed as dist
from plinth.api import SelectionContext
from plinth.testing import run_ranks
from plinth_plugin_nccl.a2a import CollectiveAllToAll


def test_check_needs_no_world():
    assert CollectiveAllToAll.check(SelectionContext(ep=2)) == []


def rows_per_rank(rank: int, world: int) -> dict:
    a2a = CollectiveAllToAll(SelectionContext(ep=world), group=dist.group.WORLD, num_experts=4 * world, hidden_size=8, decode_layout="flat")
    # 3 tokens from each rank; token 0 picks two experts of rank 0, token 1 one of rank 0 and one of rank 1,
    # token 2 two of the last rank
    ids = torch.tensor([[0, 1], [2, 4], [4 * world - 1, 4 * world - 2]])
    x = torch.arange(3 * 8, dtype=torch.float32).reshape(3, 8) + 100 * rank
    w = torch.full((3, 2), 0.5)
    got, handle = a2a.dispatch(x, ids, w, decode=True)
    y = a2a.combine(got.x * (torch.where(got.topk_ids >= 0, got.topk_weights, 0).sum(-1, keepdim=True)), handle)
    return {"layout": got.layout, "received": got.x.shape[0], "counts": got.counts.tolist(), "ok": bool(torch.allclose(y, x))}


def test_one_row_per_token_and_rank_and_flat_decode():
    out = run_ranks(rows_per_rank, 2, timeout=60)
    # rank 0 receives: tokens 0 and 1 of both ranks (4 rows); rank 1: token 1 and 2 of both ranks (4 rows)
    assert [o["received"] for o in out] == [4, 4]
    assert out[0]["counts"] == [2, 2, 2, 0] and out[1]["counts"] == [2, 0, 2, 2]
    assert all(o["layout"] == "flat" and o["ok"] for o in out)
