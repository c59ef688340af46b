#!/usr/bin/env python
"""Issue 18, item 5: the sampler before and after batching, in one run.

    .venv/bin/python bench/sampler.py [--before 63b675c] [--vocab 49152] [--reps 30] [--threads 1]

"before" is ``core/src/plinth/engine/sampler.py`` at git revision
``--before`` (loaded from ``git show`` into a temporary module), "after" the
working tree's. Both sample the same logits with the same rows:

* batch 16: the six kinds below, cycled (greedy, temperature, top-p, top-k,
  penalties, seeded), every row with a 256-token prompt and 64 tokens of output;
* batch 1: each kind alone; the figure is the mean over the six.

Logits: ``zipf``, each row a Zipf(1.1) distribution over a shuffled
vocabulary plus N(0, 0.5) noise on the logits (the shape of a language
model's next-token distribution), and ``gauss``, N(0, 2) logits (flat: a
top-p cut needs a large part of the vocabulary). Clock: ``time.thread_time``
(CPU time of this thread, nearly blind to other processes on a shared
machine) at ``--threads`` torch threads; the median of ``--reps`` calls
after two warm-ups. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLER = "core/src/plinth/engine/sampler.py"


def load_revision(rev: str) -> Any:
    src = subprocess.run(["git", "show", f"{rev}:{SAMPLER}"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "sampler_before.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("sampler_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def kinds() -> list[tuple[str, Any, bool]]:
    from plinth.engine.sampling_params import SamplingParams as P

    return [
        ("greedy", P(temperature=0), False),
        ("temperature", P(temperature=0.8), False),
        ("top-p", P(temperature=0.7, top_p=0.9), False),
        ("top-k", P(temperature=1.0, top_k=50), False),
        ("penalties", P(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.3), False),
        ("seeded", P(temperature=0.9, top_p=0.95, seed=7), True),
    ]


def make_logits(shape: str, rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    if shape == "gauss":
        return torch.randn(rows, vocab, generator=gen) * 2
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = -1.1 * ranks.log()
    out = torch.empty(rows, vocab)
    for r in range(rows):
        out[r] = base[torch.randperm(vocab, generator=gen)] + torch.randn(vocab, generator=gen) * 0.5
    return out


def time_call(mod: Any, logits: torch.Tensor, specs: list[tuple[str, Any, bool]], reps: int, gen: torch.Generator) -> float:
    vocab = logits.shape[-1]
    hist = [(torch.randint(0, vocab, (256,), generator=gen).tolist(), torch.randint(0, vocab, (64,), generator=gen).tolist()) for _ in specs]

    def rows() -> list[Any]:
        out = []
        for (_, p, seeded), (prompt, output) in zip(specs, hist):
            gen_ = mod.make_generator(p.seed) if seeded else None
            out.append(mod.SampleRow(p, prompt if p.repetition_penalty != 1 else (), output if p.needs_penalties else (), gen_))
        return out

    sampler = mod.Sampler()
    times = []
    for i in range(reps + 2):
        r = rows()
        t0 = time.thread_time()
        sampler(logits, r)
        if i >= 2:
            times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="63b675c")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.join(ROOT, "core", "src"))
    from plinth.engine import sampler as after

    before = load_revision(args.before)
    ks = kinds()
    batch16 = [ks[i % len(ks)] for i in range(16)]
    print(f"vocab {args.vocab}, {args.threads} torch thread(s), median of {args.reps}, ms per sampler call (thread CPU time)\n")
    print("| logits | batch | before | after | speed-up |")
    print("|---|---|---|---|---|")
    for shape in ("zipf", "gauss"):
        gen = torch.Generator().manual_seed(0)
        logits16 = make_logits(shape, 16, args.vocab, gen)
        res = {}
        for name, mod in (("before", before), ("after", after)):
            one = [time_call(mod, logits16[j : j + 1], [k], args.reps, torch.Generator().manual_seed(j)) for j, k in enumerate(ks)]
            res[name] = (statistics.mean(one), time_call(mod, logits16, batch16, args.reps, torch.Generator().manual_seed(1)))
        for b, j in ((1, 0), (16, 1)):
            print(f"| {shape} | {b} | {res['before'][j]:.2f} | {res['after'][j]:.2f} | {res['before'][j] / res['after'][j]:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
