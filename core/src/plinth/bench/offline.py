"""`platform bench offline`: the engine against peers on the same weights, in one run.

Measures, on one machine in one process run (these machines are noisy, so
every figure is reported beside a peer or a hardware limit measured in the
same run):

* throughput on a mixed workload (prompts 16-512 tokens, outputs 16-256,
  fixed seed, exact output lengths): plinth vs transformers continuous
  batching (``generate_batch``'s manager, paged, per-request lengths);
* batch-1 decode ms/token vs the weight-bandwidth roofline (weight bytes /
  copy bandwidth measured now), and optionally vs llama.cpp on the same GGUF;
* batch-32 decode: achieved FLOP/s vs the matmul FLOP/s measured now.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from plinth.cli import add_config_arguments
from plinth.plugins import PluginRegistry

#: the engine settings the benchmark takes (flags made as `platform serve` makes them)
ENGINE_SETTINGS = (
    "dtype", "dequantize", "device", "backend", "max_num_seqs", "max_num_batched_tokens", "deterministic",
    "speculative_method", "num_speculative_tokens", "speculative_model",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser, registry: PluginRegistry) -> None:
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: the bundled SmolLM2-135M)")
    # the engine's own settings, as `platform serve` takes them (transformers gets the same dtype)
    add_config_arguments(parser, registry, command="bench", only=ENGINE_SETTINGS)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-input", type=int, default=16)
    parser.add_argument("--max-input", type=int, default=512)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and decode inputs (the workload's)")
    parser.add_argument("--decode-steps", type=int, default=64, help="steps timed for the decode figures")
    parser.add_argument(
        "--peers",
        default="transformers",
        help="comma-separated: transformers, llamacpp (installs llama-cpp-python from its sdist: ~8 min), none",
    )
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: throughput, batch1, batch32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--save-result", default=None, metavar="FILE.json")
    g = parser.add_argument_group("speculative decoding: ngram's options")
    g.add_argument("--ngram-min-n", type=int, default=None)
    g.add_argument("--ngram-max-n", type=int, default=None)


# ---- hardware limits, measured now ----------------------------------------------


def measure_copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 7) -> float:
    """Bytes copied per second (each byte read once and written once)."""
    import torch

    src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / min(times)


def measure_read_bandwidth(nbytes: int = 512 << 20, repeats: int = 7) -> float:
    """Bytes read per second by a reduction over a large bf16 tensor (what a
    decode step does to its weights), for comparison with the copy figure."""
    import torch

    x = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    x.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return nbytes / min(times)


def measure_matmul_flops(dtype_name: str, n: int = 2048, repeats: int = 5) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times)


# ---- workload ---------------------------------------------------------------------


def make_workload(args: argparse.Namespace, vocab: int, special: set[int]) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    pool = [t for t in range(vocab) if t not in special][100:]
    work = []
    for _ in range(args.num_prompts):
        n_in = rng.randint(args.min_input, args.max_input)
        n_out = rng.randint(args.min_output, args.max_output)
        work.append(([rng.choice(pool) for _ in range(n_in)], n_out))
    return work


# ---- plinth --------------------------------------------------------------------------


def run_plinth_throughput(llm: Any, work: list[tuple[list[int], int]]) -> dict[str, float]:
    from plinth.engine.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in work]
    llm.generate([p for p, _ in work[:2]], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2)  # warm up
    llm.engine.kv.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p, _ in work)
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt, "total_tok_s": (n_in + n_out) / dt}


def time_decode_steps(llm: Any, batch: int, prompt_len: int, steps: int, seed: int) -> float:
    """Median seconds per engine step once ``batch`` sequences are all decoding,
    divided by the tokens a sequence gains per step (1 without speculation)."""
    from plinth.engine.sampling_params import SamplingParams

    engine = llm.engine
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{batch}-{i}", [rng.randrange(200, vocab) for _ in range(prompt_len)], params)
    while any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    engine.step()
    times = []
    before = engine.num_generation_tokens
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    # with speculative decoding a step appends more than one token per sequence
    per_step = (engine.num_generation_tokens - before) / (steps * batch)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return statistics.median(times) / max(per_step, 1e-9)


def flops_per_token(model: Any, dtype_bytes: int) -> float:
    """2 FLOPs (multiply, add) per weight a token is multiplied by: every
    matrix and the output head; the small norm vectors are included,
    attention is not."""
    return 2 * model.weight_bytes(per_token=True) / dtype_bytes


# ---- transformers -------------------------------------------------------------------------


def load_transformers(model_path: str, dtype_name: str, workdir: str) -> Any:
    """transformers' own model on the same weights, as a plain bf16 model: a
    GGUF is converted to an HF folder first (in a child process, to keep this
    one's memory flat), since transformers would keep it quantized."""
    import os
    import subprocess

    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype_name)
    if model_path.endswith(".gguf"):
        folder = os.path.join(workdir, "hf")
        code = "import sys; from plinth.bench.peers import gguf_to_hf_folder; gguf_to_hf_folder(sys.argv[1], sys.argv[2])"
        subprocess.run([sys.executable, "-c", code, model_path, folder], check=True)
        model_path = folder
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()


def run_transformers_throughput(model: Any, work: list[tuple[list[int], int]]) -> dict[str, float]:
    """transformers' paged continuous batching, each request with its own length."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=max(n for _, n in work), do_sample=False, eos_token_id=-1)
    total_tokens = sum(len(p) + n for p, n in work)
    cb = ContinuousBatchingConfig(num_blocks=total_tokens // 16 + 64, page_size=16, max_batch_tokens=512)
    t = time.perf_counter()
    results = {}
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=5
    ) as manager:
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in work]
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                break
    dt = time.perf_counter() - t
    n_out = sum(len(r.generated_tokens) for r in results.values())
    n_in = sum(len(p) for p, _ in work)
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt, "total_tok_s": (n_in + n_out) / dt,
            "completed": len(results)}


def transformers_batch1_ms(model: Any, vocab: int, steps: int, seed: int) -> float:
    import torch

    rng = random.Random(seed)
    ids = torch.tensor([[rng.randrange(200, vocab) for _ in range(16)]])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
        dt = time.perf_counter() - t
    return dt / steps * 1000


# ---- llama.cpp ------------------------------------------------------------------------------


def ensure_llama_cpp() -> Any:
    import importlib.util

    from plinth.bench.peers import LLAMA_CPP_PYTHON, install_llama_cpp

    if importlib.util.find_spec("llama_cpp") is None:
        print(f"installing {LLAMA_CPP_PYTHON} from its sdist (about 5 minutes on 2 quiet cores)...", file=sys.stderr)
        install_llama_cpp()
    import llama_cpp

    return llama_cpp


def llama_cpp_figures(gguf: str, work: list[tuple[list[int], int]], steps: int, threads: int) -> dict[str, float]:
    llama_cpp = ensure_llama_cpp()
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
    # batch-1 decode: time tokens after the first
    prompt = work[0][0][:16]
    llm.reset()
    llm.eval(prompt)
    t = time.perf_counter()
    for _ in range(steps):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    ms = (time.perf_counter() - t) / steps * 1000
    # the mixed workload, one request after another (llama.cpp's python binding has no batching)
    t = time.perf_counter()
    n_out = 0
    for p, n in work:
        llm.reset()
        llm.eval(p)
        for _ in range(n):
            tok = llm.sample(temp=0.0)
            llm.eval([tok])
            n_out += 1
    dt = time.perf_counter() - t
    return {"batch1_ms_per_token": ms, "output_tok_s": n_out / dt, "seconds": dt}


# ---- run ----------------------------------------------------------------------------------------


def run(args: argparse.Namespace, registry: PluginRegistry) -> int:
    import os

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    from plinth.engine.llm import LLM

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    peers = {s.strip() for s in args.peers.split(",") if s.strip()} - {"none"}
    result: dict[str, Any] = {"threads": threads, "torch": torch.__version__, "args": vars(args).copy()}
    result["args"].pop("_bench", None)
    result["args"].pop("_run", None)

    print("measuring the machine...", file=sys.stderr)
    bw = measure_copy_bandwidth()
    read_bw = measure_read_bandwidth()
    result["copy_bandwidth_GBps"] = bw / 1e9
    result["read_bandwidth_GBps"] = read_bw / 1e9

    llm: Any = LLM(  # the benchmark reads the engine's parts (components, runner)
        args.model, registry=registry, kv_cache_memory=2.0, **{name: getattr(args, name) for name in ENGINE_SETTINGS},
        plugin_options={k: v for k, v in (("ngram_min_n", args.ngram_min_n), ("ngram_max_n", args.ngram_max_n)) if v is not None},
    )
    # which machine and paths the figures came from
    described = llm.engine.components.describe()
    result["engine"] = {k: described.get(k) for k in ("device", "device_name", "isa", "backend", "dtype", "ops", "max_num_seqs", "step_plan", "deterministic")}
    dtype_name = str(llm.engine.components.dtype).removeprefix("torch.")
    result["matmul_GFLOPs"] = measure_matmul_flops(dtype_name) / 1e9
    result["matmul_dtype"] = dtype_name
    model = llm.engine.executor.runner.model
    tok = llm.get_tokenizer()
    vocab = llm.engine.model_config.vocab_size
    special: set[int] = set(getattr(tok, "special_token_ids", ()) or ())
    work = make_workload(args, vocab, special)
    model_path = llm.engine.components.source.path
    result["model"] = model_path
    result["workload"] = {
        "prompts": len(work),
        "input_tokens": sum(len(p) for p, _ in work),
        "output_tokens": sum(n for _, n in work),
    }
    # a decode step reads every matrix once, the input embedding one row
    wbytes = model.weight_bytes(per_token=True)
    result["weight_bytes"] = wbytes
    result["roofline_ms_per_token"] = wbytes / bw * 1000
    result["read_roofline_ms_per_token"] = wbytes / read_bw * 1000

    if "throughput" not in skip:
        print("plinth: mixed workload...", file=sys.stderr)
        result["plinth_throughput"] = run_plinth_throughput(llm, work)
        if llm.engine.spec is not None:  # acceptance on this workload
            result["speculative"] = {k: v for k, v in llm.engine.stats().items() if k.startswith("spec_")}
    if "batch1" not in skip:
        print("plinth: batch-1 decode...", file=sys.stderr)
        result["plinth_batch1_ms_per_token"] = time_decode_steps(llm, 1, 16, args.decode_steps, args.seed) * 1000
    if "batch32" not in skip:
        print("plinth: batch-32 decode...", file=sys.stderr)
        step = time_decode_steps(llm, 32, 128, args.decode_steps, args.seed)
        flop_per_token = flops_per_token(model, llm.engine.components.dtype.itemsize)
        result["plinth_batch32_step_ms"] = step * 1000
        result["plinth_batch32_GFLOPs"] = 32 * flop_per_token / step / 1e9
        result["plinth_batch32_fraction_of_matmul"] = 32 * flop_per_token / step / (result["matmul_GFLOPs"] * 1e9)
    del llm, model

    if "transformers" in peers:
        print("transformers: loading the same weights...", file=sys.stderr)
        import tempfile

        workdir = tempfile.mkdtemp(prefix="plinth-bench-")
        tmodel = load_transformers(model_path, dtype_name, workdir)  # the dtype the engine ran
        if "throughput" not in skip:
            print("transformers: continuous batching on the mixed workload...", file=sys.stderr)
            result["transformers_throughput"] = run_transformers_throughput(tmodel, work)
        if "batch1" not in skip:
            result["transformers_batch1_ms_per_token"] = transformers_batch1_ms(tmodel, vocab, args.decode_steps, args.seed)
        del tmodel
    if "llamacpp" in peers and model_path.endswith(".gguf"):
        print("llama.cpp: same GGUF...", file=sys.stderr)
        result["llamacpp"] = llama_cpp_figures(model_path, work, args.decode_steps, threads)

    print_report(result)
    if args.save_result:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_result)), exist_ok=True)
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


def print_report(r: dict[str, Any]) -> None:
    lines = [
        f"machine: {r['threads']} threads, copy bandwidth {r['copy_bandwidth_GBps']:.1f} GB/s "
        f"(read-only {r['read_bandwidth_GBps']:.1f} GB/s), "
        f"matmul {r['matmul_GFLOPs']:.0f} GFLOP/s ({r.get('matmul_dtype', r['args']['dtype'])})",
        f"model: {r['model']} ({r['weight_bytes'] / 1e6:.0f} MB of weights read per decode step, "
        f"{r.get('matmul_dtype', 'bf16')})",
    ]
    engine = r.get("engine") or {}
    if engine.get("device_name"):
        lines.insert(0, f"cpu/device: {engine['device_name']}; instruction sets: {','.join(engine.get('isa') or []) or 'not reported'}; "
                        f"backend {engine.get('backend')}, {engine.get('dtype')}, deterministic {'on' if engine.get('deterministic') else 'off'}")
    w = r["workload"]
    lines.append(f"workload: {w['prompts']} prompts, {w['input_tokens']} input / {w['output_tokens']} output tokens")
    pt, tt = r.get("plinth_throughput"), r.get("transformers_throughput")
    if pt:
        lines.append(f"plinth throughput: {pt['output_tok_s']:.1f} output tok/s, {pt['total_tok_s']:.1f} total tok/s ({pt['seconds']:.1f} s)")
    if tt:
        lines.append(f"transformers generate_batch: {tt['output_tok_s']:.1f} output tok/s, {tt['total_tok_s']:.1f} total tok/s ({tt['seconds']:.1f} s)")
    if pt and tt:
        lines.append(f"  ratio plinth / transformers (output tok/s): {pt['output_tok_s'] / tt['output_tok_s']:.1f}x")
    if "plinth_batch1_ms_per_token" in r:
        ms = r["plinth_batch1_ms_per_token"]
        lines.append(
            f"batch-1 decode: {ms:.2f} ms/token; roofline {r['roofline_ms_per_token']:.2f} ms/token by copy bandwidth "
            f"({ms / r['roofline_ms_per_token']:.2f}x of it), {r['read_roofline_ms_per_token']:.2f} ms/token by read "
            f"bandwidth ({ms / r['read_roofline_ms_per_token']:.2f}x)"
        )
    if "transformers_batch1_ms_per_token" in r:
        lines.append(f"  transformers batch-1: {r['transformers_batch1_ms_per_token']:.2f} ms/token")
    if "llamacpp" in r:
        lc = r["llamacpp"]
        lines.append(f"  llama.cpp batch-1: {lc['batch1_ms_per_token']:.2f} ms/token; sequential workload {lc['output_tok_s']:.1f} output tok/s")
    if "plinth_batch32_step_ms" in r:
        lines.append(
            f"batch-32 decode: {r['plinth_batch32_step_ms']:.1f} ms/step, {r['plinth_batch32_GFLOPs']:.0f} GFLOP/s "
            f"= {100 * r['plinth_batch32_fraction_of_matmul']:.0f}% of the measured matmul FLOP/s"
        )
    sp = r.get("speculative")
    if sp:
        per_pos = ", ".join(f"{x:.2f}" for x in sp["spec_acceptance_rate_per_position"])
        lines.append(
            f"speculative ({sp['spec_method']}, k={sp['spec_num_speculative_tokens']}) on the mixed workload: "
            f"{sp['spec_proposed_tokens']} proposed, {sp['spec_accepted_tokens']} accepted, {sp['spec_rejected_tokens']} rejected "
            f"(rate {sp['spec_acceptance_rate']:.2f}; per position {per_pos}); mean accepted length {sp['spec_mean_accepted_length']:.2f}"
        )
    print("\n".join(lines))
