"""`platform proxy`: prefill/decode disaggregation in front of plinth servers.

    platform serve MODEL --role prefill --kv-connector local --kv-connector-config '{"disk_dir": "/shared/kv"}' --port 8100
    platform serve MODEL --role decode  --kv-connector local --kv-connector-config '{"disk_dir": "/shared/kv"}' --port 8200
    platform proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each generation request (``/v1/completions``, ``/v1/chat/completions``,
``/v1/messages``, ``/v1/responses``) goes first to a prefill instance with
one output token, no streaming and n=1: that instance computes the prompt's
KV, saves its full pages through the KV connector and answers once they are
stored. The request then goes, unchanged, to a decode instance, which finds
those pages through the connector (they count as external cached tokens) and
computes only the rest; its answer, streamed or not, is passed to the client
as it arrives. Instances of each kind are chosen least-loaded (requests in
flight through this proxy), ties in turn, among the healthy ones: replica
tracking (health polls, a failed call marking an instance down until it
answers again) is ``plinth.server.replicas``, shared with `platform router`.

A prefill instance that fails or cannot be reached costs only time: the
decode instance then computes the prompt itself (same output). A client
error (4xx) from the prefill instance is the client's answer.
"""


import argparse
import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from plinth.plugins import PluginRegistry
    from plinth.server.protocol import JSONObject

from plinth.server.replicas import (
    Replica,
    ReplicaSet,
    forward_headers,
    open_stream,
    read_json_body,
    relay,
    upstream_failed,
)

log = logging.getLogger("plinth.proxy")

#: route -> the body fields that cap its output length
ROUTES = {
    "/v1/completions": ("max_tokens",),
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/messages": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
}


def prefill_body(path: str, body: "JSONObject") -> "JSONObject":
    """The request a prefill instance gets: one output token, whole, n=1."""
    out = dict(body)
    for field in ROUTES[path]:
        out.pop(field, None)
    out[ROUTES[path][0]] = 1
    out["stream"] = False
    for field in ("stream_options", "best_of", "min_tokens"):
        out.pop(field, None)
    if "n" in out:
        out["n"] = 1
    return out


def build_proxy_app(prefill: list[str], decode: list[str], *, timeout: float = 600.0) -> "FastAPI":
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    pre, dec = ReplicaSet(prefill), ReplicaSet(decode)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    clients: "list[httpx.AsyncClient]" = []  # made on first use, in the server's loop
    pollers: list[asyncio.Task[None]] = []

    def client() -> "httpx.AsyncClient":
        if not clients:
            clients.append(httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0), limits=limits))
        return clients[0]

    app = FastAPI(title="plinth proxy", docs_url=None, redoc_url=None)

    def ensure_polling() -> None:
        """The instances' health pollers, started on the first request or at start-up."""
        if not pollers:
            loop = asyncio.get_running_loop()
            pollers.extend(loop.create_task(s.run(client())) for s in (pre, dec))

    @app.on_event("startup")
    async def _start() -> None:
        ensure_polling()

    @app.on_event("shutdown")
    async def _close() -> None:
        for task in pollers:
            task.cancel()
        for c in clients:
            await c.aclose()

    async def run_prefill(path: str, body: "JSONObject", headers: dict[str, str]) -> "Response | None":
        """None when the prefill went through (or failed on its side); a response for a client error."""
        up = pre.least_loaded()
        up.inflight += 1
        try:
            r = await client().post(up.url + path, json=prefill_body(path, body), headers=headers)
        except httpx.HTTPError as exc:
            up.failed += 1
            if isinstance(exc, httpx.TransportError):
                pre.mark_down(up, f"{type(exc).__name__}: {exc}")
            log.warning("prefill %s failed (%s: %s); the decode instance computes the prompt", up.url, type(exc).__name__, exc)
            return None
        finally:
            up.inflight -= 1
        if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        if r.status_code >= 300:
            up.failed += 1
            log.warning("prefill %s answered %d; the decode instance computes the prompt", up.url, r.status_code)
            return None
        up.served += 1
        return None

    async def generate(request: Request) -> Response:
        ensure_polling()
        path = request.url.path
        body = await read_json_body(request)
        if not isinstance(body, dict):
            return body
        headers = forward_headers(request.headers)
        early = await run_prefill(path, body, headers)
        if early is not None:
            return early
        up = dec.least_loaded()
        try:
            r = await open_stream(client(), up, path, body, headers)
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.TransportError):
                dec.mark_down(up, f"{type(exc).__name__}: {exc}")
            return upstream_failed(path, f"decode instance {up.url} failed: {type(exc).__name__}: {exc}")
        return relay(up, r, dec)

    for route in ROUTES:
        app.add_api_route(route, generate, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        up = dec.least_loaded()
        r = await client().get(up.url + "/v1/models", headers=forward_headers(request.headers))
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        """ok when every instance says ok; degraded (200) when one is
        degraded or unreachable but each kind has one that answers."""

        async def one(u: Replica) -> "JSONObject":
            try:
                r = await client().get(u.url + "/health", timeout=2.0)
                doc = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                return {"url": u.url, "http": r.status_code, **doc}
            except (httpx.HTTPError, ValueError) as exc:
                return {"url": u.url, "status": f"unreachable: {type(exc).__name__}"}

        p, d = await asyncio.gather(
            asyncio.gather(*(one(u) for u in pre.replicas)), asyncio.gather(*(one(u) for u in dec.replicas))
        )
        ok = all(x.get("status") == "ok" for x in [*p, *d])
        up = any(x.get("http") == 200 for x in d)
        status = "ok" if ok else "degraded" if up else "unavailable"
        stats = {u.url: {"inflight": u.inflight, "served": u.served, "failed": u.failed} for u in [*pre.replicas, *dec.replicas]}
        return JSONResponse({"status": status, "prefill": list(p), "decode": list(d), "stats": stats}, 200 if up else 503)

    return app


def add_proxy_arguments(parser: argparse.ArgumentParser, registry: "PluginRegistry") -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances (platform serve --role prefill)")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (platform serve --role decode)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds an instance may take to answer (default: 600)")
    parser.add_argument("--uvicorn-log-level", default="warning")


def proxy(args: argparse.Namespace, registry: "PluginRegistry") -> int:
    import uvicorn

    from plinth.server.cli import _listen

    sock = _listen(args.host, args.port)
    app = build_proxy_app(args.prefill, args.decode, timeout=args.timeout)
    log.info(
        "proxy at http://%s:%d: prefill %s, decode %s", args.host, sock.getsockname()[1], " ".join(args.prefill), " ".join(args.decode)
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level=str(args.uvicorn_log_level).lower(), timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
