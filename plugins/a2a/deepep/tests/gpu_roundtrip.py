"""The deepep plugin on real DeepEP, on every GPU of one machine (run by
gpu_test.sh through torchrun; not collected by pytest): for each generation
the installed DeepEP has, dispatch/combine round trips in both layouts with
f_e(x) = (e + 1) x experts against sum_k w_k f_e(x), and the latency of each.
Exits non-zero on any mismatch."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from plinth.api import PlannedLayout, SelectionContext
from plinth.testing.a2a import _expected, _experts


def main() -> int:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    import deep_ep
    from plinth_plugin_deepep.a2a import DeepEPAllToAll

    experts, hidden, top_k, max_tokens = 32 * world, 7168, 8, 128
    local = torch.cuda.device_count()
    cap = torch.cuda.get_device_capability()
    plan = PlannedLayout(
        world=world, dp=world, ep=world, nnodes=max(1, world // local), local_world=min(world, local), device_type="cuda",
        capability=f"sm_{cap[0]}{cap[1]}", dtype="bfloat16", hidden_size=hidden, num_experts=experts, top_k=top_k,
        max_tokens_per_step=4096, max_num_seqs=max_tokens,
    )  # fmt: skip
    reasons = DeepEPAllToAll.check(SelectionContext(ep=world, layout=plan))
    if reasons:
        print(f"rank {rank}: deepep cannot run: {'; '.join(reasons)}", flush=True)
        return 2
    generations = ["legacy"] + (["v2"] if hasattr(deep_ep, "ElasticBuffer") else [])
    failed = False
    for gen in generations:
        ctx = SelectionContext(ep=world, options={"deepep_generation": gen}, layout=plan)
        a2a = DeepEPAllToAll(ctx, group=dist.group.WORLD, num_experts=experts, hidden_size=hidden)
        a2a.reserve_buffers()
        g = torch.Generator(device="cuda").manual_seed(rank)
        for tokens, decode in ((4096, False), (max_tokens, True), (7, True), (0 if rank == 1 else 33, False)):
            x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
            ids = torch.rand(tokens, experts, device="cuda", generator=g).topk(top_k, -1).indices
            weights = torch.rand(tokens, top_k, device="cuda", generator=g).softmax(-1)
            dist.barrier()
            start = time.perf_counter()
            got, handle = a2a.dispatch(x, ids, weights, decode=decode)
            y = _experts(got, rank * (experts // world), True)
            out = a2a.combine(y, handle)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - start) * 1e3
            want = _expected(x, weights, ids, True)
            err = float((out.float() - want).abs().max() / (1 + want.abs().max())) if tokens else 0.0
            ok = err < 3e-2
            failed |= not ok
            print(f"rank {rank} {gen:6s} {'decode' if decode else 'prefill':7s} {tokens:5d} tokens {got.layout:6s} "
                  f"round trip {ms:8.3f} ms rel err {err:.2e} {'ok' if ok else 'MISMATCH'}", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
