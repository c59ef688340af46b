"""`platform generate`, `platform serve` and `platform bench`: the commands
that build an engine. Imported only when one of them runs (or for --help)."""

from __future__ import annotations

import argparse
import sys

from plinth.cli import add_engine_options, add_plugin_options, plugin_kwargs
from plinth.plugins import PluginRegistry


def _add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a Hugging Face model folder or a .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    )


def add_generate_arguments(parser: argparse.ArgumentParser, registry: PluginRegistry) -> None:
    _add_model(parser)
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_options(parser)
    add_plugin_options(parser, registry)


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
    with LLM(registry=registry, **plugin_kwargs(args)) as llm:  # close(): KV saves flushed, ranks stopped
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

    _add_model(parser)
    add_server_options(parser)
    add_engine_options(parser)
    add_plugin_options(parser, registry)


def serve(args: argparse.Namespace, registry: PluginRegistry) -> int:
    from plinth.server.cli import SERVER_OPTIONS, run_server

    kwargs = plugin_kwargs(args)
    if kwargs.get("node_rank"):  # a node other than 0 runs its worker ranks only (rank 0's node serves)
        from plinth.engine.config import EngineConfig
        from plinth.engine.worker import run_node

        options = {k: v for k, v in kwargs["plugin_options"].items() if k not in SERVER_OPTIONS}
        return run_node(EngineConfig(**{**kwargs, "plugin_options": options}))
    return run_server(args, registry, kwargs)


def add_bench_arguments(parser: argparse.ArgumentParser, registry: PluginRegistry) -> None:
    from plinth.bench import add_bench_subcommands

    add_bench_subcommands(parser, registry)


def bench(args: argparse.Namespace, registry: PluginRegistry) -> int:
    return int(args._bench(args, registry) or 0)
