"""DeepSeek-V3 on this CPU (a benchmark, not a test): a random-weight model of
DeepSeek-V3's shape scaled down to fit two cores, through ``LLM`` (the
engine, its default backend unless --backend), plus two figures of MLA itself.

1. Engine throughput: prefill (prompts of --input tokens, one output token
   each) and decode (--batch sequences, --output tokens each, ignore_eos),
   tokens per second.
2. MLA decode, absorbed (``mla_decode``: queries moved into the latent space,
   attending over the cached latents) against expanded (``mla_prefill`` on
   the same decode step: per-head K/V rebuilt from the latents of the whole
   context), one layer, at the scaled shape and at DeepSeek-V3's own
   attention shape (128 heads, kv_lora_rank 512): ms per decode step.
3. KV bytes per token: the latent cache (kv_lora_rank + rope dim per token
   and layer) against a per-head cache of the same model (K of nope + rope
   dims and V per head), for the scaled model and for DeepSeek-V3 (61 layers).

The scaled shape keeps DeepSeek-V3's structure and ratios where it can: MLA
with q_lora_rank, yarn rope, 1 dense layer then MoE layers with grouped
(n_group / topk_group) sigmoid routing and a shared expert.

    .venv/bin/python bench/deepseek.py [--batch 8 --input 256 --output 32] [--json out.json]
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

#: DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3) and the scaled model run here
V3 = dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
          qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
          n_group=8, topk_group=4, moe_intermediate_size=2048, intermediate_size=18432, first_k_dense_replace=3)  # fmt: skip
SCALED = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, q_lora_rank=384, kv_lora_rank=128,
              qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32, num_experts_per_tok=4,
              n_group=4, topk_group=2, moe_intermediate_size=256, intermediate_size=2816, first_k_dense_replace=1)  # fmt: skip
VOCAB = 8192


def build(path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    sys.path.insert(0, str(ROOT / "plugins/models/deepseek/tests"))
    from tiny_deepseek import write_tokenizer

    cfg = DeepseekV3Config(
        vocab_size=VOCAB, **SCALED, num_key_value_heads=SCALED["num_attention_heads"], n_shared_experts=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)


def engine_throughput(path: str, args: argparse.Namespace) -> dict:
    from plinth import LLM, SamplingParams

    rng = random.Random(0)
    kw = dict(dtype=args.dtype, load_progress=False, max_model_len=2048)
    if args.backend:
        kw["backend"] = args.backend
    with LLM(path, **kw) as llm:
        prompts = [[rng.randrange(300, VOCAB) for _ in range(args.input)] for _ in range(args.batch)]
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        llm.generate(prompts[:1], one)  # warm-up
        t0 = time.perf_counter()
        llm.generate(prompts, one)
        prefill_s = time.perf_counter() - t0
        short = [p[:16] for p in prompts]
        t0 = time.perf_counter()
        llm.generate(short, one)
        short_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = llm.generate(short, SamplingParams(max_tokens=args.output + 1, temperature=0, ignore_eos=True))
        decode_s = time.perf_counter() - t0 - short_s  # less the 16-token prefill and first token
        assert all(len(o.outputs[0].token_ids) == args.output + 1 for o in outs)
        backend = llm.engine.describe().get("backend")
    return {
        "backend": backend,
        "prefill_tok_s": args.batch * args.input / prefill_s,
        "decode_tok_s": args.batch * args.output / decode_s,
        "decode_ms_per_step": 1000 * decode_s / args.output,
    }


def mla_decode_times(shape: dict, batch: int, context: int, dtype, repeats: int) -> dict:
    """ms per decode step of one layer's attention, absorbed and expanded."""
    import torch
    from plinth.api import AttentionMetadata, SelectionContext
    from plinth_plugin_deepseek.mla import MLALatentSpec, latent_pages, mla_decode, mla_prefill
    from plinth_plugin_torch.attention import TorchAttention

    heads, dn, dr, dv, rank = (shape[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
    page = 16
    pages_each = -(-context // page)
    attention = TorchAttention(SelectionContext())
    spec = MLALatentSpec(rank, dr)
    cache = attention.allocate(num_pages=batch * pages_each, page_size=page, dtype=dtype, device=torch.device("cpu"), **spec.allocation())
    g = torch.Generator().manual_seed(0)
    cache[0].copy_(torch.randn(cache[0].shape, generator=g).to(dtype))
    tables = torch.arange(batch * pages_each, dtype=torch.int32).view(batch, pages_each)
    slots = torch.tensor([int(tables[i, (context - 1) // page]) * page + (context - 1) % page for i in range(batch)])
    meta = AttentionMetadata(
        positions=torch.full((batch,), context - 1), slot_mapping=slots, query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32), block_tables=tables, page_size=page, max_query_len=1,
        max_seq_len=context, query_lens_cpu=[1] * batch, seq_lens_cpu=[context] * batch,
    )  # fmt: skip

    def r(*s):
        return torch.randn(*s, generator=g).to(dtype)

    args = (r(batch, heads, dn), r(batch, heads, dr), r(batch, rank), r(batch, dr))
    w_uk, w_uv = r(heads, dn, rank) * 0.05, r(heads, dv, rank) * 0.05
    out = {}
    pages = latent_pages(attention.layout, cache)
    with torch.no_grad():
        for name, op in (("absorbed", mla_decode), ("expanded", mla_prefill)):
            op(*args, pages, meta, w_uk=w_uk, w_uv=w_uv, scale=0.1)  # warm-up
            t0 = time.perf_counter()
            for _ in range(repeats):
                op(*args, pages, meta, w_uk=w_uk, w_uv=w_uv, scale=0.1)
            out[name] = 1000 * (time.perf_counter() - t0) / repeats
    return out


def kv_bytes_per_token(shape: dict, itemsize: int = 2) -> dict:
    import torch
    from plinth.api import FullAttentionSpec
    from plinth_plugin_deepseek.mla import MLALatentSpec

    layers, dtype = shape["num_hidden_layers"], {2: torch.bfloat16, 4: torch.float32}[itemsize]
    latent = MLALatentSpec(shape["kv_lora_rank"], shape["qk_rope_head_dim"]).page_bytes(1, dtype) * layers
    per_head = FullAttentionSpec(shape["num_attention_heads"], shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"],
                                 v_head_dim=shape["v_head_dim"]).page_bytes(1, dtype) * layers  # fmt: skip
    return {"latent": latent, "per_head": per_head, "ratio": per_head / latent}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--input", type=int, default=256)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default=None, help="default: the engine's choice")
    p.add_argument("--contexts", default="512,2048", help="context lengths for the MLA decode figures")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import torch

    result: dict = {"scaled_shape": SCALED, "vocab": VOCAB, "cpu": _cpu(), "threads": torch.get_num_threads()}
    if not args.skip_engine:
        path = os.path.join(tempfile.mkdtemp(prefix="plinth-deepseek-"), "deepseek-v3-scaled")
        build(path)
        result["engine"] = engine_throughput(path, args)
        e = result["engine"]
        print(f"engine ({e['backend']}, {args.dtype}): prefill {e['prefill_tok_s']:.0f} tok/s ({args.batch} x {args.input}), "
              f"decode {e['decode_tok_s']:.1f} tok/s ({args.batch} seqs, {e['decode_ms_per_step']:.0f} ms/step)")
    dtype = getattr(torch, args.dtype)
    result["mla_decode_ms"] = []
    for name, shape, batch in (("scaled", SCALED, args.batch), ("deepseek-v3 attention", V3, args.batch)):
        for context in (int(c) for c in args.contexts.split(",")):
            t = mla_decode_times(shape, batch, context, dtype, args.repeats)
            result["mla_decode_ms"].append({"shape": name, "batch": batch, "context": context, **t})
            print(f"MLA decode, one layer, {name}, batch {batch}, context {context}: absorbed {t['absorbed']:.2f} ms, "
                  f"expanded {t['expanded']:.2f} ms ({t['expanded'] / t['absorbed']:.1f}x)")
    result["kv_bytes_per_token"] = {}
    for name, shape in (("scaled", SCALED), ("deepseek-v3", V3)):
        kv = kv_bytes_per_token(shape)
        result["kv_bytes_per_token"][name] = kv
        print(f"KV bytes per token (bf16, all {shape['num_hidden_layers']} layers), {name}: latent {kv['latent']:,}, "
              f"per-head {kv['per_head']:,} ({kv['ratio']:.1f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
