"""The fused GGUF records for Q5_0 against the other paths of a Q5_0 weight
on a CPU with AMX: gemma3-270m's Q5_0 linears (18 layers of q, k, v, gate
and up, K = 640; random blocks), per number of rows, one thread,
``time.thread_time``, the paths alternating in one process, medians:

* the fused records on AMX tiles (``gguf_fused_linear_amx``: deterministic
  mode up to ``FUSED_GGUF_ROWS`` rows, the default mode below 12);
* the dense bf16 copy on AMX tiles (``linear_amx``: deterministic mode for
  every batch before the records took Q5_0);
* the integer kernel (``gguf_linear``: the default mode below 12 rows before);
* the fused records on ``vdpbf16ps`` (``gguf_fused_linear``: CPUs with
  AVX512-BF16 and no AMX).

    .venv/bin/python bench/fused_q5.py [--rows 1,2,4,8,11] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

K = 640
LAYER_N = (1024, 256, 256, 2048, 2048)  # q, k, v, gate, up


def q5_0_blocks(n: int, rng: np.random.Generator) -> torch.Tensor:
    """Random Q5_0 blocks with sane f16 scales (every byte pattern is a valid block)."""
    q = rng.integers(0, 256, size=(n, K // 32, 22), dtype=np.uint8)
    q[..., 0:2] = np.frombuffer(rng.uniform(0.001, 0.01, (n, K // 32)).astype(np.float16).tobytes(), np.uint8).reshape(n, K // 32, 2)
    return torch.from_numpy(q.reshape(n, -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,11")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    from plinth.api import load_accelerator
    from plinth_plugin_cpukernels.gemm import load_linear_kernels
    from plinth_plugin_cpukernels.quant import GGUF_FORMATS, load_quant_kernels

    torch.set_num_threads(1)
    isa = tuple(load_accelerator("cpu").info().isa)
    lin, quant = load_linear_kernels(isa), load_quant_kernels(isa)
    if not lin.linear_amx_available():
        raise SystemExit("this bench needs AMX tiles (amx_tile + amx_bf16, granted by the kernel)")
    code = GGUF_FORMATS["Q5_0"][0]
    rng = np.random.default_rng(0)
    weights = []
    for _ in range(18):
        for n in LAYER_N:
            blocks = q5_0_blocks(n, rng)
            dense = lin.linear_pack(quant.gguf_dequantize(blocks, code, K, 0, n, True))
            weights.append((n, blocks, lin.gguf_fused_pack(blocks, code, n, K), dense))
    paths = {
        "records on AMX": lambda x, n, b, f, d: lin.gguf_fused_linear_amx(x, f, code, n, K, None),
        "dense copy on AMX": lambda x, n, b, f, d: lin.linear_amx(x, d, n, K, None),
        "integer kernel": lambda x, n, b, f, d: quant.gguf_linear(x, b, code, False),
        "records on vdpbf16ps": lambda x, n, b, f, d: lin.gguf_fused_linear(x, f, code, n, K, None),
    }
    print(f"| rows | {' | '.join(paths)} |  (ms per 18 layers, one thread)")
    print("|---:|" + "---:|" * len(paths))
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, K).to(torch.bfloat16)
        times: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(args.rounds):
            for name, run in paths.items():
                start = time.thread_time()
                for n, blocks, records, dense in weights:
                    run(x, n, blocks, records, dense)
                times[name].append((time.thread_time() - start) * 1e3)
        print(f"| {m} | " + " | ".join(f"{statistics.median(t):.2f}" for t in times.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
