"""`platform generate`, `platform serve` and `platform bench`: the commands
that build an engine. Imported only when one of them runs (or for --help)."""

from __future__ import annotations

import argparse
import sys

from plinth.cli import add_config_arguments, add_model_argument, engine_kwargs
from plinth.plugins import PluginRegistry


def add_generate_arguments(parser: argparse.ArgumentParser, registry: PluginRegistry) -> None:
    add_model_argument(parser)
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    add_config_arguments(parser, registry, command="generate")


def generate(args: argparse.Namespace, registry: PluginRegistry) -> int:
    from plinth.engine.llm import LLM
    from plinth.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
    )
    with LLM(registry=registry, **engine_kwargs(args)) as llm:  # close(): KV saves flushed, ranks stopped
        if args.chat:
            outputs = [llm.chat([{"role": "user", "content": p}], params)[0] for p in args.prompt]
        else:
            outputs = llm.generate(args.prompt, params)
    for out in outputs:
        sys.stdout.write(out.prompt + out.outputs[0].text + "\n" if not args.chat else out.outputs[0].text + "\n")
    sys.stdout.flush()
    return 0


def add_serve_arguments(parser: argparse.ArgumentParser, registry: PluginRegistry) -> None:
    from plinth.server.cli import add_server_options

    add_model_argument(parser)
    add_server_options(parser)
    add_config_arguments(parser, registry, command="serve")


def serve(args: argparse.Namespace, registry: PluginRegistry) -> int:
    from plinth.server.cli import run_server

    kwargs = engine_kwargs(args)
    if kwargs.get("node_rank"):  # a node other than 0 runs its worker ranks only (rank 0's node serves)
        from plinth.engine.config import EngineConfig
        from plinth.engine.worker import run_node

        return run_node(EngineConfig.from_kwargs(**kwargs))
    return run_server(args, registry, kwargs)


def add_bench_arguments(parser: argparse.ArgumentParser, registry: PluginRegistry) -> None:
    from plinth.bench import add_bench_subcommands

    add_bench_subcommands(parser, registry)


def bench(args: argparse.Namespace, registry: PluginRegistry) -> int:
    return int(args._bench(args, registry) or 0)
