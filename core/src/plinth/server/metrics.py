"""Prometheus metrics at ``/metrics``, in a registry of the app's own.

Names follow vLLM's with the ``plinth:`` prefix; with ``vllm_names`` (the
default) the ones llm-d's scorers and vLLM dashboards read are also served
under vLLM's own names (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:time_to_first_token_seconds``, ...: ``vllm/v1/metrics/loggers.py``'s
``PrometheusStatLogger``), same types, labelled as vLLM labels them
(``model_name`` and ``engine``, the engine index). Request latencies are
measured by the server as the client would see them: from the moment the
request reached its route (after parsing) to the first output token (TTFT),
between successive tokens (ITL), per output token after the first (TPOT)
and to the end of the request (end-to-end). Gauges of the engine (running
and waiting requests, KV page usage, prefix-cache hit rate) are read from
``engine.stats()`` at each scrape.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

#: what the engine collector makes at scrape time
Family = CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily

if TYPE_CHECKING:
    from plinth.engine.interfaces import EngineClient
    from plinth.engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


#: plinth's engine metrics that vLLM serves too, under the same name after the prefix
_VLLM_ENGINE = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries", "prefix_cache_hits",
    "num_preemptions", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
})  # fmt: skip
#: vLLM's name where it differs from plinth's
_VLLM_RENAMED = {"time_per_output_token_seconds": "request_time_per_output_token_seconds"}


class _Both:
    """One bound metric child observed under plinth's name and vLLM's."""

    __slots__ = ("a", "b")

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b

    def inc(self, v: float = 1.0) -> None:
        self.a.inc(v)
        self.b.inc(v)

    def observe(self, v: float) -> None:
        self.a.observe(v)
        self.b.observe(v)


class _EngineCollector(Collector):
    """Engine gauges and counters, read at scrape time."""

    def __init__(self, engine: EngineClient, model_name: str, vllm_names: bool = False) -> None:
        self.engine = engine
        self.model_name = model_name
        self.vllm_names = vllm_names

    def collect(self) -> Iterable[Metric]:
        for family in self._collect():
            yield family
            short = family.name.removeprefix("plinth:")
            if self.vllm_names and short in _VLLM_ENGINE:
                yield _as_vllm(family, "vllm:" + short)

    def _collect(self) -> Iterable[Family]:
        try:
            s = self.engine.stats()
        except Exception:  # an engine that is shutting down still lets /metrics answer
            return
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, float(v))
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, float(v))
            return c

        yield gauge("plinth:num_requests_running", "Requests running in the engine.", s.get("running", 0))
        yield gauge("plinth:num_requests_waiting", "Requests waiting to be scheduled.", s.get("waiting", 0))
        yield gauge("plinth:kv_cache_usage_perc", "Fraction of KV-cache pages in use (0-1).", s.get("kv_usage", 0.0))
        yield gauge("plinth:kv_cache_num_pages", "KV-cache pages in the pool.", s.get("num_pages", 0))
        yield gauge("plinth:kv_cache_free_pages", "KV-cache pages free to allocate (cached ones included).", s.get("free_pages", 0))
        yield gauge("plinth:prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens, since start.", s.get("prefix_cache_hit_rate", 0.0))
        yield counter("plinth:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.get("prefix_cache_queries", 0))
        yield counter("plinth:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.get("prefix_cache_hits", 0))
        yield counter("plinth:num_preemptions", "Sequences preempted for lack of KV pages.", s.get("preemptions", 0))
        yield counter("plinth:engine_steps", "Engine steps run.", s.get("steps", 0))
        if "spec_proposed_tokens" in s:  # speculative decoding is on
            yield counter("plinth:spec_decode_num_drafts", "Sequence-steps that scored proposals.", s["spec_verified_steps"])
            yield counter("plinth:spec_decode_num_draft_tokens", "Tokens proposed.", s["spec_proposed_tokens"])
            yield counter("plinth:spec_decode_num_accepted_tokens", "Proposed tokens the target accepted.", s["spec_accepted_tokens"])
            yield counter("plinth:spec_decode_num_rejected_tokens", "Proposed tokens the target rejected.", s["spec_rejected_tokens"])
            yield gauge("plinth:spec_decode_acceptance_rate", "Accepted / proposed tokens, since start.", s["spec_acceptance_rate"])
            yield gauge(
                "plinth:spec_decode_mean_accepted_length",
                "Tokens a step with proposals appends per sequence (accepted + the target's own).",
                s["spec_mean_accepted_length"],
            )
            g = GaugeMetricFamily(
                "plinth:spec_decode_acceptance_rate_per_position",
                "Acceptance rate of the i-th proposal (when it was scored).",
                labels=[*labels, "position"],
            )
            for i, rate in enumerate(s["spec_acceptance_rate_per_position"]):
                g.add_metric([*value, str(i)], float(rate))
            yield g
        if "prefix_cache_local_hit_tokens" in s:
            yield counter(
                "plinth:prefix_cache_local_hit_tokens", "Prompt tokens served from this engine's prefix cache.",
                s["prefix_cache_local_hit_tokens"],
            )
            yield counter(
                "plinth:prefix_cache_external_hit_tokens", "Prompt tokens loaded through the KV connector.",
                s.get("prefix_cache_external_hit_tokens", 0),
            )
        if "kv_connector_lookups" in s:
            yield from self._kv_connector(s, gauge, counter)

    def _kv_connector(self, s: dict[str, Any], gauge: Any, counter: Any) -> Iterable[Any]:
        """The KV connector's counters (``KVTransfer.stats()``)."""
        labels, value = ["model_name"], [self.model_name]
        for key, doc in (
            ("lookups", "Store lookups started."),
            ("lookup_pages", "Pages asked of the store."),
            ("hit_pages", "Pages the store held and that loaded intact."),
            ("loaded_pages", "Pages written into the KV cache from the store."),
            ("loaded_bytes", "KV bytes loaded from the store."),
            ("saved_pages", "Pages saved to the store."),
            ("saved_bytes", "KV bytes saved to the store."),
            ("recomputed_tokens", "Tokens the store held but that were recomputed after a failed load."),
            ("skipped_open", "Store calls skipped while the circuit was open."),
        ):
            yield counter(f"plinth:kv_connector_{key}", doc, s.get(f"kv_connector_{key}", 0))
        asked = s.get("kv_connector_lookup_pages", 0)
        yield gauge(
            "plinth:kv_connector_hit_rate", "Pages found in the store / pages asked, since start.",
            s.get("kv_connector_hit_pages", 0) / asked if asked else 0.0,
        )
        fails = CounterMetricFamily(
            "plinth:kv_connector_failures", "KV connector failures by kind.", labels=labels + ["kind"]
        )
        for kind, n in sorted((s.get("kv_connector_failures") or {}).items()):
            fails.add_metric(value + [kind], float(n))
        yield fails
        state = GaugeMetricFamily(
            "plinth:kv_connector_breaker_state", "Circuit-breaker state (1 for the current one).", labels=labels + ["state"]
        )
        for st in ("closed", "open", "half_open"):
            state.add_metric(value + [st], 1.0 if s.get("kv_connector_breaker_state") == st else 0.0)
        yield state
        yield counter("plinth:kv_connector_breaker_opened", "Times the circuit opened.", s.get("kv_connector_breaker_opened", 0))
        yield gauge("plinth:kv_connector_healthy", "1 when the store answers and the circuit is closed.", 1.0 if s.get("kv_connector_healthy") else 0.0)
        docs = {
            "load": "Store lookup+load time per fetch.",
            "save": "Store save time per save job.",
            "wait": "Time a request's admission waited on the store (answered, failed or past the deadline).",
        }
        for kind, doc in docs.items():
            snap = s.get(f"kv_connector_{kind}_latency")
            if not snap:
                continue
            h = HistogramMetricFamily(f"plinth:kv_connector_{kind}_latency_seconds", doc, labels=labels)
            buckets = [(repr(float(b)), float(c)) for b, c in zip(snap["buckets"], snap["cumulative"])]
            buckets.append(("+Inf", float(snap["cumulative"][-1])))
            h.add_metric(value, buckets, float(snap["sum"]))
            yield h


def _as_vllm(family: Family, name: str) -> Family:
    """A copy of a scrape-time family under vLLM's name, with vLLM's ``engine`` label."""
    copy = type(family)(name, family.documentation, labels=[])
    for sample in family.samples:
        copy.samples.append(sample._replace(name=name + sample.name[len(family.name):], labels={**sample.labels, "engine": "0"}))
    return copy


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str, *, vllm_names: bool = True) -> None:
        self.model_name = model_name
        self.vllm_names = vllm_names
        self.registry = CollectorRegistry()
        r = self.registry
        ml = ["model_name"]
        self.http_requests = Counter(
            "plinth:http_requests", "HTTP requests by route and status code.", ["method", "route", "status"], registry=r
        )
        self.request_success = Counter(
            "plinth:request_success", "Finished generation requests by finish reason.", ml + ["finished_reason"], registry=r
        )
        self.prompt_tokens = Counter("plinth:prompt_tokens", "Prompt tokens processed.", ml, registry=r)
        self.generation_tokens = Counter("plinth:generation_tokens", "Tokens generated.", ml, registry=r)
        self.ttft = Histogram(
            "plinth:time_to_first_token_seconds", "Time to the first output token.", ml, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "plinth:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            ml,
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "plinth:inter_token_latency_seconds", "Time between successive output tokens.", ml, buckets=_TOKEN_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "plinth:e2e_request_latency_seconds", "End-to-end request latency.", ml, buckets=_E2E_BUCKETS, registry=r
        )
        self.req_prompt_tokens = Histogram(
            "plinth:request_prompt_tokens", "Prompt tokens per request.", ml, buckets=_TOKEN_COUNT_BUCKETS, registry=r
        )
        self.req_generation_tokens = Histogram(
            "plinth:request_generation_tokens", "Generated tokens per request.", ml, buckets=_TOKEN_COUNT_BUCKETS, registry=r
        )
        r.register(_EngineCollector(engine, model_name, vllm_names))
        # bound children: no label lookups per token
        self._prompt_tokens = self._bind(self.prompt_tokens)
        self._generation_tokens = self._bind(self.generation_tokens)
        self._ttft = self._bind(self.ttft)
        self._tpot = self._bind(self.tpot)
        self._itl = self._bind(self.itl)
        self._e2e = self._bind(self.e2e)
        self._req_prompt = self._bind(self.req_prompt_tokens)
        self._req_gen = self._bind(self.req_generation_tokens)
        self._vllm_success = self._twin(self.request_success) if vllm_names else None

    def _twin(self, metric: Any) -> Any:
        """``metric`` under vLLM's name, labels and (for histograms) buckets."""
        short: str = metric._name.removeprefix("plinth:")
        name = "vllm:" + _VLLM_RENAMED.get(short, short)
        labels = ["model_name", "engine", *metric._labelnames[1:]]
        kw: dict[str, Any] = {"registry": self.registry}
        if isinstance(metric, Histogram):
            kw["buckets"] = metric._upper_bounds[:-1]
        return type(metric)(name, metric._documentation, labels, **kw)

    def _bind(self, metric: Any) -> Any:
        child = metric.labels(self.model_name)
        if not self.vllm_names:
            return child
        return _Both(child, self._twin(metric).labels(self.model_name, "0"))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Latencies and token counts of one generation request (one engine request)."""

    __slots__ = ("m", "start", "first", "last", "seen", "prompt_tokens", "done")

    def __init__(self, m: ServerMetrics | None, start: float | None = None) -> None:
        self.m = m
        self.start = start if start is not None else time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.seen: dict[int, int] = {}
        self.prompt_tokens = 0
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        if self.m is None:
            return
        now = time.monotonic()
        if not self.prompt_tokens:
            self.prompt_tokens = len(out.prompt_token_ids)
            self.m._prompt_tokens.inc(self.prompt_tokens)
        total = 0
        most = 0
        for c in out.outputs:
            n = len(c.token_ids) - self.seen.get(c.index, 0)
            if n > 0:
                self.seen[c.index] = len(c.token_ids)
                total += n
                most = max(most, n)
        if not total:
            return
        self.m._generation_tokens.inc(total)
        if self.first is None:
            self.first = now
            self.m._ttft.observe(now - self.start)
            most -= 1
        if most > 0 and self.last is not None:
            gap = (now - self.last) / most
            for _ in range(most):
                self.m._itl.observe(gap)
        self.last = now

    def finish(self, reason: str | None) -> None:
        """Once per request: ``reason`` is the first choice's finish reason,
        ``abort`` for a client that left, or None after an error."""
        if self.m is None or self.done:
            return
        self.done = True
        now = time.monotonic()
        self.m._e2e.observe(now - self.start)
        gen = max(self.seen.values(), default=0)
        self.m._req_gen.observe(sum(self.seen.values()))
        if self.prompt_tokens:
            self.m._req_prompt.observe(self.prompt_tokens)
        if self.first is not None and gen > 1:
            self.m._tpot.observe((now - self.first) / (gen - 1))
        self.m.request_success.labels(self.m.model_name, reason or "error").inc()
        if self.m._vllm_success is not None:
            self.m._vllm_success.labels(self.m.model_name, "0", reason or "error").inc()
