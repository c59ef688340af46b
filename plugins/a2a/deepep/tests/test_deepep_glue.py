"""The plugin's glue against a fake ``deep_ep`` shaped like DeepEP 2.x's API
(tests/fake/deep_ep), on 2 real processes over gloo: argument plumbing,
buffer sizing from the hints, both layouts (normal -> flat, low-latency ->
padded, FP8 low-latency dequantized), V2 slack rows and handle caching."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
import torch.distributed as dist
from plinth.api import SelectionContext
from plinth.testing import run_ranks
from plinth.testing.a2a import _expected, _experts

#: put on sys.path only in the rank processes: this process must not find a deep_ep
FAKE = str(pathlib.Path(__file__).parent / "fake")


def glue_rank(rank: int, world: int, generation: str, fp8: bool) -> dict:
    sys.path.insert(0, FAKE)
    import deep_ep
    from plinth_plugin_deepep.a2a import DeepEPAllToAll

    assert deep_ep.__file__.startswith(FAKE)
    experts, hidden, per = 8, 256, 8 // world
    ctx = SelectionContext(ep=world, options={"deepep_generation": generation, "deepep_fp8": fp8, "deepep_max_tokens_per_rank": 16})
    a2a = DeepEPAllToAll(ctx, group=dist.group.WORLD, num_experts=experts, hidden_size=hidden, num_topk=2)
    g = torch.Generator().manual_seed(rank)
    errors, layouts = [], []
    for step, (tokens, decode) in enumerate([(9 + rank, False), (0 if rank else 5, False), (3, True), (3, True), (4, True)]):
        if step == 3:  # the same routing as the step before, on every rank: V2 reuses its handle
            pass
        else:
            x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
            ids = torch.rand(tokens, experts, generator=g).topk(2, -1).indices
            weights = torch.rand(tokens, 2, generator=g).softmax(-1)
        for scaled in (False, True):
            got, handle = a2a.dispatch(x, ids, weights, decode=decode)
            layouts.append(got.layout)
            y = a2a.combine(_experts(got, rank * per, scaled), handle)
            want = _expected(x, weights, ids, scaled)
            errors.append(float((y.float() - want).abs().max()) / (1 + float(want.abs().max())) if tokens else 0.0)
            assert y.dtype == x.dtype and y.shape == x.shape
    over_cap = None
    if generation == "legacy":  # a decode step over the cap is an error on that rank, never a switch of kernels
        x = torch.randn(17, hidden).to(torch.bfloat16)
        try:
            a2a.dispatch(x, torch.zeros(17, 2, dtype=torch.long), torch.ones(17, 2) / 2, decode=True)
        except Exception as exc:  # PluginError
            over_cap = str(exc)
    return {"errors": errors, "layouts": layouts, "calls": list(deep_ep.CALLS), "over_cap": over_cap}


@pytest.mark.parametrize("generation,fp8", [("legacy", False), ("legacy", True), ("v2", False)])
def test_round_trips_through_the_fake(generation, fp8):
    out = run_ranks(glue_rank, 2, generation, fp8, timeout=120)
    tol = 0.08 if fp8 else 0.02  # bf16 on the wire (and e4m3 with per-128 scales)
    for rank, o in enumerate(out):
        assert max(o["errors"]) < tol, (rank, o["errors"])
        names = [name for name, _ in o["calls"]]
        if generation == "legacy":
            assert o["layouts"] == ["flat"] * 4 + ["padded"] * 6
            buffers = [kw for name, kw in o["calls"] if name == "Buffer"]
            assert [b["low_latency_mode"] for b in buffers] == [False, True]
            assert buffers[0]["num_nvl_bytes"] == 256 * 2 * 2 * 1024  # the Config hint for bf16 tokens, 2 ranks
            assert buffers[1]["num_rdma_bytes"] == 16 * 256 * 8 * 4 and buffers[1]["num_qps_per_rank"] == 4
            ll = [kw for name, kw in o["calls"] if name == "low_latency_dispatch"]
            assert all(kw["num_max"] == 16 and kw["num_experts"] == 8 and kw["use_fp8"] == fp8 for kw in ll)
            assert names.count("dispatch") == 4 and names.count("low_latency_combine") == 6
            assert o["over_cap"] and "at least --max-num-seqs" in o["over_cap"]
        else:
            assert o["layouts"] == ["flat"] * 10
            assert [kw for name, kw in o["calls"] if name == "ElasticBuffer"] == [dict(num_max_tokens_per_rank=16, hidden=256, num_topk=2)]
            cached = [kw["cached"] for name, kw in o["calls"] if name == "elastic_dispatch"]
            # steps 3 and 4 repeat the routing of the decode step before them (both ranks agree): cached handle
            assert cached == [False, False, False, False, False, True, True, True, False, True]
