"""Micro benchmark of cpukernels' paged decode attention on SmolLM2-135M's
shapes (9 query heads, 3 KV heads, D=64), one thread, CPU time
(``time.thread_time``, so it holds up on a loaded machine).

    .venv/bin/python bench/decode_attention.py [--source A.cpp --source B.cpp] [--isa avx2,fma]

Each ``--source`` builds its own copy of a csrc/cpu_ops.cpp (e.g. the one
before a change, from ``git show REV:path > A.cpp``; default: the current
one); the copies are timed in turn, round after round, and each keeps its
best round (other processes only ever add time), so a comparison made on a
busy machine is fair. ``--amx off,on`` times each copy with bf16 pages on
the vector path and on AMX tiles (``set_amx_attention``; default: as the
backend sets it). ``--rows N``: each sequence queries its last N positions
(a prefill chunk's tile path; 1: decode). ``--isa`` narrows the instruction
sets as PLINTH_CPU_ISA does. ``--pool-pages N --large-pages``: the tables
draw their pages at random from pools of N pages a layer (a server's pool is
GBs), allocated on 2 MB pages as the backend does (run once without and once
with it). Prints us per call (per layer) and GFLOP/s (4 * Hq * D
flops per context token: the scores and the weighted sum), and each copy's
speed-up over the first."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, action="append", default=None)
    p.add_argument("--isa", default=None, help="comma-separated, default: this CPU's")
    p.add_argument("--contexts", default="128,512,1024")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--heads", default="9,3,64", help="Hq,Hkv,D")
    p.add_argument("--layers", type=int, default=1, help="KV pages of this many layers, called in turn (30: a model's, out of cache)")
    p.add_argument("--pages", choices=("random", "sequential"), default="random", help="page order of each sequence's table")
    p.add_argument("--amx", default=None, help="comma-separated off,on: each copy timed with each (default: the backend's choice)")
    p.add_argument("--rows", type=int, default=1, help="query rows per sequence, at the end of its context")
    p.add_argument("--pool-pages", type=int, default=0,
                   help="pages in each layer's pool, the tables' pages drawn from them at random (default: what the batch needs)")
    p.add_argument("--large-pages", action="store_true",
                   help="the pools on 2 MB pages, as cpukernels' attention backend allocates them (default: torch's allocator)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--round-time", type=float, default=0.05, help="CPU seconds per round and copy")
    args = p.parse_args()

    from plinth.api import load_accelerator
    from plinth_plugin_cpukernels import kernels as kmod

    isa = args.isa.split(",") if args.isa else list(getattr(load_accelerator("cpu").info(), "isa", ()) or ())
    sources = args.source or [kmod.SOURCE]
    built = [kmod.load_extension(s, kmod.FUNCTIONS, isa, prefix=f"plinth_cpukernels_bench{i}") for i, s in enumerate(sources)]
    if args.amx:
        settings = [x == "on" for x in args.amx.split(",")]
    else:
        from plinth_plugin_cpukernels.backend import amx_attention

        settings = [amx_attention(tuple(isa))]
    names = [f"{s}" + (f" (amx {'on' if a else 'off'})" if args.amx else "") for s in sources for a in settings]
    mods = [(k, a) for k in built for a in settings]
    torch.set_num_threads(1)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    ps = args.page_size
    print(f"isa {','.join(sorted(isa))}; one thread; Hq={hq} Hkv={hkv} D={d}; page size {ps} ({args.pages} order); {args.layers} layer(s); "
          f"pools of {args.pool_pages or 'the batch'} pages on {'2 MB' if args.large_pages else 'the allocator'} pages")
    for i, name in enumerate(names):
        print(f"copy {i}: {name}")
    head = " | ".join(f"copy {i} us | GFLOP/s" + (" | x" if i else "") for i in range(len(mods)))
    print(f"| dtype | batch | context | {head} |")
    print("|---|---:|---:|" + "---:|" * (3 * len(mods) - 1))
    for dtype in [getattr(torch, x) for x in args.dtypes.split(",")]:
        for b in (int(x) for x in args.batches.split(",")):
            for ctx in (int(x) for x in args.contexts.split(",")):
                g = torch.Generator().manual_seed(0)
                pages_per = -(-ctx // ps)
                n = max(b * pages_per + 1, args.pool_pages)

                def pool(dtype=dtype, n=n, g=g):
                    t = built[0].zeros_on_large_pages([hkv, n, ps, d], dtype) if args.large_pages else torch.empty(hkv, n, ps, d, dtype=dtype)
                    return t.copy_(torch.randn(hkv, n, ps, d, generator=g))

                kvs = [(pool(), pool()) for _ in range(args.layers)]
                order = torch.randperm(n - 1, generator=g) if args.pages == "random" else torch.arange(n - 1)
                tables = order[: b * pages_per].view(b, pages_per).to(torch.int32)
                lens = torch.full((b,), ctx, dtype=torch.int32)
                q = torch.randn(b * args.rows, hq, d, generator=g).to(dtype)
                qsl = torch.arange(b + 1, dtype=torch.int64) * args.rows

                def call(mod, kvs=kvs, q=q, tables=tables, lens=lens, qsl=qsl):  # this iteration's inputs
                    k, amx = mod
                    k.set_amx_attention(amx)
                    for kp, vp in kvs:
                        k.paged_attention(q, kp, vp, tables, qsl, lens, d**-0.5, 0)

                best = [float("inf")] * len(mods)
                for k in mods:
                    call(k)
                for _ in range(args.rounds):
                    for i, k in enumerate(mods):
                        reps, t0 = 0, time.thread_time()
                        while time.thread_time() - t0 < args.round_time:
                            call(k)
                            reps += 1
                        best[i] = min(best[i], (time.thread_time() - t0) / reps / args.layers * 1e6)
                flops = 4 * hq * d * b * sum(ctx - r for r in range(args.rows))
                cells = " | ".join(
                    f"{us:.1f} | {flops / us / 1e3:.1f}" + (f" | {best[0] / us:.2f}" if i else "") for i, us in enumerate(best)
                )
                print(f"| {str(dtype).split('.')[-1]} | {b} | {ctx} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
