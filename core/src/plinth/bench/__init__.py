"""`platform bench`: benchmarks (never tests).

Each benchmark is a module here with ``add_arguments(parser)`` and
``run(args, registry) -> int``; its heavy imports live inside ``run`` so that
``platform --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util

from plinth.plugins import PluginRegistry

#: name -> (module, help)
BENCHMARKS = {
    "offline": ("plinth.bench.offline", "the engine offline vs transformers on the same weights"),
    "serve": ("plinth.bench.serve", "an OpenAI-compatible server over HTTP: throughput, TTFT, TPOT, ITL"),
    "a2a": ("plinth.bench.a2a", "MoE dispatch/combine of every a2a plugin on real ranks: latency and GB/s, both layouts"),
}


def add_bench_subcommands(parser: argparse.ArgumentParser, registry: PluginRegistry) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        if importlib.util.find_spec(module) is None:
            continue  # a benchmark not written yet
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p, registry)
        p.set_defaults(_bench=mod.run)
