#!/usr/bin/env python
"""gemma-3-270m Q4_K_M on this CPU (issue 21's benchmark; not a test).

    .venv/bin/python bench/gemma.py kv --context 8192      # KV memory: sliding layers' window vs a full cache
    .venv/bin/python bench/gemma.py serve --llamacpp --peers vllm   # the rest goes to serve_compare.py

``kv``: what the KV cache holds for one sequence at --context tokens, from
the model's own layer windows (the gemma loader reads the GGUF): a full
cache keeps every token in every layer; with sliding-window pages freed,
the 15 sliding layers keep at most their 512-token window (in whole pages,
plus the page being filled) and only the 3 global layers grow. With
--measure, the engine runs one sequence to that length (a random prompt,
then 16 greedy tokens) and the most pages each KV group held are counted.

``serve``: ``bench/serve_compare.py --gguf gemma3-270m ...``: batch-1 decode
ms/token of plinth and llama.cpp on the same file (--llamacpp) and serving
throughput at concurrency 1 and 16 against vLLM's CPU build on the same
weights dequantized into a Hugging Face folder (--peers vllm), as the
SmolLM2 comparison does; figures go to --out-dir (docs/benchmarks.md is
written by hand from them). A quiet machine is needed for figures that mean
anything.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def kv_bytes(windows: list[int | None], kv_heads: int, head_dim: int, dtype_bytes: int, context: int, page_size: int) -> dict:
    """Bytes one sequence of ``context`` tokens holds: every layer full, and
    with pages behind each sliding window freed."""
    per_token_layer = 2 * kv_heads * head_dim * dtype_bytes  # K and V
    pages_full = -(-context // page_size)
    full = len(windows) * pages_full * page_size * per_token_layer
    held = 0
    for window in windows:
        # a window of w tokens ending anywhere touches at most ceil(w / page) + 1 pages
        pages = pages_full if window is None else min(pages_full, -(-window // page_size) + 1)
        held += pages * page_size * per_token_layer
    return {"full_bytes": full, "windowed_bytes": held, "ratio": full / held}


def cmd_kv(args: argparse.Namespace) -> int:
    import torch
    from plinth.api import ModelSource
    from plinth.engine.model_source import locate_model
    from plinth_plugin_gemma.arch import arch_from_hf
    from plinth_plugin_gemma.loader import GemmaLoader

    source: ModelSource = locate_model(args.model)
    cfg = GemmaLoader().hf_config(source)
    arch = arch_from_hf(cfg)
    dtype_bytes = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    out = {
        "model": source.path,
        "context": args.context,
        "page_size": args.page_size,
        "dtype": args.dtype,
        "layers": {"sliding": sum(w is not None for w in arch.sliding_windows), "global": sum(w is None for w in arch.sliding_windows)},
        "window": max((w for w in arch.sliding_windows if w), default=None),
        **kv_bytes(arch.sliding_windows, arch.num_kv_heads, arch.head_dim, dtype_bytes, args.context, args.page_size),
    }
    if args.measure:
        out["measured"] = measure(args, source.path)
    print(json.dumps(out, indent=2))
    mib = 1 << 20
    print(
        f"{Path(source.path).name}, {args.context} tokens, {args.dtype}, pages of {args.page_size}: "
        f"full cache {out['full_bytes'] / mib:.1f} MiB, sliding pages freed {out['windowed_bytes'] / mib:.1f} MiB "
        f"({out['ratio']:.1f}x less)"
        + (f"; measured: {out['measured']['bytes'] / mib:.1f} MiB" if args.measure else "")
    )
    return 0


def measure(args: argparse.Namespace, path: str) -> dict:
    """The most pages each KV group held while one sequence ran to --context tokens."""
    import random

    import torch
    from plinth import LLM, SamplingParams

    decode = 16
    # a pool of half a GiB (not most of the machine's memory) and a fixed step: no timing probes
    llm = LLM(path, dtype=args.dtype, page_size=args.page_size, load_progress=False, max_num_seqs=1,
              kv_cache_memory=0.5, max_num_batched_tokens=512)
    engine, kv = llm.engine, llm.engine.kv
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 200000) for _ in range(args.context - decode)]
    engine.add_request("0", prompt, SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True))
    peak = [0] * len(kv.groups)
    while engine.has_unfinished():
        engine.step()
        peak = [max(p, n) for p, n in zip(peak, kv.group_pages_held())]
    dtype = getattr(torch, args.dtype)
    groups = [
        {"spec": repr(g.spec), "layers": len(g.layers), "peak_pages": p, "bytes": p * g.spec.page_bytes(args.page_size, dtype) * len(g.layers)}
        for g, p in zip(kv.groups, peak)
    ]
    return {"groups": groups, "bytes": sum(g["bytes"] for g in groups)}


def cmd_serve(rest: list[str]) -> int:
    cmd = [sys.executable, str(REPO / "bench" / "serve_compare.py"), "--gguf", "gemma3-270m", *rest]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        return cmd_serve(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    kv = sub.add_parser("kv", help="KV memory at a context length: sliding pages freed vs a full cache")
    kv.add_argument("--model", default="gemma3-270m", help="a Gemma 3 GGUF, folder or model name (default gemma3-270m)")
    kv.add_argument("--context", type=int, default=8192)
    kv.add_argument("--page-size", type=int, default=16)
    kv.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    kv.add_argument("--measure", action="store_true", help="also run one sequence through the engine and count its pages")
    sub.add_parser("serve", help="bench/serve_compare.py --gguf gemma3-270m [its arguments]")
    args = p.parse_args()
    return cmd_kv(args)


if __name__ == "__main__":
    sys.exit(main())
