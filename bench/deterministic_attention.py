"""Prefill attention in --deterministic mode against the default path, on
SmolLM2-135M's shapes (9 query heads, 3 KV heads, D=64): one layer's
attention for a prompt of N tokens from position 0, through the attention
backends start-up builds (cpukernels: its batch-invariant kernel vs the reference's
SDPA; torch: its batch-invariant form vs SDPA).

    .venv/bin/python bench/deterministic_attention.py [--tokens 128,512] [--backends cpukernels,torch]

Wall time per call, best of ``--rounds`` taken in turn with the other path
(other processes only ever add time; say in the figure whether the machine was loaded), with torch's
threads as configured (2 here). Prints ms per call and the deterministic
path's cost as a ratio to the default one."""

from __future__ import annotations

import argparse
import time

import torch


def best_time(attention, q, k, v, cache, meta, scale: float, rounds: int) -> float:
    """Best wall time of one attention call over ``rounds`` (after a warm-up)."""
    times = []
    for _ in range(rounds + 1):
        t = time.perf_counter()
        attention.forward(q, k, v, cache, meta, scale=scale)
        times.append(time.perf_counter() - t)
    return min(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--tokens", default="128,512")
    p.add_argument("--backends", default="cpukernels,torch")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    from plinth.api import SelectionContext, load_accelerator
    from plinth.testing import attention_backend, attention_metadata

    acc = load_accelerator("cpu")
    hq, hkv, d = 9, 3, 64
    print(f"torch threads {torch.get_num_threads()}; {hq}/{hkv} heads, D={d}, page size {args.page_size}")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for backend in args.backends.split(","):
            tables = {det: attention_backend(SelectionContext(accelerator=acc, dtype=dtype, deterministic=det), backend) for det in (False, True)}
            for n in (int(x) for x in args.tokens.split(",")):
                g = torch.Generator().manual_seed(n)
                q = torch.randn(n, hq, d, generator=g).to(dtype)
                k = torch.randn(n, hkv, d, generator=g).to(dtype)
                v = torch.randn(n, hkv, d, generator=g).to(dtype)
                pages = -(-n // args.page_size)
                runs = {}
                for det, ops in tables.items():
                    cache = ops.allocate(num_pages=pages, page_size=args.page_size, num_kv_heads=hkv, head_dim=d, v_head_dim=d, dtype=dtype, device=torch.device("cpu"))
                    meta = attention_metadata([(0, n)], [list(range(pages))], args.page_size, torch.device("cpu"))
                    meta.plan = ops.build_plan(meta)
                    runs[det] = (ops, cache, meta)
                # the two paths in turn, round after round: load from other processes hits both
                ms = {det: float("inf") for det in runs}
                for _ in range(args.rounds):
                    for det, (ops, cache, meta) in runs.items():
                        ms[det] = min(ms[det], 1e3 * best_time(ops, q, k, v, cache, meta, d**-0.5, 1))
                print(f"{backend:10s} {dtype_name:8s} {n:5d} tokens: default {ms[False]:8.2f} ms, deterministic {ms[True]:8.2f} ms ({ms[True] / ms[False]:.2f}x)")


if __name__ == "__main__":
    main()
