"""MoE end-to-end throughput on this machine at tp/ep = 1 and 2: a random-weight
Qwen3-MoE (built with transformers, saved as safetensors) through ``LLM`` one
process, tp=2, ep=2 (dp=2, a2a nccl over gloo) and tp=2 ep=2 (dp=1), on the
same workload (random prompts, exact output lengths, greedy). Ranks are real
processes on 127.0.0.1. One table; --json saves it.

    .venv/bin/python bench/moe_cpu.py [--prompts 16 --input 64 --output 64]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = {"tp1": {}, "tp2": {"tp": 2}, "ep2 (dp2)": {"ep": 2, "a2a": "nccl"}, "tp2 ep2": {"tp": 2, "ep": 2, "a2a": "nccl"}}


def build(path: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import VOCAB, write_tokenizer

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=1024, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--input", type=int, default=64)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--backend", default="torch")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from plinth import LLM, SamplingParams

    work = tempfile.mkdtemp(prefix="plinth-moe-")
    path = os.path.join(work, "qwen3moe")
    build(path)
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(args.input)] for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    rows = []
    for name in args.configs.split(","):
        kw = CONFIGS[name]
        t0 = time.perf_counter()
        llm = LLM(path, device="cpu", backend=args.backend, dtype=args.dtype, load_progress=False, **kw)
        start_s = time.perf_counter() - t0
        try:
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t
        finally:
            llm.close()
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"config": name, **kw, "seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt,
                     "total_tok_s": (n_out + args.input * args.prompts) / dt, "startup_s": start_s,
                     "first_tokens": outs[0].outputs[0].token_ids[:8]})  # fmt: skip
        print(f"{name:<10} {n_out / dt:8.1f} output tok/s  {rows[-1]['total_tok_s']:8.1f} total tok/s  "
              f"({dt:.1f} s; start-up {start_s:.1f} s)", flush=True)  # fmt: skip
    same = len({tuple(r["first_tokens"]) for r in rows}) == 1
    print(f"greedy tokens of the first prompt equal across configs: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load_average": os.getloadavg(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
