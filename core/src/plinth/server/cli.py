"""`platform serve` options and start-up; cheap to import (no FastAPI here)."""

from __future__ import annotations

import argparse
from typing import Any

from plinth.plugins import PluginRegistry


def add_server_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require this bearer key (also $PLINTH_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: from the path)")
    g.add_argument("--enable-metrics", action=argparse.BooleanOptionalAction, default=True, help="serve /metrics")


def run_server(args: argparse.Namespace, registry: PluginRegistry, engine_kwargs: dict[str, Any]) -> int:
    raise NotImplementedError("the server lands with issue 4")
