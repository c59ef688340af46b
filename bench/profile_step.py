#!/usr/bin/env python
"""Where a step's time goes: a per-op profile of plinth's decode and prefill
steps on this CPU (issue 12, "where the time goes").

    .venv/bin/python bench/profile_step.py [--dtype bfloat16] [--batch 1,16] [--context 128] [--prefill 512] [--json FILE]

Every op of the resolved op table (the backend's and the reference's) is
wrapped, and so are the model's forward and logits, the runner's metadata
build, the scheduler and the sampler; the rest of a step is "engine, other".
Two clocks:

* **CPU ms, 1 thread** (`time.thread_time`, torch at one thread): what the
  step costs in work, nearly blind to other processes on a shared machine,
  so it shows where the time goes even when the wall clock cannot;
* **wall ms, all threads**: the step as it runs (median of the timed steps),
  meaningful only on a quiet machine (the load average is printed).

Decode: ``--batch`` sequences with ``--context`` random prompt tokens, timed
over ``--steps`` steps once all decode. Prefill: one prompt of ``--prefill``
tokens in one step. The table goes to stdout (markdown); ``--json`` saves it.
Set ``PLINTH_CPU_ISA=avx2,fma ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``
to profile the AVX2 paths on a bigger CPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import sys
import time
from typing import Any


def instrument(engine: Any, clock: Any) -> dict[str, list[float]]:
    """Wrap every op and the engine's parts; returns name -> [ns, calls]."""
    acc: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])

    def wrap(name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                cell = acc[name]
                cell[0] += clock() - t
                cell[1] += 1

        return timed

    runner = engine.executor.runner
    model = runner.model
    ops = model.ops
    for name, fn in list(vars(ops).items()):
        if callable(fn) and name != "pack_linear":
            setattr(ops, name, wrap(f"op {name}", fn))
    attention = runner.attention
    attention.forward = wrap("op attention", attention.forward)
    runner.prepare = wrap("op attention plan", runner.prepare)
    # the model looked its ops up at load: point it at the wrapped ones
    if hasattr(model, "qkv_attention") and model.qkv_attention is not None:
        model.qkv_attention = wrap("op qkv_attention", model.qkv_attention)
    for layer in getattr(model, "layers", []):
        moe = getattr(layer, "moe", None)
        if moe is not None and hasattr(moe, "ops"):
            moe.ops = ops
    model.forward = wrap("model forward (total)", model.forward)
    model.compute_logits = wrap("logits (total)", model.compute_logits)
    runner.build_metadata = wrap("batch metadata", runner.build_metadata)
    engine.scheduler.schedule = wrap("scheduler", engine.scheduler.schedule)
    engine.sampler.__call__  # noqa: B018  (a plain object: wrap the attribute the engine calls)
    engine.sampler = _CallableProxy(engine.sampler, wrap("sampler", engine.sampler.__call__))
    return acc


class _CallableProxy:
    def __init__(self, target: Any, call: Any) -> None:
        self._target, self._call = target, call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def profile(engine: Any, *, batch: int, context: int, prefill: int, steps: int, seed: int, clock: Any) -> dict[str, Any]:
    from plinth.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    acc = instrument(engine, clock)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(200, vocab) for _ in range(n)]

    def drain() -> None:
        for rid in list(engine.requests):
            engine.abort_request(rid)
        engine.step()

    result: dict[str, Any] = {}
    if batch:
        params = SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"d{i}", prompt(context), params)
        while any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running + list(engine.scheduler.waiting)):
            engine.step()
        for _ in range(3):
            engine.step()
        acc.clear()
        times = []
        for _ in range(steps):
            t = clock()
            engine.step()
            times.append(clock() - t)
        result["decode"] = _table(acc, times, steps)
        drain()
    if prefill:
        engine.kv.reset_prefix_cache()
        engine.add_request("warm", prompt(prefill), SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        acc.clear()
        times = []
        for i in range(3):
            engine.kv.reset_prefix_cache()
            engine.add_request(f"p{i}", prompt(prefill), SamplingParams(max_tokens=1, ignore_eos=True))
            t = clock()
            while engine.has_unfinished():
                engine.step()
            times.append(clock() - t)
        result["prefill"] = _table(acc, times, 3)
    return result


def _table(acc: dict[str, list[float]], times: list[float], steps: int) -> dict[str, Any]:
    rows = {name: {"ms": ns / steps / 1e6, "calls": calls / steps} for name, (ns, calls) in acc.items()}
    step_ms = statistics.median(times) / 1e6
    mean_ms = sum(times) / len(times) / 1e6
    inner = sum(r["ms"] for name, r in rows.items() if name.startswith("op ") and name != "op linear")
    covered = sum(rows.get(k, {"ms": 0})["ms"] for k in ("model forward (total)", "logits (total)", "batch metadata", "scheduler", "sampler"))
    rows["engine, other"] = {"ms": max(0.0, mean_ms - covered), "calls": 1}
    fwd = rows.get("model forward (total)", {"ms": 0})["ms"]
    lin = rows.get("op linear", {"ms": 0})["ms"]
    logits = rows.get("logits (total)", {"ms": 0})["ms"]
    # linear inside the forward (the head's linear is counted in logits)
    rows["model, between ops (Python, views)"] = {"ms": max(0.0, fwd - (lin - logits) - inner), "calls": 1}
    return {"step_ms_median": step_ms, "step_ms_mean": mean_ms, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None, help="default: the accelerator's")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--batch", default="1,16", help="decode batch sizes, comma-separated (0: none)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens (0: none)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dequantize", action="store_true", help="GGUF weights dequantized at load (else as the backend runs them)")
    ap.add_argument("--cpu-bind", default=None, help="the cpu plugin's --cpu-bind for the all-threads run (auto, a cpulist)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch
    from plinth import LLM

    kwargs: dict[str, Any] = {"backend": args.backend}
    if args.dequantize:
        kwargs["dequantize"] = True
    if args.model:
        kwargs["model"] = args.model
    if args.dtype:
        kwargs["dtype"] = args.dtype
    out: dict[str, Any] = {"load_before": os.getloadavg()}
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    threads_all = torch.get_num_threads()
    for mode in ("cpu_1_thread", "wall_all_threads"):
        threads = 1 if mode == "cpu_1_thread" else threads_all
        clock = time.thread_time_ns if mode == "cpu_1_thread" else time.perf_counter_ns
        for i, batch in enumerate(batches or [0]):
            options: dict[str, Any] = {"cpu_threads": threads}
            if args.cpu_bind and threads > 1:
                options["cpu_bind"] = args.cpu_bind
            llm = LLM(plugin_options=options, load_progress=False, **kwargs)
            torch.set_num_threads(threads)
            engine = llm.engine
            out.setdefault("device", getattr(engine, "device_description", None))
            res = profile(engine, batch=batch, context=args.context, prefill=args.prefill if i == 0 else 0, steps=args.steps, seed=args.seed, clock=clock)
            for part, table in res.items():
                key = f"{part} b={batch}" if part == "decode" else f"{part} {args.prefill}"
                out.setdefault(mode, {})[key] = table
            del llm, engine
    out["load_after"] = os.getloadavg()
    out["dtype"] = args.dtype or "default"
    out["isa"] = os.environ.get("PLINTH_CPU_ISA", "all the CPU has")
    out["cpu_bind"] = args.cpu_bind or "none"
    print(render(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def render(out: dict[str, Any]) -> str:
    lines = [
        f"load average before {out['load_before'][0]:.2f}, after {out['load_after'][0]:.2f}; dtype {out['dtype']}; "
        f"PLINTH_CPU_ISA: {out['isa']}; threads bound: {out['cpu_bind']}"
    ]
    cpu, wall = out.get("cpu_1_thread", {}), out.get("wall_all_threads", {})
    for part in cpu:
        c, w = cpu[part], wall.get(part)
        lines.append("")
        head = f"**{part}**: {c['step_ms_mean']:.2f} ms CPU per step on 1 thread"
        if w:
            head += f"; {w['step_ms_median']:.2f} ms wall (median) on all threads"
        lines.append(head)
        lines.append("")
        lines.append("| part | CPU ms, 1 thread | share | calls/step | wall ms, all threads |")
        lines.append("|---|---:|---:|---:|---:|")
        total = c["step_ms_mean"]
        for name, r in sorted(c["rows"].items(), key=lambda kv: -kv[1]["ms"]):
            wr = (w or {}).get("rows", {}).get(name, {}).get("ms")
            lines.append(
                f"| {name} | {r['ms']:.3f} | {100 * r['ms'] / total:.0f}% | {r['calls']:.0f} | {'' if wr is None else f'{wr:.3f}'} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
