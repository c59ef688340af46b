"""GGUF weights in their quantized blocks against the same file dequantized:
accuracy and batch-1 decode speed (issue 12), on SmolLM2-135M-Instruct Q4_1.

    .venv/bin/python bench/gguf_quant.py [--prompts 50] [--tokens 32] [--skip speed]
    .venv/bin/python bench/gguf_quant.py --crossover [--plot FILE.png]   # integer kernel vs dequantize + GEMM by rows

Accuracy, in one process, the cpukernels backend, against the dequantized
model in float32 (the GGUF weights exactly):
* logits: every position of each prompt prefilled alone (short prompts: the
  integer kernel), max and mean |difference|, for the quantized model in
  float32 and, as a yardstick, the dequantized model in bfloat16;
* greedy agreement: the first ``--tokens`` generated tokens of ``--prompts``
  prompts, each alone (batch 1: the integer kernel; EOS ignored): fraction
  identical, mean matching prefix;
* perplexity of bench/data/declaration_of_independence.txt, one token a step
  (the integer kernel), and in 256-token chunks (prefill: the GEMM path).

Speed, each configuration in a process of its own (the AVX2 ones narrowed with
PLINTH_CPU_ISA=avx2,fma, ATen and oneDNN capped too): batch-1 decode
ms/token, (time of 1 + D tokens - time of 1 token) / D, median of repeats.
The machine may be shared: the load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEXT = pathlib.Path(__file__).resolve().parent / "data" / "declaration_of_independence.txt"
sys.path.insert(0, str(ROOT / "plugins" / "models" / "llama" / "tests"))  # PagedDriver

AVX2_ENV = {"PLINTH_CPU_ISA": "avx2,fma", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SPEED_CONFIGS = [
    ("quantized, bf16 activations", {"dtype": "bfloat16", "dequantize": False}, {}),
    ("dequantized bf16", {"dtype": "bfloat16", "dequantize": True}, {}),
    ("quantized, fp32 activations, AVX2 build", {"dtype": "float32", "dequantize": False}, AVX2_ENV),
    ("dequantized fp32, AVX2 build", {"dtype": "float32", "dequantize": True}, AVX2_ENV),
]
TOPICS = [
    "the history of Rome", "how a bicycle works", "why the sky is blue", "the water cycle", "a recipe for pancakes",
    "the rules of chess", "how to learn a language", "the solar system", "photosynthesis", "the French Revolution",
    "a day at the beach", "how computers store numbers", "the life of a honeybee", "volcanoes", "the printing press",
    "how vaccines work", "the game of football", "a trip to the mountains", "the moon landing", "how to write a poem",
    "the stock market", "rainforests", "the invention of the telephone", "a haunted house", "the Olympic games",
]
FORMS = ["Write a short paragraph about {}.", "Explain {} to a child."]


def prompts(n: int) -> list[str]:
    out = [form.format(topic) for topic in TOPICS for form in FORMS]
    return (out * (n // len(out) + 1))[:n]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def engine(dtype: str, dequantize: bool):
    from plinth.engine.llm import LLM

    return LLM(backend="cpukernels", dtype=dtype, dequantize=dequantize, load_progress=False, num_pages=512)


# ---- accuracy ------------------------------------------------------------------------------


def prompt_logits(llm, ids: list[int]):
    """Logits at every position of one prompt prefilled alone, float32 [n, vocab]."""
    from driver import PagedDriver

    c = llm.engine.components
    driver = PagedDriver(llm.engine.executor.runner.model, c.model_config, page_size=16, max_tokens=len(ids) + 16, dtype=c.dtype)
    return driver.prefill_logits([ids])[0].float()


def perplexity(llm, ids: list[int], chunk: int) -> float:
    import torch
    from driver import PagedDriver, Seq

    c = llm.engine.components
    driver = PagedDriver(llm.engine.executor.runner.model, c.model_config, page_size=16, max_tokens=len(ids) + 16, dtype=c.dtype)
    seq = Seq(list(ids), len(ids))
    nll, count = 0.0, 0
    while seq.computed < len(ids) - 1:
        n = min(chunk, len(ids) - 1 - seq.computed)
        start = seq.computed
        logits = driver.step([seq], [n], all_logits=True)[0].float()
        targets = torch.tensor(ids[start + 1 : start + 1 + n])
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += n
    return math.exp(nll / count)


def accuracy(args) -> dict:
    import torch
    from plinth.engine.sampling_params import SamplingParams

    texts = prompts(args.prompts)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    text_ids = None
    runs = {}
    for name, dtype, dequantize in (("dequantized fp32", "float32", True), ("quantized fp32", "float32", False), ("dequantized bf16", "bfloat16", True)):
        print(f"accuracy: {name} ...", file=sys.stderr)
        llm = engine(dtype, dequantize)
        encode = llm.get_tokenizer().encode
        prompt_ids = [encode(p) for p in texts]
        text_ids = text_ids or encode(TEXT.read_text())[: args.ppl_tokens]
        parts = set(args.accuracy_parts.split(","))
        with torch.no_grad():
            logits = [prompt_logits(llm, ids) for ids in prompt_ids] if "logits" in parts else []
        # one prompt at a time: batch-1 decode, the integer kernel (a batch of
        # 12 or more sequences would take the GEMM path)
        greedy = [llm.generate([p], params)[0].outputs[0].token_ids for p in texts] if "greedy" in parts else []
        t = time.perf_counter()
        ppl_decode = perplexity(llm, text_ids, 1) if "ppl" in parts else float("nan")
        ppl_prefill = perplexity(llm, text_ids, 256) if "ppl" in parts else float("nan")
        runs[name] = dict(logits=logits, greedy=greedy, ppl_decode=ppl_decode, ppl_prefill=ppl_prefill, ppl_s=time.perf_counter() - t)
        del llm
    ref = runs["dequantized fp32"]
    result = {"prompts": len(texts), "tokens": args.tokens, "ppl_text_tokens": len(text_ids), "models": {}}
    for name, run in runs.items():
        diffs = [(a - b).abs() for a, b in zip(run["logits"], ref["logits"])]
        same = [a == b for a, b in zip(run["greedy"], ref["greedy"])]
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(run["greedy"], ref["greedy"])]
        result["models"][name] = {
            "logits_max_abs_diff": max((d.max().item() for d in diffs), default=float("nan")),
            "logits_mean_abs_diff": statistics.fmean(d.mean().item() for d in diffs) if diffs else float("nan"),
            "logits_scale_mean_abs": statistics.fmean(x.abs().mean().item() for x in ref["logits"]) if diffs else float("nan"),
            "greedy_identical": sum(same) / len(same) if same else float("nan"),
            "greedy_mean_matching_prefix": statistics.fmean(prefix) if prefix else float("nan"),
            "top1_agreement_prefill": statistics.fmean(
                (a.argmax(-1) == b.argmax(-1)).float().mean().item() for a, b in zip(run["logits"], ref["logits"])
            ) if diffs else float("nan"),
            "perplexity_one_token_steps": run["ppl_decode"],
            "perplexity_256_token_chunks": run["ppl_prefill"],
        }
    return result


# ---- crossover -------------------------------------------------------------------------------


def crossover(rows: list[int]) -> dict:
    """Integer kernel vs dequantize-a-tile + GEMM, per activation row count M,
    on SmolLM2's linear shapes (random Q4_1 blocks; the head Q8_0), in CPU ms
    on one thread (thread_time: little disturbed by other processes)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants
    from plinth.api import load_accelerator
    from plinth_plugin_cpukernels.backend import bf16_gemm_missing
    from plinth_plugin_cpukernels.quant import GGUFLinear, load_quant_kernels, make_gguf_linear

    torch.set_num_threads(1)
    isa = load_accelerator("cpu").info().isa
    kernels = load_quant_kernels(isa)
    bf16 = bf16_gemm_missing(tuple(isa)) is None
    dtype = torch.bfloat16 if bf16 else torch.float32
    integer = make_gguf_linear(kernels, bf16_gemm=bf16, gemm_min_rows=1 << 30)
    gemm = make_gguf_linear(kernels, bf16_gemm=bf16, gemm_min_rows=0)
    shapes = {"qkv": ("Q4_1", 960, 576), "o_proj": ("Q4_1", 576, 576), "gate_up": ("Q4_1", 3072, 576), "down": ("Q4_1", 576, 1536), "head": ("Q8_0", 49152, 576)}
    out: dict = {"kernel": kernels.gguf_kernel_path(), "dtype": str(dtype), "shapes": {}}

    def cpu_ms(f, x, w) -> float:
        best = float("inf")
        for _ in range(5):
            t = time.thread_time()
            f(x, w)
            best = min(best, time.thread_time() - t)
        return best * 1e3

    for name, (qtype, n, k) in shapes.items():
        q = quants.quantize(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32), getattr(GGMLQuantizationType, qtype))
        w = GGUFLinear(torch.from_numpy(q), qtype, (n, k))
        rows_out = {}
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            rows_out[m] = {"integer_ms": cpu_ms(integer, x, w), "gemm_ms": cpu_ms(gemm, x, w)}
        out["shapes"][name] = rows_out
        print(name, {m: f"{v['integer_ms']:.3f}/{v['gemm_ms']:.3f}" for m, v in rows_out.items()}, file=sys.stderr)
    return out


def plot_crossover(result: dict, path: str) -> None:
    """One panel per weight: CPU ms a call by batch rows, both paths, and where the engine switches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plinth_plugin_cpukernels.quant import GEMM_MIN_ROWS

    shapes = result["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.4))
    for ax, (name, by_rows) in zip(axes, shapes.items(), strict=True):
        rows = sorted(by_rows, key=int)
        for key, label in (("integer_ms", "integer kernel"), ("gemm_ms", "dequantize + GEMM")):
            ax.plot([int(m) for m in rows], [by_rows[m][key] for m in rows], marker="o", label=label)
        ax.axvline(GEMM_MIN_ROWS, color="grey", linestyle=":", label=f"engine switches ({GEMM_MIN_ROWS} rows)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("activation rows")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("CPU ms a call, one thread")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"GGUF linears by batch rows ({result['kernel']}, {result['dtype']} activations)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- speed ---------------------------------------------------------------------------------


def decode_speed(dtype: str, dequantize: bool, decode_tokens: int, repeats: int) -> dict:
    """In this process: batch-1 decode ms/token of one configuration."""
    from plinth.engine.sampling_params import SamplingParams

    llm = engine(dtype, dequantize)
    prompt = "Write a short paragraph about the history of Rome."
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = SamplingParams(max_tokens=1 + decode_tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], many)  # warm up (kernels, caches)
    per_token = []
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate([prompt], one)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate([prompt], many)
        t2 = time.perf_counter() - t
        per_token.append((t2 - t1) / decode_tokens * 1e3)
    model = llm.engine.executor.runner.model
    linear = type(model.layers[0].qkv).__name__
    return {
        "ms_per_token_median": statistics.median(per_token),
        "ms_per_token_min": min(per_token),
        "ms_per_token_all": per_token,
        "weight_bytes_per_token": model.weight_bytes(per_token=True),
        "linear": linear,
        "isa": list(llm.engine.components.describe().get("isa") or []),
    }


def speed(args) -> dict:
    from plinth.bench.offline import measure_copy_bandwidth, measure_read_bandwidth

    out = {"load_before": load_average(), "configs": {}}
    out["copy_bandwidth_GBps"] = measure_copy_bandwidth() / 1e9
    out["read_bandwidth_GBps"] = measure_read_bandwidth() / 1e9
    for name, kwargs, env in SPEED_CONFIGS:
        print(f"speed: {name} ...", file=sys.stderr)
        cmd = [sys.executable, __file__, "--_speed-one", json.dumps({**kwargs, "decode_tokens": args.decode_tokens, "repeats": args.repeats})]
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True)
        out["configs"][name] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "env": env}
    out["load_after"] = load_average()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared per prompt")
    parser.add_argument("--ppl-tokens", type=int, default=2048, help="most tokens of the text for the perplexity")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma-separated: accuracy, speed")
    parser.add_argument("--accuracy-parts", default="logits,greedy,ppl", help="comma-separated: logits, greedy, ppl")
    parser.add_argument("--crossover", action="store_true", help="only: integer kernel vs dequantize + GEMM by batch rows")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="with --crossover: its curves")
    parser.add_argument("--save-result", default=None, metavar="FILE.json")
    parser.add_argument("--_speed-one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._speed_one:
        o = json.loads(args._speed_one)
        print(json.dumps(decode_speed(o["dtype"], o["dequantize"], o["decode_tokens"], o["repeats"])))
        return 0
    if args.crossover:
        result = crossover([1, 2, 4, 8, 12, 16, 24, 32, 48, 64])
        print(json.dumps(result, indent=2))
        if args.save_result:
            pathlib.Path(args.save_result).write_text(json.dumps(result, indent=2))
        if args.plot:
            plot_crossover(result, args.plot)
        return 0
    skip = set(filter(None, args.skip.split(",")))
    result = {"command": " ".join(["bench/gguf_quant.py", *sys.argv[1:]]), "load_start": load_average()}
    def save() -> None:  # after each part: a long run cut short keeps what it measured
        if args.save_result:
            pathlib.Path(args.save_result).write_text(json.dumps(result, indent=2))

    if "speed" not in skip:
        result["speed"] = speed(args)
        save()
    if "accuracy" not in skip:
        result["accuracy"] = accuracy(args)
    result["load_end"] = load_average()
    text = json.dumps(result, indent=2)
    print(text)
    if args.save_result:
        pathlib.Path(args.save_result).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
