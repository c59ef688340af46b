"""Small-M dense linear: cpukernels' streaming kernel (csrc/linear_ops.cpp)
against oneDNN's packed linear, per number of rows M, on SmolLM2-135M's
shapes, in one run.

One thread (``torch.set_num_threads(1)``), timed with ``time.thread_time``
(CPU time of this thread: nearly blind to other processes on a shared
machine), best of ``--repeat`` rounds of calls. Weights are read either from
cache (one copy, "hot") or cycled through copies totalling more than the L3
("cold", as a decode step reads them). Prints GB/s of weights read and
GFLOP/s, and the ratio oneDNN time / ours (>1: ours faster).

    .venv/bin/python bench/small_gemm.py [--dtype bfloat16,float32] [--rows 1,2,4,8,16]
    PLINTH_CPU_ISA=avx2,fma ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python bench/small_gemm.py --dtype float32
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {  # name: (N, K)
    "qkv 576->960": (960, 576),
    "o 576->576": (576, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "lm_head 576->49152": (49152, 576),
}


def timeit(fn, calls: int, repeat: int) -> float:
    fn(0)
    best = float("inf")
    for _ in range(repeat):
        t = time.thread_time()
        for i in range(calls):
            fn(i)
        best = min(best, (time.thread_time() - t) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16,float32")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names (prefix match)")
    ap.add_argument("--cold-bytes", type=int, default=96 << 20, help="bytes of weight copies cycled for 'cold'")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wall", action="store_true", help="wall clock (perf_counter) instead of thread CPU time")
    ap.add_argument("--step", type=int, default=0, metavar="STEPS",
                    help="instead: a decode step's linears (SmolLM2-135M: 30 layers of qkv, o, gate_up, down, then lm_head, "
                         "random weights), ours and oneDNN alternating step by step, STEPS each per row count; medians")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.wall:
        time.thread_time = time.perf_counter  # type: ignore[assignment]

    from plinth.api import load_accelerator
    from plinth_plugin_cpukernels.gemm import load_linear_kernels

    isa = load_accelerator("cpu").info().isa
    k = load_linear_kernels(isa)
    print(f"# kernel path: {k.linear_kernel_path()}; threads {args.threads}; clock {'wall' if args.wall else 'thread_time'}")
    if args.step:
        return steps(k, args)
    print("| dtype | shape | M | weights | ours us | oneDNN us | ours GB/s | oneDNN GB/s | ours GFLOP/s | oneDNN GFLOP/s | oneDNN/ours |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    mk = torch.ops.mkldnn
    names = [n for n in SHAPES if any(n.startswith(s) for s in args.shapes.split(","))]
    for dname in args.dtype.split(","):
        dtype = getattr(torch, dname)
        for name in names:
            n, kdim = SHAPES[name]
            nbytes = n * kdim * dtype.itemsize
            copies = max(1, -(-args.cold_bytes // nbytes))
            ws = [torch.randn(n, kdim).to(dtype) for _ in range(copies)]
            ours = [k.linear_pack(w) for w in ws]
            dnn = [mk._reorder_linear_weight(w) for w in ws]
            for m in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(m, kdim).to(dtype)
                ref = torch.nn.functional.linear(x.float(), ws[0].float())
                got = k.linear_small(x, ours[0], n, kdim, None).float()
                assert (got - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3, (name, m)
                for label, cyc in (("hot", 1), ("cold", copies)):
                    if label == "cold" and copies == 1:
                        continue
                    calls = max(cyc, min(200, int(2e8 // (nbytes + 1))))
                    t_ours = timeit(lambda i, x=x, cyc=cyc, ours=ours, n=n, kdim=kdim: k.linear_small(x, ours[i % cyc], n, kdim, None), calls, args.repeat)
                    t_dnn = timeit(lambda i, x=x, cyc=cyc, dnn=dnn: mk._linear_pointwise(x, dnn[i % cyc], None, "none", [], ""), calls, args.repeat)
                    flop = 2 * m * n * kdim
                    print(
                        f"| {dname} | {name} | {m} | {label} | {t_ours * 1e6:.0f} | {t_dnn * 1e6:.0f} | "
                        f"{nbytes / t_ours / 1e9:.1f} | {nbytes / t_dnn / 1e9:.1f} | {flop / t_ours / 1e9:.0f} | {flop / t_dnn / 1e9:.0f} | {t_dnn / t_ours:.2f} |",
                        flush=True,
                    )


def steps(k, args) -> None:
    import statistics

    mk = torch.ops.mkldnn
    layer = [SHAPES[n] for n in ("qkv 576->960", "o 576->576", "gate_up 576->3072", "down 1536->576")]
    # the AMX kernel (bf16, K a multiple of 32) where the build and the CPU have it
    amx = bool(k.linear_amx_available())
    print("| dtype | M | ours ms/step | oneDNN ms/step | oneDNN/ours | ours GB/s | ours GFLOP/s | AMX ms/step | oneDNN/AMX |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dname in args.dtype.split(","):
        dtype = getattr(torch, dname)
        shapes = layer * 30 + [SHAPES["lm_head 576->49152"]]
        ws = [torch.randn(n, kdim).to(dtype) for n, kdim in shapes]
        ours = [k.linear_pack(w) for w in ws]
        dnn = [mk._reorder_linear_weight(w) for w in ws]
        del ws
        nbytes = sum(n * kdim for n, kdim in shapes) * dtype.itemsize
        for m in [int(r) for r in args.rows.split(",")]:
            xs = {kdim: torch.randn(m, kdim).to(dtype) for _, kdim in shapes}

            def run_ours(xs=xs, shapes=shapes, ours=ours):  # this iteration's inputs
                for (n, kdim), w in zip(shapes, ours):
                    k.linear_small(xs[kdim], w, n, kdim, None)

            def run_dnn(xs=xs, shapes=shapes, dnn=dnn):
                for (_n, kdim), w in zip(shapes, dnn):
                    mk._linear_pointwise(xs[kdim], w, None, "none", [], "")

            def run_amx(xs=xs, shapes=shapes, ours=ours):
                for (n, kdim), w in zip(shapes, ours):
                    k.linear_amx(xs[kdim], w, n, kdim, None)

            with_amx = amx and dtype == torch.bfloat16
            t_ours, t_dnn, t_amx = [], [], []
            runs = [(run_ours, t_ours), (run_dnn, t_dnn)] + ([(run_amx, t_amx)] if with_amx else [])
            for fn, _ in runs:
                fn()
            for _ in range(args.step):
                for fn, acc in runs:
                    t = time.thread_time()
                    fn()
                    acc.append(time.thread_time() - t)
            a, b = statistics.median(t_ours), statistics.median(t_dnn)
            flop = 2 * m * nbytes / dtype.itemsize
            c = statistics.median(t_amx) if t_amx else None
            amx_cells = f"{c * 1e3:.2f} | {b / c:.2f}" if c else "- | -"
            print(f"| {dname} | {m} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f} | {nbytes / a / 1e9:.1f} | {flop / a / 1e9:.0f} | {amx_cells} |", flush=True)


if __name__ == "__main__":
    main()
