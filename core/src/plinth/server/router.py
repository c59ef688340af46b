"""`platform router`: one OpenAI/Anthropic-compatible front over N replicas, routing by prefix.

    platform serve MODEL --port 8001 --kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    platform serve MODEL --port 8002 --kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5558"}'
    platform router --model MODEL --replicas http://127.0.0.1:8001 http://127.0.0.1:8002 \\
        --kv-events tcp://127.0.0.1:5557 tcp://127.0.0.1:5558 --port 8000

Each request is scored per healthy replica the way llm-d's inference
scheduler scores pods, a weighted sum of (weights as flags, defaults 2/1/1 as
llm-d's precise-prefix-cache sample):

- prefix: the fraction of the request's full blocks that the replica holds,
  longest prefix first, known from the replica's own KV events (vLLM's
  format: any vLLM-compatible engine). Block keys are computed here from the
  token ids each ``BlockStored`` carries, chained over the parent's key, and
  from the request's tokens the same way, as llm-d's KV-cache indexer does:
  the engine's own hash never needs to be reproduced. The request's tokens
  are computed here (``PromptTokens``: the replicas' model's tokenizer,
  ``--model``, and the server's own parsing and chat template), or by a
  replica's ``/tokenize`` when the router cannot load that model; lost event
  batches are asked for again on the replica's replay socket;
- KV-cache use: ``1 - vllm:kv_cache_usage_perc`` from the replica's /metrics;
- queue: ``(max - q) / (max - min)`` over the replicas (1 when all equal),
  ``q`` the replica's waiting + running requests, or the requests in flight
  through this router when that is higher (fresher than the last scrape).

The best score wins, ties in turn. The request is passed through unchanged
and its answer streamed back as it arrives. A replica that cannot be reached
is marked down at once (the next-best replica gets the request), dropped from
scoring, its prefix index cleared, and polled until it is healthy again
(``plinth.server.replicas``, whose relay both fronts use). ``--policy round-robin | least-loaded`` turn
scoring off (for comparison). /health and /metrics are the router's own.
"""


import argparse
import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from plinth.engine.block_manager import hash_page
from plinth.server.proxy import ROUTES
from plinth.server.replicas import (
    Replica,
    ReplicaSet,
    forward_headers,
    open_stream,
    read_json_body,
    relay,
    upstream_failed,
)

if TYPE_CHECKING:
    import httpx
    import zmq
    from fastapi import FastAPI
    from starlette.requests import Request
    from starlette.responses import Response

    from plinth.plugins import PluginRegistry
    from plinth.server.protocol import JSONObject
    from plinth.tokenizer import Tokenizer

#: a decoded KV event batch, ``[ts, events, dp_rank]`` (msgpack: untyped until read)
EventBatch = list[object]

log = logging.getLogger("plinth.router")

POLICIES = ("prefix", "round-robin", "least-loaded")


class PrefixIndex:
    """Which block keys one replica holds, from its KV events."""

    def __init__(self) -> None:
        self.keys: Counter[int] = Counter()
        self.by_hash: dict[Hashable, int] = {}  # the engine's block hash -> our key
        self.block_size = 0
        self.lock = threading.Lock()
        self.last_seq = -1
        self.batches = 0

    def apply(self, batch: EventBatch) -> None:
        """One decoded batch ``[ts, events, dp_rank]``; events as maps (vLLM 0.32) or tagged arrays."""
        with self.lock:
            self.batches += 1
            events = batch[1] if len(batch) > 1 else []
            for ev in events if isinstance(events, list) else []:
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

    def _stored(self, hashes: list[object] | None, parent: object, tokens: list[int] | None, size: int | None) -> None:
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
        self.last_seq = -1  # a restarted replica numbers its batches from 0 again

    def matched(self, keys: list[int]) -> int:
        """How many of ``keys`` (a request's blocks, in order) it holds, as a prefix."""
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n


def _hashable(h: object) -> Hashable:
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h


def request_keys(tokens: list[int], block_size: int) -> list[int]:
    """The block keys of a request's tokens, chained as ``PrefixIndex`` chains a replica's."""
    keys, key = [], 0
    for i in range(len(tokens) // block_size):
        key = hash_page(key, tokens[i * block_size : (i + 1) * block_size])
        keys.append(key)
    return keys


class EventSubscriber:
    """A thread per replica: SUB on its KV-event endpoint, feeding its ``PrefixIndex``.

    Batches carry a sequence number; a gap (batches lost: a full queue or
    high-water mark, a slow joiner, the router started after the replica) is
    filled from the replica's replay socket when one is given, as vLLM's
    replay protocol defines it: a DEALER sends ``[b"", start_seq]`` and gets
    ``[b"", seq, payload]`` for every buffered batch from ``start_seq`` on,
    then ``seq == -1``. Without a replay socket the loss is only logged.
    With one, the subscriber also starts by replaying everything the replica
    still buffers, so a router started after its replicas knows their caches.
    ``drop`` (tests) discards the sequence numbers it is true for, as if lost.
    """

    REPLAY_TIMEOUT_MS = 2000

    def __init__(self, endpoint: str, index: PrefixIndex, replay: str | None = None, *, drop: Callable[[int], bool] | None = None) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay
        self.index = index
        self.drop = drop
        self.replayed = 0  # batches applied from the replay socket
        self.lost = 0  # batches neither received nor replayed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-sub {endpoint}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        replay = None
        if self.replay_endpoint:
            replay = ctx.socket(zmq.DEALER)
            replay.connect(self.replay_endpoint)
        decode = msgspec.msgpack.Decoder().decode
        try:
            if replay is not None:  # what the replica cached before this router started (or reconnected)
                self._fill_gap(replay, None, decode)
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                parts = sock.recv_multipart()
                if len(parts) != 3:
                    continue
                seq = int.from_bytes(parts[1], "big")
                if self.drop is not None and self.drop(seq):
                    continue
                ix = self.index
                if seq <= ix.last_seq:
                    if seq != 0:  # already applied from a replay
                        continue
                    log.warning("KV events from %s: sequence restarted (the replica restarted): its index starts over", self.endpoint)
                    ix.clear()
                if seq > ix.last_seq + 1:
                    self._fill_gap(replay, seq, decode)
                self._apply(seq, parts[2], decode)
        finally:
            sock.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _apply(self, seq: int, payload: bytes, decode: Callable[[bytes], EventBatch]) -> None:
        try:
            self.index.apply(decode(payload))
        except Exception as exc:  # noqa: BLE001 - a bad batch must not stop the subscriber
            log.warning("KV events from %s: undecodable batch %d: %s", self.endpoint, seq, exc)
        self.index.last_seq = seq

    def _fill_gap(self, replay: "zmq.Socket[bytes] | None", seq: int | None, decode: Callable[[bytes], EventBatch]) -> None:
        """Apply batches ``last_seq + 1 .. seq - 1`` (None: all) from the replay socket (those it still buffers)."""
        first = self.index.last_seq + 1
        if replay is not None:
            replay.send_multipart([b"", first.to_bytes(8, "big")])
            while replay.poll(self.REPLAY_TIMEOUT_MS):
                frames = replay.recv_multipart()
                if len(frames) != 3:
                    continue
                n = int.from_bytes(frames[1], "big", signed=True)
                if n == -1:
                    break
                if self.index.last_seq < n and (seq is None or n < seq):
                    self._apply(n, frames[2], decode)
                    self.replayed += 1
            else:
                log.warning("KV events from %s: the replay socket %s did not answer", self.endpoint, self.replay_endpoint)
        if seq is None:
            return
        missing = seq - 1 - self.index.last_seq
        if missing > 0:
            self.lost += missing
            log.warning(
                "KV events from %s: batches %d..%d lost%s", self.endpoint, seq - missing, seq - 1,
                "" if replay is not None else " (no replay endpoint to ask)",
            )  # fmt: skip

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


class PromptTokens:
    """A request's prompt token ids, computed here exactly as a replica
    computes them: its model's tokenizer (loaded once, by its model plugin)
    and the server's own request parsing and chat-template rendering, so the
    block keys match the replicas' KV events. None when the request has no
    single prompt to score by or is invalid (the replica answers the error)."""

    def __init__(self, tokenizer: "Tokenizer") -> None:
        self.tokenizer = tokenizer
        self.native_tool_calls = "tool_calls" in (getattr(tokenizer, "chat_template", None) or "")

    def __call__(self, path: str, body: "JSONObject") -> list[int] | None:
        from pydantic import ValidationError

        from plinth.errors import PlinthError
        from plinth.server.errors import APIError

        try:
            return self._tokens(path, body)
        except (APIError, ValidationError, PlinthError, ValueError, TypeError, KeyError):
            return None

    def _tokens(self, path: str, body: "JSONObject") -> list[int] | None:
        from plinth.server.anthropic_api import anthropic_messages, tool_plan
        from plinth.server.openai_api import chat_messages, chat_tool_plan
        from plinth.server.protocol import ChatCompletionRequest, CompletionRequest, MessagesRequest
        from plinth.server.serving import encode_text, render_chat
        from plinth.server.tools import template_tools

        if path == "/v1/completions":
            p = CompletionRequest.model_validate(body).prompt
            if isinstance(p, str):
                return encode_text(self.tokenizer, p)
            if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                return list(p)  # type: ignore[arg-type]
            return None  # a batch of prompts: nothing single to score by
        if path == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate(body)
            messages = chat_messages(chat.messages, native_tool_calls=self.native_tool_calls)
            plan, add_generation_prompt, template_kwargs = chat_tool_plan(chat), chat.add_generation_prompt, chat.chat_template_kwargs
        elif path == "/v1/messages":
            msg = MessagesRequest.model_validate(body)
            messages = anthropic_messages(msg.system, msg.messages, native_tool_calls=self.native_tool_calls)
            plan, add_generation_prompt, template_kwargs = tool_plan(msg), True, None
        else:
            return None
        tools = template_tools(plan.tools) if plan.tools else None
        _, ids = render_chat(self.tokenizer, messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs, tools=tools)
        return ids


def _tokenize_request(path: str, body: "JSONObject") -> "JSONObject | None":
    """The fallback: what to send to a replica's /tokenize for this request (None: nothing to score by)."""
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
                system = "".join(str(b.get("text", "")) for b in system if isinstance(b, dict))
            msgs = [{"role": "system", "content": system}, *msgs]
        return {"messages": [_text_message(m) for m in msgs if isinstance(m, dict)]}
    return None


def _text_message(m: "JSONObject") -> "JSONObject":
    content = m.get("content")
    if isinstance(content, list):  # content blocks: their text is what shapes the prefix
        content = "".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
    return {"role": m.get("role", "user"), "content": content if isinstance(content, str) else ""}


class RouterMetrics:
    """The router's own /metrics."""

    def __init__(self, replicas: ReplicaSet) -> None:
        from prometheus_client import CollectorRegistry, Gauge, Histogram
        from prometheus_client import Counter as PCounter

        self.registry = reg = CollectorRegistry()
        self.requests = PCounter("plinth_router:requests", "Requests routed, by replica and outcome.", ["replica", "outcome"], registry=reg)
        self.matched = PCounter("plinth_router:prefix_matched_blocks", "Blocks of routed requests the chosen replica held.", registry=reg)
        self.blocks = PCounter("plinth_router:prefix_request_blocks", "Full blocks of routed requests.", registry=reg)
        self.pick = Histogram("plinth_router:routing_seconds", "Time to choose a replica (tokenize + score).", registry=reg,
                              buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25))  # fmt: skip
        up = Gauge("plinth_router:replica_healthy", "1 while the replica answers /health.", ["replica"], registry=reg)
        inflight = Gauge("plinth_router:replica_inflight", "Requests in flight to the replica.", ["replica"], registry=reg)
        for r in replicas.replicas:
            up.labels(r.url).set_function(lambda r=r: 1.0 if r.healthy else 0.0)
            inflight.labels(r.url).set_function(lambda r=r: float(r.inflight))

    def outcome(self, up: Replica, outcome: str) -> None:
        self.requests.labels(up.url, outcome).inc()

    def page(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class Router:
    """What the routes share: the replicas, their prefix indexes and event
    subscribers, the scorer, the prompt tokenizer and one HTTP client."""

    def __init__(
        self,
        urls: list[str],
        events: list[str] | None,
        replay: list[str] | None,
        *,
        policy: str,
        weights: tuple[float, float, float],
        interval: float,
        timeout: float,
        tokenizer: "Tokenizer | None",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        for name, eps in (("--kv-events", events), ("--kv-events-replay", replay)):
            if eps and len(eps) != len(urls):
                raise ValueError(f"{name} needs one endpoint per replica ({len(urls)}), got {len(eps)}")
        if replay and not events:
            raise ValueError("--kv-events-replay needs --kv-events")
        self.policy = policy
        self.timeout = timeout
        self.replicas = ReplicaSet(urls, interval=interval, scrape_metrics=policy == "prefix")
        self.indexes = {r.url: PrefixIndex() for r in self.replicas.replicas}
        self.replicas.on_down.append(lambda r: self.indexes[r.url].clear())  # a replica that restarts comes back empty
        self.scorer = Scorer(self.replicas, self.indexes, prefix=weights[0], kv_cache=weights[1], queue=weights[2])
        self.metrics = RouterMetrics(self.replicas)
        self.prompt_tokens = PromptTokens(tokenizer) if tokenizer is not None else None
        if events and self.prompt_tokens is None:
            log.warning("prompts are tokenized by the replicas' /tokenize (one more round trip per request): the router has no tokenizer of their model (--model)")
        self.subscribers = [
            EventSubscriber(ep, self.indexes[r.url], (replay or [None] * len(urls))[i])
            for i, (r, ep) in enumerate(zip(self.replicas.replicas, events or []))
        ]
        self.scores_prefix = bool(events)
        self._client: "httpx.AsyncClient | None" = None
        self._poller: asyncio.Task[None] | None = None

    def client(self) -> "httpx.AsyncClient":
        import httpx

        if self._client is None:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=2.0), limits=limits)
        return self._client

    def ensure_polling(self) -> None:
        """The health/metrics poller, started on the first request or at start-up, whichever comes first."""
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self.replicas.run(self.client()))

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for s in self.subscribers:
            s.stop()
        if self._client is not None:
            await self._client.aclose()

    async def tokens(self, path: str, body: "JSONObject", headers: dict[str, str]) -> list[int] | None:
        """The request's prompt tokens: computed here, else by a replica's /tokenize."""
        import httpx

        if self.prompt_tokens is not None:
            return await asyncio.to_thread(self.prompt_tokens, path, body)  # off the loop: streams keep flowing
        doc = _tokenize_request(path, body)
        if doc is None:
            return None
        given = doc.get("tokens")
        if isinstance(given, list):
            return [t for t in given if isinstance(t, int)]
        try:
            resp = await self.client().post(self.replicas.round_robin().url + "/tokenize", json=doc, headers=headers, timeout=5.0)
            if resp.status_code == 200:
                return list(resp.json().get("tokens") or [])
        except (httpx.HTTPError, ValueError):
            pass
        return None  # routed without prefix affinity

    async def candidates(self, path: str, body: "JSONObject", headers: dict[str, str]) -> list[Replica]:
        """The replicas to try, best first."""
        if self.policy == "round-robin":
            first = self.replicas.round_robin()
        elif self.policy == "least-loaded":
            first = self.replicas.least_loaded()
        else:
            t0 = time.perf_counter()
            toks = await self.tokens(path, body, headers) if self.scores_prefix else None
            ranked = self.scorer.score(toks)
            self.metrics.pick.observe(time.perf_counter() - t0)
            bs = self.scorer.block_size()
            if toks and bs:
                self.metrics.blocks.inc(len(toks) // bs)
                self.metrics.matched.inc(ranked[0][2])
            return [r for _, r, _ in ranked]
        return [first] + [r for r in self.replicas.up() if r is not first]

    async def generate(self, request: "Request") -> "Response":
        """Every generation route: the best replica that can be reached gets the request, unchanged."""
        import httpx

        self.ensure_polling()
        path = request.url.path
        body = await read_json_body(request)
        if not isinstance(body, dict):
            return body
        headers = forward_headers(request.headers)
        last = "no replica"
        for up in await self.candidates(path, body, headers):
            try:
                r = await open_stream(self.client(), up, path, body, headers)
            except httpx.HTTPError as exc:  # nothing reached the client yet: the next replica gets it
                self.metrics.outcome(up, "unreachable")
                last = f"{up.url}: {type(exc).__name__}: {exc}"
                self.replicas.mark_down(up, last)
                continue
            return relay(up, r, self.replicas, self.metrics.outcome)
        return upstream_failed(path, f"no replica could take the request ({last})")

    async def models(self, request: "Request") -> "Response":
        import httpx
        from fastapi.responses import Response

        for up in self.replicas.up():
            try:
                r = await self.client().get(up.url + "/v1/models", headers=forward_headers(request.headers), timeout=5.0)
            except httpx.HTTPError as exc:
                self.replicas.mark_down(up, f"{type(exc).__name__}: {exc}")
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return upstream_failed(request.url.path, "no replica answers")

    def health(self) -> "tuple[JSONObject, int]":
        """ok when every replica is healthy, degraded (200) while one is, unavailable (503) when none is."""
        self.ensure_polling()
        n = sum(r.healthy for r in self.replicas.replicas)
        status = "ok" if n == len(self.replicas.replicas) else "degraded" if n else "unavailable"
        doc = {"status": status, "policy": self.policy, "tokenizer": "router" if self.prompt_tokens is not None else "replicas",
               "replicas": self.replicas.stats(),
               "prefix_index": {u: {"blocks": len(ix.keys), "batches": ix.batches, "last_seq": ix.last_seq} for u, ix in self.indexes.items()}}  # fmt: skip
        return doc, 200 if n else 503


def build_router_app(
    urls: list[str],
    events: list[str] | None = None,
    *,
    replay: list[str] | None = None,
    policy: str = "prefix",
    prefix_weight: float = 2.0,
    kv_cache_weight: float = 1.0,
    queue_weight: float = 1.0,
    interval: float = 1.0,
    timeout: float = 600.0,
    tokenizer: "Tokenizer | None" = None,
) -> "FastAPI":
    """The router's FastAPI app; ``tokenizer``: the replicas' model's (None: their /tokenize)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    router = Router(
        urls, events, replay, policy=policy, weights=(prefix_weight, kv_cache_weight, queue_weight), interval=interval,
        timeout=timeout, tokenizer=tokenizer,
    )  # fmt: skip
    app = FastAPI(title="plinth router", docs_url=None, redoc_url=None)
    app.state.router = router
    app.state.replicas = router.replicas
    app.state.indexes = router.indexes

    @app.on_event("startup")
    async def _start() -> None:
        router.ensure_polling()

    @app.on_event("shutdown")
    async def _close() -> None:
        await router.close()

    async def generate(request: Request) -> Response:
        return await router.generate(request)

    for route in ROUTES:
        app.add_api_route(route, generate, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/health")
    async def health() -> Response:
        doc, status = router.health()
        return JSONResponse(doc, status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.page(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def add_router_arguments(parser: argparse.ArgumentParser, registry: "PluginRegistry") -> None:
    parser.add_argument("--replicas", nargs="+", required=True, metavar="URL", help="the servers to route over (platform serve, or any OpenAI-compatible server)")
    parser.add_argument(
        "--kv-events", nargs="+", default=None, metavar="ENDPOINT",
        help="each replica's KV-event endpoint (its --kv-events-config endpoint, e.g. tcp://10.0.0.5:5557), in --replicas order",
    )  # fmt: skip
    parser.add_argument(
        "--kv-events-replay", nargs="+", default=None, metavar="ENDPOINT",
        help="each replica's replay endpoint (its --kv-events-config replay_endpoint), in --replicas order: lost event batches are asked for again",
    )  # fmt: skip
    parser.add_argument(
        "--model", default=None,
        help="the model the replicas serve (the path or name given to `platform serve`): its tokenizer and chat template are loaded here, "
        "so prompts are tokenized without a round trip (without it, or when it cannot load here: each replica's /tokenize)",
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


def router(args: argparse.Namespace, registry: "PluginRegistry") -> int:
    import uvicorn

    from plinth.errors import ConfigError
    from plinth.server.cli import _listen

    for name, eps in (("--kv-events", args.kv_events), ("--kv-events-replay", args.kv_events_replay)):
        if eps and len(eps) != len(args.replicas):
            raise ConfigError(f"{name} needs one endpoint per replica ({len(args.replicas)}), got {len(eps)}")
    if args.kv_events_replay and not args.kv_events:
        raise ConfigError("--kv-events-replay needs --kv-events")
    if args.kv_events:
        try:
            import msgspec  # noqa: F401
            import zmq  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"--kv-events needs pyzmq and msgspec (pip install 'plinth-core[kv-events]'): {exc}") from None
    tokenizer = None
    if args.model and args.kv_events and args.policy == "prefix":
        from plinth.engine.startup import load_tokenizer
        from plinth.errors import PlinthError

        try:
            tokenizer = load_tokenizer(args.model, registry)
            log.info("prompts are tokenized here with %s's tokenizer", args.model)
        except PlinthError as exc:
            log.warning("cannot load the tokenizer of %s here (%s): prompts are tokenized by the replicas' /tokenize", args.model, exc)
    sock = _listen(args.host, args.port)
    app = build_router_app(
        args.replicas, args.kv_events, replay=args.kv_events_replay, policy=args.policy, prefix_weight=args.prefix_weight,
        kv_cache_weight=args.kv_cache_weight, queue_weight=args.queue_weight, interval=args.poll_interval, timeout=args.timeout,
        tokenizer=tokenizer,
    )  # fmt: skip
    log.info("router at http://%s:%d (%s) over %s", args.host, sock.getsockname()[1], args.policy, " ".join(args.replicas))
    server = uvicorn.Server(uvicorn.Config(app, log_level=str(args.uvicorn_log_level).lower(), timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
