"""nccl vs deepep (legacy Buffer normal + low-latency, V2 ElasticBuffer) at
EP8-like shapes on one GPU machine, with DeepEP's published figures beside
ours. One command, a few minutes:

    .venv/bin/python bench/gpu/a2a.py                  # every visible GPU (at most 8), one rank each
    .venv/bin/python bench/gpu/a2a.py --install        # first pip-install core + the cuda/nccl/deepep plugins (editable)
    .venv/bin/python bench/gpu/a2a.py --dry-run        # CPU: the same code over gloo, tiny shapes (deepep skipped with its reasons)

It runs ``platform bench a2a`` twice, one process per rank:

* prefill: 4096 tokens per rank, hidden 7168, top-8 of 256 experts, decode=False
  (nccl: all_to_all_single; deepep legacy: the normal kernels; deepep V2:
  ElasticBuffer), against DeepEP's intranode EP8 normal figures;
* decode: 128 tokens per rank, same model shape, decode=True (nccl: the
  padded layout built from one all_to_all_single; deepep legacy: the
  low-latency kernels; V2: ElasticBuffer with its cached handle), against
  DeepEP's EP8 low-latency figures.

DeepEP's published figures (README of deepseek-ai/DeepEP, H800, NVLink about
160 GB/s, CX7 400 Gb/s RDMA; DeepSeek-V3 shapes: hidden 7168, top-8):
normal intranode EP8 dispatch 153 GB/s, combine 158 GB/s (4096 tokens,
FP8 dispatch, BF16 combine); low-latency EP8 dispatch 77 us (98 GB/s),
combine 114 us (127 GB/s) (128 tokens per rank, FP8 dispatch, BF16
combine). Ours move bfloat16 in both directions (deepep's FP8 dispatch is
not offered: no backend here has an FP8 grouped GEMM on its layout), on
whatever GPU this is (an H200's
NVLink is about 450 GB/s a direction, H800's about 160), and a time is the
slowest rank's, host-timed around a synchronize (DeepEP's tests time
kernels), so expect ours to read somewhat slower at the same bandwidth.
GB/s are counted as DeepEP's tests count them (see ``platform bench a2a
--help``).

Exit status: 0 when every case that ran round-tripped correctly, 1 on a
mismatch or a failed plugin, 2 when the machine cannot run it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: DeepEP README (H800): (dispatch, combine) figures
PUBLISHED = {
    "prefill": {"what": "normal, intranode EP8, 4096 tokens", "dispatch_GBps": 153.0, "combine_GBps": 158.0},
    "decode": {"what": "low-latency, EP8, 128 tokens/rank", "dispatch_us": 77.0, "combine_us": 114.0,
               "dispatch_GBps": 98.0, "combine_GBps": 127.0},
}  # fmt: skip


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dry-run", action="store_true", help="CPU over gloo, 2 ranks, tiny shapes: checks this script's own logic"
    )
    p.add_argument("--ranks", type=int, default=None, help="ranks (default: the visible GPUs, at most 8; --dry-run: 2)")
    p.add_argument(
        "--install", action="store_true", help="pip install -e core and the cuda, nccl and deepep plugins first"
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="write both runs' results and the comparison here")
    return p.parse_args()


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_bench(mode: str, args: argparse.Namespace, ranks: int, out: str) -> int:
    if args.dry_run:
        tokens, hidden, topk, experts = ("64" if mode == "prefill" else "16"), "256", "2", "8"
        common = ["--device", "auto"]
    else:
        tokens, hidden, topk, experts = ("4096" if mode == "prefill" else "128"), "7168", "8", "256"
        common = []
    # deepep sizes its buffers from the planned layout: the sweep's largest dispatch
    legacy = "deepep-legacy-" + ("normal" if mode == "prefill" else "lowlatency")
    specs = ["nccl", f"{legacy}:deepep@deepep_generation=legacy", "deepep-v2:deepep@deepep_generation=v2"]
    cmd = [sys.executable, "-m", "plinth.cli", "bench", "a2a", "--ranks", str(ranks), "--modes", mode,
           "--tokens", tokens, "--hidden", hidden, "--topk", topk, "--experts", experts,
           "--iters", str(args.iters), "--warmup", "3", "--save-result", out, *common]  # fmt: skip
    for s in specs:
        cmd += ["--a2a", s]
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


def compare(results: dict[str, dict]) -> list[str]:
    lines = ["", "ours beside DeepEP's published figures (H800; see the notes in --help):"]
    head = f"{'mode':<8} {'plugin':<28} {'layout':<6} {'dispatch':>18} {'combine':>18}"
    lines += [head, "-" * len(head)]
    for mode, res in results.items():
        pub = PUBLISHED[mode]
        if pub.get("dispatch_us"):
            d = f"{pub['dispatch_us']:.0f} us {pub['dispatch_GBps']:.0f} GB/s"
            c = f"{pub['combine_us']:.0f} us {pub['combine_GBps']:.0f} GB/s"
        else:
            d, c = f"{pub['dispatch_GBps']:.0f} GB/s", f"{pub['combine_GBps']:.0f} GB/s"
        lines.append(f"{mode:<8} {'DeepEP README (H800)':<28} {'':<6} {d:>18} {c:>18}  {pub['what']}")
        for label, p in res.get("plugins", {}).items():
            if p.get("skipped"):
                lines.append(f"{mode:<8} {label:<28} skipped: {'; '.join(p['skipped'])[:200]}")
            elif p.get("error"):
                lines.append(f"{mode:<8} {label:<28} FAILED (see above)")
            for r in p.get("rows", []):
                d = f"{r['dispatch_us']:.0f} us {r['dispatch_GBps']:.1f} GB/s"
                c = f"{r['combine_us']:.0f} us {r['combine_GBps']:.1f} GB/s"
                lines.append(
                    f"{mode:<8} {label:<28} {r['layout']:<6} {d:>18} {c:>18}" + ("" if r["ok"] else "  MISMATCH")
                )
    return lines


def main() -> int:
    args = parse()
    if args.install:
        pkgs = ["core", "plugins/accelerators/cuda", "plugins/a2a/nccl", "plugins/a2a/deepep"]
        editable = [x for p in pkgs for x in ("-e", os.path.join(ROOT, p))]
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *editable], check=True)
    if args.dry_run:
        ranks = args.ranks or 2
    else:
        found = gpu_count()
        ranks = args.ranks or min(found, 8)
        if found < 2 or ranks < 2 or ranks > found:
            print(
                f"needs 2-8 GPUs, one per rank (found {found}, asked for {ranks}); --dry-run runs the CPU path",
                file=sys.stderr,
            )
            return 2
    results, status = {}, 0
    with tempfile.TemporaryDirectory(prefix="plinth-a2a-") as tmp:
        for mode in ("prefill", "decode"):
            out = os.path.join(tmp, f"{mode}.json")
            rc = run_bench(mode, args, ranks, out)
            status = max(status, rc)
            if os.path.exists(out):
                with open(out) as f:
                    results[mode] = json.load(f)
    for line in compare(results):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": ranks, "published": PUBLISHED, "runs": results}, f, indent=2)
    return status


if __name__ == "__main__":
    sys.exit(main())
