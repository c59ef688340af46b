"""Replica tracking shared by `platform router` and `platform proxy`.

Each replica is polled every ``interval`` seconds: ``/health`` (a replica that
does not answer 200 within ``interval`` is down) and, when asked, ``/metrics``
for the vLLM-named gauges llm-d's scorers read (``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``). A request that
cannot reach a replica marks it down at once; a down replica keeps being
polled and comes back with its first healthy answer. Requests in flight
through this front are counted here, fresher than any scrape: a request
counts from ``open_stream`` until ``relay`` has passed its answer on (or the
client left), one piece of code for both fronts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse

    from plinth.server.protocol import JSONObject

log = logging.getLogger("plinth.replicas")

#: hop-by-hop headers (RFC 9110) and those httpx sets itself: never forwarded
HOP_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "accept-encoding"})

#: the gauges read from a replica's /metrics (vLLM's names: any vLLM-compatible server)
SCRAPED = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running", "vllm:kv_cache_usage_perc": "kv_usage"}


@dataclass
class Replica:
    url: str
    inflight: int = 0
    served: int = 0
    failed: int = 0
    healthy: bool = True
    #: from its /metrics, when scraped
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    scraped_at: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def parse_gauges(text: str) -> dict[str, float]:
    """The ``SCRAPED`` gauges of a Prometheus text page, summed over label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = SCRAPED.get(name)
        if key is None:
            continue
        try:
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return out


class ReplicaSet:
    def __init__(self, urls: list[str], *, interval: float = 1.0, scrape_metrics: bool = False) -> None:
        if not urls:
            raise ValueError("at least one URL is needed")
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.interval = interval
        self.scrape_metrics = scrape_metrics
        self._turn = itertools.count()
        #: called with a replica that went down (its prefix index is stale then)
        self.on_down: list[Callable[[Replica], None]] = []

    def up(self) -> list[Replica]:
        """The healthy replicas; all of them when none is (a guess beats a refusal)."""
        live = [r for r in self.replicas if r.healthy]
        return live or list(self.replicas)

    def least_loaded(self, among: list[Replica] | None = None) -> Replica:
        """Fewest requests in flight here, ties in turn."""
        pool = among if among is not None else self.up()
        least = min(r.inflight for r in pool)
        ties = [r for r in pool if r.inflight == least]
        return ties[next(self._turn) % len(ties)]

    def round_robin(self) -> Replica:
        pool = self.up()
        return pool[next(self._turn) % len(pool)]

    def mark_down(self, r: Replica, why: str) -> None:
        if r.healthy:
            log.warning("replica %s is down: %s", r.url, why)
            r.healthy = False
            for cb in self.on_down:
                cb(r)

    async def poll_once(self, client: httpx.AsyncClient) -> None:
        async def one(r: Replica) -> None:
            try:
                h = await client.get(r.url + "/health", timeout=self.interval)
                ok = h.status_code == 200
                if ok and self.scrape_metrics:
                    m = await client.get(r.url + "/metrics", timeout=self.interval)
                    g = parse_gauges(m.text)
                    r.waiting, r.running, r.kv_usage = g.get("waiting", 0.0), g.get("running", 0.0), g.get("kv_usage", 0.0)
                    r.scraped_at = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - any failure to answer is "down"
                self.mark_down(r, f"{type(exc).__name__}: {exc}")
                return
            if not ok:
                self.mark_down(r, f"/health answered {h.status_code}")
            elif not r.healthy:
                log.warning("replica %s is back", r.url)
                r.healthy = True

        await asyncio.gather(*(one(r) for r in self.replicas))

    async def run(self, client: httpx.AsyncClient) -> None:
        """Poll every replica until cancelled."""
        while True:
            started = time.monotonic()
            await self.poll_once(client)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    def stats(self) -> dict[str, dict[str, float]]:
        return {
            r.url: {"healthy": r.healthy, "inflight": r.inflight, "served": r.served, "failed": r.failed,
                    "waiting": r.waiting, "running": r.running, "kv_usage": r.kv_usage}  # fmt: skip
            for r in self.replicas
        }


def forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """A client's request headers as passed on to a replica."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}


async def read_json_body(request: Request) -> JSONObject | JSONResponse:
    """The request's JSON object, or the 400 answer to give when its body is
    not JSON or not an object: what both fronts check
    before they choose a replica. The answer has the server's own error body
    for the route (``plinth.server.errors``: Anthropic's on /v1/messages,
    else OpenAI's)."""
    from plinth.server.errors import APIError, error_response

    try:
        body = await request.json()
    except ValueError:
        problem = "the body is not valid JSON"
    else:
        if isinstance(body, dict):
            return body
        problem = "the body must be a JSON object"
    return error_response(request.url.path, APIError.bad_request(problem))


def upstream_failed(path: str, message: str) -> JSONResponse:
    """A front's 502 when no instance could take the request (unreachable,
    or none up), with the server's error body for the route."""
    from plinth.server.errors import APIError, error_response

    return error_response(path, APIError(502, message, code="upstream_unavailable"))


async def open_stream(client: httpx.AsyncClient, up: Replica, path: str, body: JSONObject, headers: dict[str, str]) -> httpx.Response:
    """POST ``body`` to ``up`` and return its response once the headers are in
    (the body still to stream). The request counts in ``up.inflight`` from here
    until ``relay`` ends; on failure it no longer counts and ``up.failed`` grows."""
    up.inflight += 1
    try:
        return await client.send(client.build_request("POST", up.url + path, json=body, headers=headers), stream=True)
    except BaseException:
        up.inflight -= 1
        up.failed += 1
        raise


def relay(
    up: Replica, r: httpx.Response, replicas: ReplicaSet, outcome: Callable[[Replica, str], None] | None = None
) -> StreamingResponse:
    """A response that streams ``r`` (from ``open_stream``) to the client as it
    arrives, unchanged. When it ends, or the client leaves, the request stops
    counting in ``up.inflight``; a replica that dies mid-answer is marked down
    (the client sees a cut stream). ``outcome(up, "ok" | "cut" | status)`` once
    the body has been passed on or cut."""
    import httpx
    from starlette.background import BackgroundTask
    from starlette.responses import StreamingResponse

    closed: list[bool] = []

    async def close() -> None:  # once, from whichever of the two runs first
        if not closed:
            closed.append(True)
            up.inflight -= 1
            await r.aclose()

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in r.aiter_raw():
                yield chunk
            up.served += 1
            if outcome is not None:
                outcome(up, "ok" if r.status_code < 400 else str(r.status_code))
        except httpx.HTTPError as exc:
            up.failed += 1
            if outcome is not None:
                outcome(up, "cut")
            replicas.mark_down(up, f"{type(exc).__name__} mid-answer")
        finally:
            await close()

    keep = {k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS and k.lower() != "content-encoding"}
    return StreamingResponse(body(), status_code=r.status_code, headers=keep, background=BackgroundTask(close))
