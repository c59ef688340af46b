"""Deterministic mode's linears against the default ones (issue 24): the 121
linears of a SmolLM2-135M step (30 layers of qkv, o, gate_up, down, then
lm_head; random weights) through the op table start-up builds, with
``SelectionContext(deterministic=False)`` and ``True``, per number of rows.

Weights: ``dense`` bfloat16/float32 (cpukernels: oneDNN above 16 rows by
default, the streaming kernel for every batch when deterministic), ``gguf``
(Q4_1 layers and a Q8_0 head, as the bundled GGUF; by default the integer
kernel below 12 rows and a dequantized bf16 copy above; deterministic: the
fused kernel on the blocks up to ``FUSED_GGUF_ROWS`` rows and the dense
copy's streaming kernel above, bit-identical; column "no fused": the dense
copy for every batch, ``PLINTH_CPU_FUSED_GGUF_ROWS=0``, as before the fused
kernel), and the torch reference (``--backend torch``: F.linear against one
GEMM a row). Steps alternate between the modes; medians of ``--steps``, one
thread, ``time.thread_time``.

    .venv/bin/python bench/batch_invariant.py [--weights dense,gguf] [--rows 1,16,64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD = (49152, 576)


def gguf_weight(n: int, k: int, type_name: str, rng: np.random.Generator):
    """Random blocks with sane f16 scales (every byte pattern is a valid block)."""
    from plinth.api import QuantizedWeight

    nbytes = {"Q4_1": 20, "Q8_0": 34}[type_name]
    q = rng.integers(0, 256, size=(n, k // 32, nbytes), dtype=np.uint8)
    q[..., 0:2] = np.frombuffer(rng.uniform(0.001, 0.01, (n, k // 32)).astype(np.float16).tobytes(), np.uint8).reshape(n, k // 32, 2)
    if type_name == "Q4_1":
        q[..., 2:4] = np.frombuffer((-rng.uniform(0.01, 0.08, (n, k // 32))).astype(np.float16).tobytes(), np.uint8).reshape(n, k // 32, 2)
    blocks = torch.from_numpy(np.ascontiguousarray(q.reshape(n, -1)))
    return QuantizedWeight(format=f"gguf_{type_name.lower()}", qweight=blocks, scale=torch.empty(0), shape=(n, k), block_size=(1, 32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="dense,gguf")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="cpukernels")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from plinth.api import SelectionContext, load_accelerator
    from plinth.testing import op_table

    cpu = load_accelerator("cpu")
    dtype = getattr(torch, args.dtype)
    from plinth_plugin_cpukernels.gemm import FUSED_GGUF_ROWS_ENV

    # modes: the default, deterministic, deterministic without the fused GGUF kernel
    modes = ("default", "deterministic", "no fused")
    tables = {}
    chosen = os.environ.get(FUSED_GGUF_ROWS_ENV, "")
    for mode in modes:
        os.environ[FUSED_GGUF_ROWS_ENV] = "0" if mode == "no fused" else chosen
        tables[mode] = op_table(SelectionContext(accelerator=cpu, dtype=dtype, deterministic=mode != "default"), args.backend)
    os.environ[FUSED_GGUF_ROWS_ENV] = chosen
    shapes = LAYER * 30 + [HEAD]
    print(f"# backend {args.backend}, {args.dtype}, threads {args.threads}, thread_time, median of {args.steps} steps")
    print("| weights | M | default ms/step | deterministic ms/step | deterministic/default | no fused ms/step | no fused/default |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in args.weights.split(","):
        rng = np.random.default_rng(0)
        if kind == "gguf":
            raw = [gguf_weight(n, k, "Q8_0" if (n, k) == HEAD else "Q4_1", rng) for n, k in shapes]
        else:
            raw = [torch.randn(n, k).to(dtype) / k**0.5 for n, k in shapes]
        packed = {mode: [t.pack_linear(w) for w in raw] for mode, t in tables.items()}
        del raw
        for m in [int(r) for r in args.rows.split(",")]:
            xs = {k: torch.randn(m, k).to(dtype) for _, k in shapes}

            def step(mode: str, xs=xs, packed=packed) -> float:
                linear = tables[mode].linear
                t = time.thread_time()
                for (_, k), w in zip(shapes, packed[mode]):
                    linear(xs[k], w)
                return time.thread_time() - t

            for mode in modes:
                step(mode)
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            for _ in range(args.steps):
                for mode in modes:
                    times[mode].append(step(mode))
            d, t, nf = (statistics.median(times[mode]) for mode in modes)
            print(f"| {kind} | {m} | {d * 1e3:.1f} | {t * 1e3:.1f} | {t / d:.2f} | {nf * 1e3:.1f} | {nf / d:.2f} |", flush=True)


if __name__ == "__main__":
    main()
