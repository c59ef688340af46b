"""`platform bench a2a`: MoE dispatch and combine, latency and GB/s, for every
a2a plugin that validates, on real ranks.

The ranks are real processes joined in one torch.distributed group on
127.0.0.1 (``plinth.testing.run_ranks``), with the group backend the chosen
accelerator names (gloo on CPU; the GPU's collective library on a GPU), one
device per rank. Each plugin (or plugin with options, ``--a2a NAME@k=v,...``)
runs in its own set of ranks, so one that fails costs only its own rows.

For every shape (tokens per rank x hidden x top-k x experts) and both modes:

* ``prefill`` (``decode=False``: the "flat" layout) and ``decode``
  (``decode=True``: a plugin may hand the "padded" layout; the layout it
  actually gave is in the table);
* routing: uniform random top-k over every expert, a fresh seed per rank;
* one checked round trip first (identity experts: combine must give
  sum_k w_k x), then ``--warmup`` untimed and ``--iters`` timed ones. Each
  dispatch and each combine starts after a barrier and ends with the
  accelerator's synchronize; an iteration's time is the slowest rank's, the
  figure the median over iterations;
* GB/s = bytes a rank receives in dispatch / dispatch time (and the same
  bytes sent back / combine time), averaged over ranks. Bytes are, as in
  DeepEP's own tests: flat, received tokens x hidden x dtype size (each token
  once per rank); padded, received (token, expert) pairs x hidden x dtype
  size.

Names of plugins come from the registry only; plugin options travel as
``SelectionContext.options`` (what ``platform serve`` passes them).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any

from plinth.plugins import PluginRegistry

MODES = {"prefill": False, "decode": True}  # mode -> the decode flag dispatch gets


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}") from exc
    if not out or any(v < 0 for v in out):
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative integers, not {text!r}")
    return out


def add_arguments(parser: argparse.ArgumentParser, registry: PluginRegistry) -> None:
    names = registry.names("a2a")
    parser.add_argument(
        "--a2a", action="append", default=None, metavar="[LABEL:]NAME[@KEY=VALUE,...]",
        help=f"an a2a plugin to measure, optionally with plugin options and a label for the table (repeat for "
        f"several; the same plugin may appear with different options). Default: every registered one ({', '.join(names) or 'none installed'}); "
        f"those that do not validate here are listed with their reasons",
    )  # fmt: skip
    parser.add_argument("--ranks", type=int, default=2, help="processes in the ep group (one device each; default 2)")
    parser.add_argument("--device", default="auto", help="the accelerator plugin (default: auto)")
    parser.add_argument(
        "--tokens", type=_ints, default=[16, 256], help="tokens per rank, comma-separated (default 16,256)"
    )
    parser.add_argument("--hidden", type=_ints, default=[1024, 4096], help="hidden sizes (default 1024,4096)")
    parser.add_argument("--topk", type=_ints, default=[2, 8], help="experts per token (default 2,8)")
    parser.add_argument(
        "--experts", type=_ints, default=[16, 64], help="expert counts, each a multiple of --ranks (default 16,64)"
    )
    parser.add_argument(
        "--modes",
        default="prefill,decode",
        help="prefill (decode=False, flat), decode (decode=True, padded where the plugin has it)",
    )
    parser.add_argument("--dtype", default="bfloat16", help="the hidden states' dtype (default bfloat16)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds for one plugin's whole sweep (and each collective)"
    )
    parser.add_argument("--save-result", default=None, metavar="FILE.json")


def split_label(spec: str) -> tuple[str, str]:
    """``LABEL:NAME@...`` -> (LABEL, ``NAME@...``); without a label the spec is its own."""
    head = spec.split("@", 1)[0]
    if ":" in head:
        label, _, rest = spec.partition(":")
        return label.strip() or rest, rest
    return spec, spec


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME`` or ``NAME@key=value,key=value`` -> (name, options); values
    that read as an int, a float or true/false become one."""
    name, _, rest = spec.partition("@")
    options: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--a2a {spec!r}: options are KEY=VALUE, not {item!r}")
        low = value.lower()
        if low in ("true", "false"):
            options[key] = low == "true"
            continue
        for cast in (int, float):
            try:
                options[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            options[key] = value
    return name.strip(), options


# ---- one rank ------------------------------------------------------------------------


def _rank(rank: int, world: int, plan: dict[str, Any]) -> dict[str, Any]:
    """One rank's sweep for one plugin (run by ``run_ranks``)."""
    import gc

    import torch
    import torch.distributed as dist

    from plinth.api import PlannedLayout, SelectionContext
    from plinth.testing.a2a import _expected, _experts

    registry = PluginRegistry.discover(allow=plan["allow"], block=plan["block"])
    options = dict(plan["options"])
    acc = registry.select("accelerator", plan["device"], SelectionContext(options=options)).load()()
    acc.init_process(local_rank=rank, options=options)
    device = acc.device(rank)
    dtype = getattr(torch, plan["dtype"])
    info = acc.info()
    most = max(plan["tokens"])  # the sweep's largest dispatch sizes the buffers, as a step's budget does in the engine
    planned = PlannedLayout(
        world=world, dp=world, ep=world, local_world=world, device_type=info.device_type, capability=info.capability,
        dtype=plan["dtype"], hidden_size=max(plan["hidden"]), num_experts=max(plan["experts"]), top_k=max(plan["topk"]),
        max_tokens_per_step=most, max_num_seqs=most,
    )  # fmt: skip
    ctx = SelectionContext(accelerator=acc, dtype=dtype, ep=world, options=options, layout=planned)
    entry = registry.get("a2a", plan["name"])
    reasons = entry.evaluate(ctx)
    # every rank must agree to go on: one that cannot would leave the others in a collective
    flag = torch.tensor([1 if reasons else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()):
        return {"skipped": reasons or ["another rank's check() failed"], "rows": []}
    cls = entry.load()
    rows = []
    for num_experts, hidden, top_k in itertools.product(plan["experts"], plan["hidden"], plan["topk"]):
        if num_experts % world or top_k > num_experts:
            continue  # left out by the parent too
        shape = dataclasses.replace(planned, hidden_size=hidden, num_experts=num_experts, top_k=top_k)
        a2a = cls(dataclasses.replace(ctx, layout=shape), group=dist.group.WORLD, num_experts=num_experts, hidden_size=hidden)
        a2a.reserve_buffers()  # every rank together, as at engine start-up
        start = rank * (num_experts // world)
        for tokens in plan["tokens"]:
            g = torch.Generator().manual_seed(
                plan["seed"] * 1_000_003 + rank * 7919 + tokens * 31 + hidden + num_experts * 17 + top_k
            )
            ids = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=-1).indices.to(device)
            weights = torch.rand(tokens, top_k, generator=g).softmax(-1).to(device)
            x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
            for mode in plan["modes"]:
                decode = MODES[mode]
                # the checked round trip
                got, handle = a2a.dispatch(x, ids, weights, decode=decode)
                y = a2a.combine(_experts(got, start, False), handle)
                want = _expected(x, weights, ids, False)
                err = float((y.float() - want).abs().max()) if tokens else 0.0
                bound = 3e-2 * (1 + float(want.abs().max())) if tokens else 0.0
                ok = tuple(y.shape) == (tokens, hidden) and err <= bound
                layout = got.layout
                pairs = int(got.counts.sum()) if got.counts.numel() else 0
                rows_in = got.x.shape[0] if layout == "flat" else pairs
                nbytes = rows_in * hidden * got.x.element_size()
                t_dispatch, t_combine = [], []
                for i in range(plan["warmup"] + plan["iters"]):
                    dist.barrier()
                    acc.synchronize()
                    t0 = time.perf_counter()
                    got, handle = a2a.dispatch(x, ids, weights, decode=decode)
                    acc.synchronize()
                    t1 = time.perf_counter()
                    out = _experts(got, start, False)
                    dist.barrier()
                    acc.synchronize()
                    t2 = time.perf_counter()
                    a2a.combine(out, handle)
                    acc.synchronize()
                    t3 = time.perf_counter()
                    if i >= plan["warmup"]:
                        t_dispatch.append(t1 - t0)
                        t_combine.append(t3 - t2)
                rows.append({
                    "experts": num_experts, "hidden": hidden, "topk": top_k, "tokens": tokens, "mode": mode,
                    "layout": layout, "ok": ok, "max_abs_error": err, "bytes": nbytes,
                    "received_rows": int(got.x.shape[0]) if layout == "flat" else pairs, "pairs": pairs,
                    "dispatch_s": t_dispatch, "combine_s": t_combine,
                })  # fmt: skip
        del a2a
        gc.collect()
    return {"skipped": [], "rows": rows}


# ---- the parent ------------------------------------------------------------------------


def aggregate(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's rows (same order on every rank) -> one row per case: per
    iteration the slowest rank, the median of those; bytes averaged over ranks."""
    out = []
    for cases in zip(*(r["rows"] for r in per_rank)):
        first = cases[0]
        d = [max(ts) for ts in zip(*(c["dispatch_s"] for c in cases))]
        c = [max(ts) for ts in zip(*(c["combine_s"] for c in cases))]
        nbytes = statistics.fmean(x["bytes"] for x in cases)
        dm, cm = statistics.median(d), statistics.median(c)
        out.append({
            **{k: first[k] for k in ("experts", "hidden", "topk", "tokens", "mode", "layout")},
            "layouts_by_rank": sorted({x["layout"] for x in cases}),
            "ok": all(x["ok"] for x in cases),
            "max_abs_error": max(x["max_abs_error"] for x in cases),
            "bytes_per_rank": nbytes,
            "received_rows_per_rank": [x["received_rows"] for x in cases],
            "dispatch_us": dm * 1e6, "combine_us": cm * 1e6,
            "dispatch_us_min": min(d) * 1e6, "combine_us_min": min(c) * 1e6,
            "dispatch_GBps": nbytes / dm / 1e9 if dm > 0 else 0.0,
            "combine_GBps": nbytes / cm / 1e9 if cm > 0 else 0.0,
        })  # fmt: skip
    return out


def machine(acc: Any) -> dict[str, Any]:
    import platform as host

    import torch

    info = acc.info()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "accelerator": type(acc).name or type(acc).__name__, "device_type": info.device_type,
        "device_name": info.device_name, "device_count": info.device_count, "isa": list(info.isa),
        "dist_backend": info.dist_backend, "cpu_count": os.cpu_count(), "load_average": list(load) if load else None,
        "torch": torch.__version__, "python": host.python_version(),
    }  # fmt: skip


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(
        f"device: {m['device_name'] or m['device_type']} ({m['accelerator']}, group backend {m['dist_backend']}); "
        f"{result['ranks']} ranks; {m['cpu_count']} cpus, load average {', '.join(f'{x:.1f}' for x in m['load_average'] or [])}"
        + (f"; instruction sets {','.join(m['isa'])}" if m["isa"] else "")
    )
    print(
        f"dtype {result['args']['dtype']}; times: median over {result['args']['iters']} iterations of the slowest rank; "
        f"GB/s: bytes a rank receives (flat: tokens, padded: token-expert pairs) / time"
    )
    head = (
        f"{'plugin':<28} {'mode':<7} {'layout':<6} {'tokens':>6} {'hidden':>6} {'topk':>4} {'experts':>7} "
        f"{'dispatch us':>11} {'GB/s':>7} {'combine us':>10} {'GB/s':>7}  check"
    )
    print(head)
    print("-" * len(head))
    for label, res in result["plugins"].items():
        if res.get("skipped"):
            print(f"{label:<28} skipped: {'; '.join(res['skipped'])}")
            continue
        if res.get("error"):
            print(f"{label:<28} FAILED: {res['error'].strip().splitlines()[-1] if res['error'].strip() else ''}")
            continue
        for r in res["rows"]:
            print(
                f"{label:<28} {r['mode']:<7} {r['layout']:<6} {r['tokens']:>6} {r['hidden']:>6} {r['topk']:>4} {r['experts']:>7} "
                f"{r['dispatch_us']:>11.1f} {r['dispatch_GBps']:>7.2f} {r['combine_us']:>10.1f} {r['combine_GBps']:>7.2f}  "
                + ("ok" if r["ok"] else f"MISMATCH (max abs error {r['max_abs_error']:.3g})")
            )


def run(args: argparse.Namespace, registry: PluginRegistry) -> int:
    from plinth.api import SelectionContext
    from plinth.errors import PlinthError
    from plinth.testing.distributed import run_ranks

    if args.ranks < 1:
        raise PlinthError("--ranks must be at least 1")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise PlinthError(f"--modes takes {', '.join(MODES)}, not {args.modes!r}")
    specs = args.a2a or ["all"]
    if "all" in specs:
        specs = [s for s in specs if s != "all"] + [n for n in registry.names("a2a") if n not in specs]
    if not specs:
        raise PlinthError("no a2a plugin is installed (pip install ./plugins/a2a/nccl)")
    experts = [e for e in args.experts if e % args.ranks == 0 and e > 0]
    dropped = sorted(set(args.experts) - set(experts))
    if dropped:
        print(f"note: expert counts {dropped} do not split over {args.ranks} ranks: left out", file=sys.stderr)
    if not experts:
        raise PlinthError(f"no expert count in {args.experts} splits over {args.ranks} ranks")
    if any(k > min(experts) for k in args.topk):
        print("note: top-k larger than an expert count is left out for that count", file=sys.stderr)
    acc = registry.select("accelerator", args.device, SelectionContext()).load()()
    result: dict[str, Any] = {
        "bench": "a2a", "ranks": args.ranks, "machine": machine(acc),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "plugins": {},
    }  # fmt: skip
    backend = acc.info().dist_backend
    allow, block = getattr(args, "plugins_allow", None), getattr(args, "plugins_block", None)
    for spec in specs:
        label, spec = split_label(spec)
        name, options = parse_spec(spec)
        entry = registry.get("a2a", name)  # PluginError (exit 2) names the choices
        # the reasons that do not need the world (which exists only in the ranks): skip before spawning
        reasons = entry.evaluate(SelectionContext(accelerator=acc, ep=1, options=options))
        if reasons:
            result["plugins"][label] = {"plugin": name, "options": options, "skipped": reasons, "rows": []}
            print(f"{label}: skipped: {'; '.join(reasons)}", file=sys.stderr)
            continue
        plan = {
            "name": name, "options": options, "device": args.device, "dtype": args.dtype, "allow": allow, "block": block,
            "tokens": args.tokens, "hidden": args.hidden, "topk": args.topk, "experts": experts, "modes": modes,
            "warmup": args.warmup, "iters": max(1, args.iters), "seed": args.seed,
        }  # fmt: skip
        print(f"{label}: {args.ranks} ranks over {backend}...", file=sys.stderr)
        t = time.perf_counter()
        try:
            per_rank = run_ranks(_rank, args.ranks, plan, backend=backend, timeout=args.timeout)
        except AssertionError as exc:  # a rank raised, died or overstayed: this plugin's rows are lost
            result["plugins"][label] = {"plugin": name, "options": options, "error": str(exc), "rows": []}
            print(f"{label}: FAILED\n{exc}", file=sys.stderr)
            continue
        skipped = next((r["skipped"] for r in per_rank if r["skipped"]), [])
        result["plugins"][label] = {
            "plugin": name, "version": entry.version, "options": options, "skipped": skipped,
            "rows": [] if skipped else aggregate(per_rank), "seconds": time.perf_counter() - t,
        }  # fmt: skip
    print_table(result)
    if args.save_result:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_result)), exist_ok=True)
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2, default=str)
    rows = [r for p in result["plugins"].values() for r in p["rows"]]
    failed = any(p.get("error") for p in result["plugins"].values()) or not all(r["ok"] for r in rows)
    return 1 if failed else 0
