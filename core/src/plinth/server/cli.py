"""`platform serve` options and start-up; cheap to import (no FastAPI here)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any

from plinth.errors import ConfigError, PlinthError
from plinth.plugins import PluginRegistry

if TYPE_CHECKING:
    import uvicorn as uvicorn_types

    from plinth.engine.interfaces import EngineClient

log = logging.getLogger("plinth.server")

#: --role -> the KV connector's kv_role (vLLM's names)
ROLES = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}


def add_server_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument("--api-key", default=None, help="require this key: Bearer token, or x-api-key on /v1/messages (also $PLINTH_API_KEY)")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name(s) clients send; the first is reported (default: the model path, or the default model's name)",
    )
    g.add_argument("--enable-metrics", action=argparse.BooleanOptionalAction, default=True, help="serve Prometheus /metrics")
    g.add_argument(
        "--vllm-metric-names",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also serve the metrics llm-d and vLLM dashboards read under vLLM's names (vllm:num_requests_waiting, ...)",
    )
    g.add_argument(
        "--max-request-body-size", type=int, default=16 << 20, metavar="BYTES", help="larger request bodies get 413 (default: 16 MiB)"
    )
    g.add_argument(
        "--role",
        choices=tuple(ROLES),
        default=None,
        help="prefill/decode disaggregation behind `platform proxy`: prefill saves every prompt's KV through the "
        "--kv-connector and answers once it is stored; decode loads it (kv_role kv_producer / kv_consumer; "
        "default: both)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT: new requests get 503, running ones may finish for this long, then are aborted "
        "(their streams end with finish_reason abort); KV saves are flushed and the server exits 0. A second "
        "signal stops at once (default: 30)",
    )
    g.add_argument("--uvicorn-log-level", default="warning", help="uvicorn's log level (default: warning)")
    # the names are plugin registrations (`platform plugins`): checked at start-up, with every candidate's reasons
    g.add_argument(
        "--tool-call-parser",
        default="auto",
        metavar="NAME",
        help="how tool calls are read out of the output: a registered tool_parser (hermes, llama3_json, mistral, ...), "
        "auto (from the chat template) or none (default: auto)",
    )
    g.add_argument(
        "--reasoning-parser",
        default="auto",
        metavar="NAME",
        help="how reasoning is split from the answer: a registered reasoning_parser (qwen3, deepseek_r1), auto or none (default: auto)",
    )


def default_model_name(model: str | None) -> str:
    """What /v1/models reports when --served-model-name is not given: the
    model argument as given (as vLLM does), or the bundled default model's name."""
    if model:
        return model
    from plinth.engine.model_source import DEFAULT_MODEL_FILE

    stem = Path(DEFAULT_MODEL_FILE).stem  # SmolLM2-135M-Instruct.Q4_1
    return stem.split(".")[0]


def with_role(role: str, connector: str | None, config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The KV connector options with ``kv_role`` set from ``--role``."""
    cfg = dict(config or {})
    kv_role = ROLES[role]
    if role == "both" and not (connector or cfg.get("kv_connector")):
        return config
    if not (connector or cfg.get("kv_connector")):
        raise ConfigError(f"--role {role} needs a KV connector (--kv-connector or --kv-transfer-config) to hand the KV over")
    given = cfg.get("kv_role")
    if given and given != kv_role:
        raise ConfigError(f"--role {role} means kv_role {kv_role}, but the KV connector config says {given}")
    cfg["kv_role"] = kv_role
    return cfg


def _listen(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a busy port fails at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve --host {host!r}: {exc}") from None
    family, _, _, _, addr = infos[0]
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only
    # when it is, and without it every answer on a kept-alive connection waits
    # ~40 ms for the client's delayed ACK (Nagle)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def check_parsers(registry: PluginRegistry, tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """A parser named with --tool-call-parser / --reasoning-parser must load, or
    start-up fails here with every candidate's reasons, before the model loads
    (``auto`` needs the model's chat template: it is resolved when the app is built)."""
    from plinth.api import SelectionContext

    for category, name in (("tool_parser", tool_call_parser), ("reasoning_parser", reasoning_parser)):
        if name and name not in ("auto", "none"):
            registry.select(category, name, SelectionContext()).load()


def run_server(args: argparse.Namespace, registry: PluginRegistry, engine_kwargs: dict[str, Any]) -> int:
    import uvicorn

    from plinth.engine.async_engine import AsyncLLM
    from plinth.engine.config import EngineConfig
    from plinth.server.app import API_KEY_ENV, build_app
    from plinth.server.serving import ServerSettings

    if args.max_request_body_size < 1:
        raise ConfigError("--max-request-body-size must be >= 1")
    if not args.shutdown_timeout >= 0:
        raise ConfigError("--shutdown-timeout must be >= 0")
    kwargs = dict(engine_kwargs)
    if getattr(args, "role", None):
        kwargs["kv_connector_config"] = with_role(args.role, kwargs.get("kv_connector"), kwargs.get("kv_connector_config"))
    try:
        config = EngineConfig.from_kwargs(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"invalid engine options: {exc}") from None

    check_parsers(registry, args.tool_call_parser, args.reasoning_parser)
    sock = _listen(args.host, args.port)
    try:
        engine = AsyncLLM.from_config(config, registry)
    except PlinthError:
        sock.close()
        raise
    except Exception:
        sock.close()
        raise
    try:
        names = list(args.served_model_name or [default_model_name(config.load.model)])
        settings = ServerSettings(
            served_model_names=names,
            api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
            max_request_body_bytes=args.max_request_body_size,
            enable_metrics=args.enable_metrics,
            vllm_metric_names=args.vllm_metric_names,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            registry=registry,
        )
        app = build_app(engine, settings)
        host = f"[{args.host}]" if ":" in args.host else args.host
        port = sock.getsockname()[1]
        url = f"http://{host}:{port}"
        log.info(
            "serving %s at %s (OpenAI: %s/v1, Anthropic: %s/v1/messages%s)%s",
            names[0], url, url, url, f", metrics: {url}/metrics" if args.enable_metrics else "",
            "; API key required" if settings.api_key else "",
        )
        uconfig = uvicorn.Config(
            app,
            log_level=str(args.uvicorn_log_level).lower(),
            timeout_graceful_shutdown=5,
            loop="auto",  # uvloop and httptools (core's dependencies) where installed, else asyncio and h11
            http="auto",
            access_log=str(args.uvicorn_log_level).lower() in ("debug", "trace", "info"),
        )
        server = _server_class(uvicorn)(uconfig, engine=engine, shutdown_timeout=args.shutdown_timeout)
        server.run(sockets=[sock])
        if server.stopped_by:
            log.info("stopped by %s", ", ".join(signal.Signals(s).name for s in server.stopped_by))
    finally:
        engine.close()
        sock.close()
    return 0


def _server_class(uvicorn: ModuleType) -> Any:  # the class below: uvicorn is imported when serving starts
    """uvicorn's Server, except that the first SIGTERM or SIGINT drains the
    engine (``EngineClient.drain``: 503 with the reason for new requests,
    running ones finish up to the shutdown timeout, the rest are aborted with
    a clean end of stream) and only then stops uvicorn, with exit status 0. A
    second signal stops uvicorn at once, a third forces it."""

    class Server(uvicorn.Server):
        def __init__(self, config: uvicorn_types.Config, *, engine: EngineClient, shutdown_timeout: float) -> None:
            super().__init__(config)
            self.engine = engine
            self.shutdown_timeout = shutdown_timeout
            self.stopped_by: list[int] = []
            self.drainer: threading.Thread | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.stopped_by.append(sig)
            if self.drainer is None:
                log.info("%s: draining (up to %.0f s)", signal.Signals(sig).name, self.shutdown_timeout)
                self.drainer = threading.Thread(target=self._drain, name="plinth-drain", daemon=True)
                self.drainer.start()
            elif self.should_exit:
                self.force_exit = True
            else:
                self.should_exit = True

        def _drain(self) -> None:
            aborted = self.engine.drain(self.shutdown_timeout, "the server is shutting down")
            if aborted:
                log.warning("aborted %d request(s) still running after %.0f s", aborted, self.shutdown_timeout)
            self.should_exit = True

    return Server
