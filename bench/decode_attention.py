"""Micro benchmark of cpukernels' paged decode attention on SmolLM2-135M's
shapes (9 query heads, 3 KV heads, D=64), one thread, CPU time
(``time.thread_time``, so it holds on a loaded machine).

    .venv/bin/python bench/decode_attention.py [--source csrc.cpp] [--isa avx2,fma]

``--source`` builds another copy of csrc/cpu_ops.cpp (e.g. the one before a
change, from ``git show``) to compare; ``--isa`` narrows the instruction sets
as PLINTH_CPU_ISA does. Prints us per call (the best of 7 rounds) and GFLOP/s (4 * Hq * D flops per
context token: the scores and the weighted sum)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, default=None)
    p.add_argument("--isa", default=None, help="comma-separated, default: this CPU's")
    p.add_argument("--contexts", default="128,512,1024")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--heads", default="9,3,64")
    p.add_argument("--min-time", type=float, default=0.3, help="CPU seconds per case")
    args = p.parse_args()

    from plinth.api import load_accelerator
    from plinth_plugin_cpukernels import kernels as kmod

    isa = args.isa.split(",") if args.isa else list(getattr(load_accelerator("cpu").info(), "isa", ()) or ())
    source = args.source or kmod.SOURCE
    k = kmod.load_extension(source, kmod.FUNCTIONS, isa, prefix="plinth_cpukernels_bench" if args.source else "plinth_cpukernels")
    torch.set_num_threads(1)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    ps = args.page_size
    print(f"source {source}, isa {','.join(sorted(isa))}, one thread, Hq={hq} Hkv={hkv} D={d} page {ps}")
    print("| dtype | batch | context | us/call | GFLOP/s |\n|---|---:|---:|---:|---:|")
    for dtype in [getattr(torch, x) for x in args.dtypes.split(",")]:
        for b in (int(x) for x in args.batches.split(",")):
            for ctx in (int(x) for x in args.contexts.split(",")):
                g = torch.Generator().manual_seed(0)
                pages_per = -(-ctx // ps)
                n = b * pages_per + 1
                kp = torch.randn(hkv, n, ps, d, generator=g).to(dtype)
                vp = torch.randn(hkv, n, ps, d, generator=g).to(dtype)
                tables = torch.randperm(n - 1, generator=g)[: b * pages_per].view(b, pages_per).to(torch.int32)
                lens = torch.full((b,), ctx, dtype=torch.int32)
                q = torch.randn(b, hq, d, generator=g).to(dtype)
                call = lambda: k.paged_decode_attention(q, kp, vp, tables, lens, d**-0.5, 0)  # noqa: E731
                for _ in range(3):
                    call()
                us = float("inf")  # the best of 7 rounds: other processes only ever add time
                for _ in range(7):
                    reps, t0 = 0, time.thread_time()
                    while time.thread_time() - t0 < args.min_time / 7:
                        for _ in range(5):
                            call()
                        reps += 5
                    us = min(us, (time.thread_time() - t0) / reps * 1e6)
                flops = 4 * hq * d * ctx * b
                print(f"| {str(dtype).split('.')[-1]} | {b} | {ctx} | {us:.1f} | {flops / us / 1e3:.1f} |")


if __name__ == "__main__":
    main()
