#!/usr/bin/env python
"""Issue 12, deliverable 2: fuse a decode step's small ops by torch.compile
or by C++ kernels, whichever measures faster. A trial, not wired in.

    .venv/bin/python bench/compile_trial.py [--batch 1,16] [--context 128] [--steps 20] [--dtype bfloat16] [--no-dequantize]

For each batch size it builds one real decode step of the default model
(SmolLM2-135M; ``--model`` for another) through the engine (requests
prefilled, then the scheduler's decode batch and the runner's metadata, as
bench/profile_step.py drives a step) and times the model's forward plus its
logits on that fixed batch, repeated in place (the same KV slots rewritten):

* ``torch eager``: the reference backend (``--backend torch``), op by op;
* ``torch compiled``: the same model under ``torch.compile(dynamic=False)``
  (inductor, CPU C++/OpenMP codegen), compiled once per batch size; graph
  breaks (the backend's attention, host-side metadata) are counted, not avoided;
* ``cpukernels eager``: the C++ backend with its fused ops.

Clock: ``time.thread_time`` at one torch thread (CPU work, nearly blind to
other processes on a shared machine); the median of ``--steps`` steps after
warm-ups. GGUF weights are dequantized (``--dequantize``, the default) so
that all three read the same bf16 weights and only the small-op handling
differs. Prints a markdown table; ``--json`` saves the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any


def decode_setup(llm: Any, batch: int, context: int, seed: int) -> tuple[Any, Any, Any]:
    """Prefill ``batch`` prompts of ``context`` tokens, then the scheduler's
    next (all-decode) batch as the runner would run it."""
    from plinth.engine.sampling_params import SamplingParams

    engine = llm.engine
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", [rng.randrange(200, vocab) for _ in range(context)], params)
    while any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    sched = engine.scheduler.schedule()
    assert len(sched.seqs) == batch and all(n == 1 for n in sched.num_tokens), (len(sched.seqs), sched.num_tokens)
    input_ids, meta = engine.executor.runner.build_metadata(sched)
    return engine.executor.runner, input_ids, meta


def time_steps(fn: Any, steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return statistics.median(times) * 1e3


def _plain_rotary_factors(positions: Any, cos_sin: Any, dtype: Any, is_neox: bool) -> tuple[Any, Any]:
    """plinth_plugin_torch.ops._rotary_factors without its caches."""
    import torch

    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    if is_neox:
        cos_full, sin_signed = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
    else:
        cos_full, sin_signed = cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2)
    index = positions.reshape(-1)
    cos = cos_full.to(dtype).index_select(0, index).unsqueeze(1)
    sin = sin_signed.to(dtype).index_select(0, index).unsqueeze(1)
    return cos, sin


def run_variant(name: str, backend: str, compiled: bool, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    import torch
    from plinth import LLM

    kw: dict[str, Any] = dict(backend=backend, load_progress=False, plugin_options={"cpu_threads": 1})
    kw["max_num_batched_tokens"] = max(64, batch * args.context)  # one prefill step, no start-up probes
    if args.model:
        kw["model"] = args.model
    if args.dtype:
        kw["dtype"] = args.dtype
    if args.dequantize:
        kw["dequantize"] = True
    llm = LLM(**kw)
    torch.set_num_threads(1)
    runner, input_ids, meta = decode_setup(llm, batch, args.context, args.seed)
    model = runner.model

    def step_eager_body(ids: Any, pos: Any, kv: Any, m: Any) -> Any:
        return model.compute_logits(model(ids, pos, kv, m))

    out: dict[str, Any] = {"variant": name, "batch": batch}
    body = step_eager_body
    if compiled:
        import torch._dynamo

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        # the reference rms_norm's decode fast path caches a tensor in the
        # weight's __dict__, which dynamo cannot trace: compiled, the plain
        # F.rms_norm (inductor fuses it) is what runs
        import plinth_plugin_torch.ops as torch_ops

        torch_ops._SMALL_NORM = -1
        # likewise the rotary tables cached on the cos/sin tensor and the
        # per-step memo of gathered rows: compiled, the same arithmetic done
        # plainly (inductor folds and fuses it)
        torch_ops._rotary_factors = _plain_rotary_factors
        if args.freezing:  # weights as constants: inductor may prepack them for oneDNN
            import torch._inductor.config as inductor_config

            inductor_config.freezing = True
            out["freezing"] = True
        body = torch.compile(step_eager_body, dynamic=False)
        t0, c0 = time.perf_counter(), time.thread_time()
        with torch.inference_mode():
            runner.prepare(meta)
            body(input_ids, meta.positions, runner.kv_caches, meta)
        out["compile_wall_s"] = round(time.perf_counter() - t0, 1)
        out["compile_cpu_s"] = round(time.thread_time() - c0, 1)
        counters = torch._dynamo.utils.counters
        out["graph_breaks"] = sum(counters["graph_break"].values())
        out["graph_break_reasons"] = sorted({str(k)[:160] for k in counters["graph_break"]})[:8]
        out["unique_graphs"] = counters["stats"].get("unique_graphs", 0)

    def step() -> Any:
        with torch.inference_mode():
            runner.prepare(meta)
            return body(input_ids, meta.positions, runner.kv_caches, meta)

    with torch.inference_mode():
        ref = step_eager_body(input_ids, meta.positions, runner.kv_caches, meta).float()
        got = step().float()
    out["max_abs_logit_diff_vs_eager"] = float((ref - got).abs().max())
    out["same_argmax"] = bool((ref.argmax(-1) == got.argmax(-1)).all())
    out["ms_per_step"] = round(time_steps(step, args.steps), 2)
    del llm
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None, help="default: the accelerator's (bfloat16 with AVX-512 BF16)")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dequantize", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--variants", default="torch-eager,torch-compiled,cpukernels-eager")
    ap.add_argument("--freezing", action="store_true", help="inductor's freezing (weights folded in as constants)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants = {
        "torch-eager": ("torch", False),
        "torch-compiled": ("torch", True),
        "cpukernels-eager": ("cpukernels", False),
        "cpukernels-compiled": ("cpukernels", True),
    }
    rows = []
    load_before = os.getloadavg()
    for batch in [int(b) for b in args.batch.split(",")]:
        for name in args.variants.split(","):
            backend, compiled = variants[name]
            print(f"b={batch} {name}...", file=sys.stderr, flush=True)
            import plinth_plugin_torch.ops as torch_ops

            saved = torch_ops._SMALL_NORM, torch_ops._rotary_factors
            try:
                rows.append(run_variant(name, backend, compiled, args, batch))
            except Exception as exc:  # a trial: report the failure and go on
                rows.append({"variant": name, "batch": batch, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            finally:  # the eager variants run the reference ops as they are
                torch_ops._SMALL_NORM, torch_ops._rotary_factors = saved
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {"load_before": load_before, "load_after": os.getloadavg(), "context": args.context, "rows": rows}
    print(
        f"decode step (forward + logits), context {args.context}, CPU ms on one thread (median of {args.steps}); "
        f"load average {load_before[0]:.1f} -> {result['load_after'][0]:.1f}\n"
    )
    print("| batch | variant | ms/step | graph breaks | compile (wall s) | max logit diff vs eager |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['batch']} | {r['variant']} | failed: {r['error']} | | | |")
        else:
            print(
                f"| {r['batch']} | {r['variant']} | {r['ms_per_step']} | {r.get('graph_breaks', '')} | "
                f"{r.get('compile_wall_s', '')} | {r['max_abs_logit_diff_vs_eager']:.3g} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
