"""`platform router`: one OpenAI/Anthropic-compatible front over N replicas, routing by prefix.

    platform serve MODEL --port 8001 --kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    platform serve MODEL --port 8002 --kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5558"}'
    platform router --replicas http://127.0.0.1:8001 http://127.0.0.1:8002 \\
        --kv-events tcp://127.0.0.1:5557 tcp://127.0.0.1:5558 --port 8000

Each request is scored per healthy replica the way llm-d's inference
scheduler scores pods, a weighted sum of (weights as flags, defaults 2/1/1 as
llm-d's precise-prefix-cache sample):

- prefix: the fraction of the request's full blocks that the replica holds,
  longest prefix first, known from the replica's own KV events (vLLM's
  format: any vLLM-compatible engine). Block keys are computed here from the
  token ids each ``BlockStored`` carries, chained over the parent's key, and
  from the request's tokens (the replica's ``/tokenize``) the same way, as
  llm-d's KV-cache indexer does: the engine's own hash never needs to be
  reproduced;
- KV-cache use: ``1 - vllm:kv_cache_usage_perc`` from the replica's /metrics;
- queue: ``(max - q) / (max - min)`` over the replicas (1 when all equal),
  ``q`` the replica's waiting + running requests, or the requests in flight
  through this router when that is higher (fresher than the last scrape).

The best score wins, ties in turn. The request is passed through unchanged
and its answer streamed back as it arrives. A replica that cannot be reached
is marked down at once (the next-best replica gets the request), dropped from
scoring, its prefix index cleared, and polled until it is healthy again
(``plinth.server.replicas``). ``--policy round-robin | least-loaded`` turn
scoring off (for comparison). /health and /metrics are the router's own.
"""


import argparse
import asyncio
import logging
import threading
import time
from collections import Counter
from typing import Any, AsyncIterator

from plinth.engine.block_manager import hash_page
from plinth.server.proxy import _DROP, ROUTES
from plinth.server.replicas import Replica, ReplicaSet

log = logging.getLogger("plinth.router")

POLICIES = ("prefix", "round-robin", "least-loaded")


class PrefixIndex:
    """Which block keys one replica holds, from its KV events."""

    def __init__(self) -> None:
        self.keys: Counter[int] = Counter()
        self.by_hash: dict[Any, int] = {}  # the engine's block hash -> our key
        self.block_size = 0
        self.lock = threading.Lock()
        self.last_seq = -1
        self.batches = 0

    def apply(self, batch: Any) -> None:
        """One decoded batch ``[ts, events, dp_rank]``; events as maps (vLLM 0.32) or tagged arrays."""
        with self.lock:
            self.batches += 1
            for ev in batch[1]:
                if isinstance(ev, dict):
                    tag = ev.get("type")
                    hashes, parent, tokens, size = ev.get("block_hashes"), ev.get("parent_block_hash"), ev.get("token_ids"), ev.get("block_size")
                else:
                    tag = ev[0]
                    hashes = ev[1] if len(ev) > 1 else None
                    parent, tokens, size = (ev[2], ev[3], ev[4]) if tag == "BlockStored" else (None, None, None)
                if tag == "BlockStored":
                    self._stored(hashes, parent, tokens, size)
                elif tag == "BlockRemoved":
                    for h in hashes:
                        key = self.by_hash.pop(_hashable(h), None)
                        if key is not None:
                            self.keys[key] -= 1
                            if self.keys[key] <= 0:
                                del self.keys[key]
                elif tag == "AllBlocksCleared":
                    self.clear_locked()

    def _stored(self, hashes: list[Any] | None, parent: Any, tokens: list[int] | None, size: int | None) -> None:
        if hashes is None or tokens is None or size is None:  # a location-only update: no tokens to key pages by
            return
        self.block_size = size
        key = 0 if parent is None else self.by_hash.get(_hashable(parent))
        if key is None:  # its parent was never seen (events lost): its keys would be wrong
            return
        for i, h in enumerate(hashes):
            key = hash_page(key, tokens[i * size : (i + 1) * size])
            h = _hashable(h)
            if h not in self.by_hash:
                self.by_hash[h] = key
                self.keys[key] += 1

    def clear(self) -> None:
        with self.lock:
            self.clear_locked()

    def clear_locked(self) -> None:
        self.keys.clear()
        self.by_hash.clear()

    def matched(self, keys: list[int]) -> int:
        """How many of ``keys`` (a request's blocks, in order) it holds, as a prefix."""
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n


def _hashable(h: Any) -> Any:
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h


def request_keys(tokens: list[int], block_size: int) -> list[int]:
    """The block keys of a request's tokens, chained as ``PrefixIndex`` chains a replica's."""
    keys, key = [], 0
    for i in range(len(tokens) // block_size):
        key = hash_page(key, tokens[i * block_size : (i + 1) * block_size])
        keys.append(key)
    return keys


class EventSubscriber:
    """A thread per replica: SUB on its KV-event endpoint, feeding its ``PrefixIndex``."""

    def __init__(self, endpoint: str, index: PrefixIndex) -> None:
        self.endpoint = endpoint
        self.index = index
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-sub {endpoint}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq

        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        decode = msgspec.msgpack.Decoder().decode
        try:
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                parts = sock.recv_multipart()
                if len(parts) != 3:
                    continue
                seq = int.from_bytes(parts[1], "big")
                if self.index.last_seq >= 0 and seq != self.index.last_seq + 1:
                    log.warning("KV events from %s: batches %d..%d lost", self.endpoint, self.index.last_seq + 1, seq - 1)
                self.index.last_seq = seq
                try:
                    self.index.apply(decode(parts[2]))
                except Exception as exc:  # noqa: BLE001 - a bad batch must not stop the subscriber
                    log.warning("KV events from %s: undecodable batch %d: %s", self.endpoint, seq, exc)
        finally:
            sock.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


class Scorer:
    def __init__(self, replicas: ReplicaSet, indexes: dict[str, PrefixIndex], *, prefix: float, kv_cache: float, queue: float) -> None:
        self.replicas = replicas
        self.indexes = indexes
        self.w_prefix, self.w_kv, self.w_queue = prefix, kv_cache, queue

    def block_size(self) -> int:
        return next((ix.block_size for ix in self.indexes.values() if ix.block_size), 0)

    def score(self, tokens: list[int] | None) -> list[tuple[float, Replica, int]]:
        """(score, replica, matched blocks) for every healthy replica, best first."""
        pool = self.replicas.up()
        bs = self.block_size()
        keys = request_keys(tokens, bs) if tokens and bs else []
        queues = [max(r.waiting + r.running, float(r.inflight)) for r in pool]
        lo, hi = min(queues), max(queues)
        out = []
        for r, q in zip(pool, queues):
            ix = self.indexes.get(r.url)
            matched = ix.matched(keys) if ix is not None and keys else 0
            s_prefix = matched / len(keys) if keys else 0.0
            s_queue = 1.0 if hi == lo else (hi - q) / (hi - lo)
            s_kv = 1.0 - min(max(r.kv_usage, 0.0), 1.0)
            out.append((self.w_prefix * s_prefix + self.w_kv * s_kv + self.w_queue * s_queue, r, matched))
        best = max(s for s, _, _ in out)
        ties = [x for x in out if x[0] == best]
        first = ties[next(self.replicas._turn) % len(ties)]
        return [first] + sorted((x for x in out if x is not first), key=lambda x: -x[0])


def _prompt_of(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """What to send to a replica's /tokenize for this request (None: nothing to score by)."""
    if path == "/v1/completions":
        p = body.get("prompt")
        if isinstance(p, str):
            return {"prompt": p}
        if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            return {"tokens": p}
        return None
    if path in ("/v1/chat/completions", "/v1/messages"):
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return None
        if path == "/v1/messages" and body.get("system"):
            system = body["system"]
            if isinstance(system, list):
                system = "".join(b.get("text", "") for b in system if isinstance(b, dict))
            msgs = [{"role": "system", "content": system}, *msgs]
        return {"messages": [_text_message(m) for m in msgs if isinstance(m, dict)]}
    return None


def _text_message(m: dict[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, list):  # content blocks: their text is what shapes the prefix
        content = "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return {"role": m.get("role", "user"), "content": content if isinstance(content, str) else ""}


def build_router_app(
    urls: list[str],
    events: list[str] | None = None,
    *,
    policy: str = "prefix",
    prefix_weight: float = 2.0,
    kv_cache_weight: float = 1.0,
    queue_weight: float = 1.0,
    interval: float = 1.0,
    timeout: float = 600.0,
) -> Any:
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
    from prometheus_client import Counter as PCounter
    from starlette.background import BackgroundTask

    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
    if events and len(events) != len(urls):
        raise ValueError(f"--kv-events needs one endpoint per replica ({len(urls)}), got {len(events)}")
    replicas = ReplicaSet(urls, interval=interval, scrape_metrics=policy == "prefix")
    indexes = {r.url: PrefixIndex() for r in replicas.replicas}
    replicas.on_down.append(lambda r: indexes[r.url].clear())  # a replica that restarts comes back empty
    scorer = Scorer(replicas, indexes, prefix=prefix_weight, kv_cache=kv_cache_weight, queue=queue_weight)
    subscribers: list[EventSubscriber] = []
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    state: dict[str, Any] = {}

    reg = CollectorRegistry()
    m_requests = PCounter("plinth_router:requests", "Requests routed, by replica and outcome.", ["replica", "outcome"], registry=reg)
    m_matched = PCounter("plinth_router:prefix_matched_blocks", "Blocks of routed requests the chosen replica held.", registry=reg)
    m_blocks = PCounter("plinth_router:prefix_request_blocks", "Full blocks of routed requests.", registry=reg)
    m_pick = Histogram("plinth_router:routing_seconds", "Time to choose a replica (tokenize + score).", registry=reg,
                       buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25))  # fmt: skip
    m_up = Gauge("plinth_router:replica_healthy", "1 while the replica answers /health.", ["replica"], registry=reg)
    m_inflight = Gauge("plinth_router:replica_inflight", "Requests in flight to the replica.", ["replica"], registry=reg)
    for r in replicas.replicas:
        m_up.labels(r.url).set_function(lambda r=r: 1.0 if r.healthy else 0.0)
        m_inflight.labels(r.url).set_function(lambda r=r: float(r.inflight))

    def client() -> httpx.AsyncClient:
        if "client" not in state:
            state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=2.0), limits=limits)
        return state["client"]

    app = FastAPI(title="plinth router", docs_url=None, redoc_url=None)
    app.state.replicas = replicas
    app.state.indexes = indexes

    for url, ep in zip(urls, events or []):
        subscribers.append(EventSubscriber(ep, indexes[url.rstrip("/")]))

    def ensure_polling() -> None:
        """The health/metrics poller, started on the first request or at start-up, whichever comes first."""
        if "poller" not in state:
            state["poller"] = asyncio.get_running_loop().create_task(replicas.run(client()))

    @app.on_event("startup")
    async def _start() -> None:
        ensure_polling()

    @app.on_event("shutdown")
    async def _close() -> None:
        if "poller" in state:
            state["poller"].cancel()
        for s in subscribers:
            s.stop()
        if "client" in state:
            await state["client"].aclose()

    def forward_headers(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() not in _DROP}

    async def tokens_of(path: str, body: dict[str, Any], headers: dict[str, str]) -> list[int] | None:
        doc = _prompt_of(path, body)
        if doc is None:
            return None
        if "tokens" in doc:
            return doc["tokens"]
        r = replicas.round_robin()
        try:
            resp = await client().post(r.url + "/tokenize", json=doc, headers=headers, timeout=5.0)
            if resp.status_code == 200:
                return list(resp.json().get("tokens") or [])
        except (httpx.HTTPError, ValueError):
            pass
        return None  # routed without prefix affinity

    async def candidates(path: str, body: dict[str, Any], headers: dict[str, str]) -> list[Replica]:
        if policy == "round-robin":
            first = replicas.round_robin()
        elif policy == "least-loaded":
            first = replicas.least_loaded()
        else:
            t0 = time.perf_counter()
            toks = await tokens_of(path, body, headers) if events else None
            ranked = scorer.score(toks)
            m_pick.observe(time.perf_counter() - t0)
            bs = scorer.block_size()
            if toks and bs:
                m_blocks.inc(len(toks) // bs)
                m_matched.inc(ranked[0][2])
            return [r for _, r, _ in ranked]
        return [first] + [r for r in replicas.up() if r is not first]

    async def generate(request: Request) -> Response:
        ensure_polling()
        path = request.url.path
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the body is not valid JSON", "type": "invalid_request_error"}}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body must be a JSON object", "type": "invalid_request_error"}}, 400)
        headers = forward_headers(request)
        last = "no replica"
        for up in await candidates(path, body, headers):
            up.inflight += 1
            try:
                req = client().build_request("POST", up.url + path, json=body, headers=headers)
                r = await client().send(req, stream=True)
            except httpx.HTTPError as exc:  # nothing reached the client yet: the next replica gets it
                up.inflight -= 1
                up.failed += 1
                m_requests.labels(up.url, "unreachable").inc()
                last = f"{up.url}: {type(exc).__name__}: {exc}"
                replicas.mark_down(up, last)
                continue
            return _relay(up, r)
        return JSONResponse({"error": {"message": f"no replica could take the request ({last})", "type": "server_error"}}, 502)

    def _relay(up: Replica, r: Any) -> Response:
        closed: list[bool] = []

        async def close() -> None:  # once, from whichever of the two runs first
            if not closed:
                closed.append(True)
                up.inflight -= 1
                await r.aclose()

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
                up.served += 1
                m_requests.labels(up.url, "ok" if r.status_code < 400 else str(r.status_code)).inc()
            except httpx.HTTPError as exc:  # the replica died mid-answer: the client sees a cut stream
                up.failed += 1
                m_requests.labels(up.url, "cut").inc()
                replicas.mark_down(up, f"{type(exc).__name__} mid-answer")
            finally:
                await close()

        keep = {k: v for k, v in r.headers.items() if k.lower() not in _DROP and k.lower() != "content-encoding"}
        return StreamingResponse(relay(), status_code=r.status_code, headers=keep, background=BackgroundTask(close))

    for route in ROUTES:
        app.add_api_route(route, generate, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for up in replicas.up():
            try:
                r = await client().get(up.url + "/v1/models", headers=forward_headers(request), timeout=5.0)
            except httpx.HTTPError as exc:
                replicas.mark_down(up, f"{type(exc).__name__}: {exc}")
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return JSONResponse({"error": {"message": "no replica answers", "type": "server_error"}}, 502)

    @app.get("/health")
    async def health() -> Response:
        """ok when every replica is healthy, degraded (200) while one is, unavailable (503) when none is."""
        ensure_polling()
        n = sum(r.healthy for r in replicas.replicas)
        status = "ok" if n == len(replicas.replicas) else "degraded" if n else "unavailable"
        doc = {"status": status, "policy": policy, "replicas": replicas.stats(),
               "prefix_index": {u: {"blocks": len(ix.keys), "batches": ix.batches} for u, ix in indexes.items()}}  # fmt: skip
        return JSONResponse(doc, 200 if n else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(reg), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def add_router_arguments(parser: argparse.ArgumentParser, registry: Any) -> None:
    parser.add_argument("--replicas", nargs="+", required=True, metavar="URL", help="the servers to route over (platform serve, or any OpenAI-compatible server)")
    parser.add_argument(
        "--kv-events", nargs="+", default=None, metavar="ENDPOINT",
        help="each replica's KV-event endpoint (its --kv-events-config endpoint, e.g. tcp://10.0.0.5:5557), in --replicas order",
    )  # fmt: skip
    parser.add_argument("--policy", choices=POLICIES, default="prefix", help="prefix: llm-d's scoring (default); round-robin or least-loaded: for comparison")
    parser.add_argument("--prefix-weight", type=float, default=2.0, help="weight of the prefix-cache score (default 2)")
    parser.add_argument("--kv-cache-weight", type=float, default=1.0, help="weight of the free-KV-cache score (default 1)")
    parser.add_argument("--queue-weight", type=float, default=1.0, help="weight of the queue-depth score (default 1)")
    parser.add_argument("--poll-interval", type=float, default=1.0, metavar="S", help="seconds between health/metrics polls of each replica (default 1)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a replica may take to answer (default: 600)")
    parser.add_argument("--uvicorn-log-level", default="warning")


def router(args: argparse.Namespace, registry: Any) -> int:
    import uvicorn

    from plinth.errors import ConfigError
    from plinth.server.cli import _listen

    if args.kv_events and len(args.kv_events) != len(args.replicas):
        raise ConfigError(f"--kv-events needs one endpoint per replica ({len(args.replicas)}), got {len(args.kv_events)}")
    if args.kv_events:
        try:
            import msgspec  # noqa: F401
            import zmq  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"--kv-events needs pyzmq and msgspec (pip install 'plinth-core[kv-events]'): {exc}") from None
    sock = _listen(args.host, args.port)
    app = build_router_app(
        args.replicas, args.kv_events, policy=args.policy, prefix_weight=args.prefix_weight, kv_cache_weight=args.kv_cache_weight,
        queue_weight=args.queue_weight, interval=args.poll_interval, timeout=args.timeout,
    )  # fmt: skip
    log.info("router at http://%s:%d (%s) over %s", args.host, sock.getsockname()[1], args.policy, " ".join(args.replicas))
    server = uvicorn.Server(uvicorn.Config(app, log_level=str(args.uvicorn_log_level).lower(), timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
