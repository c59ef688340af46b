"""`platform bench`: benchmarks (never tests)."""

from __future__ import annotations

import argparse

from plinth.plugins import PluginRegistry


def add_bench_subcommands(parser: argparse.ArgumentParser, registry: PluginRegistry) -> None:
    parser.add_subparsers(dest="bench_command", metavar="BENCH")
