"""`platform bench serve`: load an OpenAI-compatible server over HTTP and
measure what a client sees.

Every request streams (SSE). Per request the client records the time to the
first content chunk (TTFT), the gaps between content chunks (ITL), the
end-to-end latency (E2EL, until the stream ends) and the time per output token
after the first, ``TPOT = (E2EL - TTFT) / (output_tokens - 1)``. Output tokens
are counted from the server's ``usage`` (``stream_options.include_usage``)
when it sends one, else with ``--tokenizer``, else as content chunks. The
summary uses the names ``vllm bench serve`` prints and saves
(``request_throughput``, ``output_throughput``, ``total_token_throughput``,
``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``, ``p99_ttft_ms``, the
same for ``tpot``, ``itl`` and ``e2el``, ``completed``, ``failed``,
``total_input_tokens``, ``total_output_tokens``, ``duration``,
``max_output_tokens_per_s``, ``max_concurrent_requests``). A request that
fails is counted and its error kept; it never stops the run.

Datasets are made offline from a seed, never downloaded:

* ``random``: prompts of random common English words, fitted to a token
  length with ``--tokenizer``, else the server's ``/tokenize``, else
  characters / 4. Lengths are drawn uniformly from
  ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` (vLLM's convention;
  ``--range-ratio 0``, the default, means fixed lengths).
* ``sharegpt-like``: the same kind of prompts, with input and output lengths
  drawn from log-normal distributions whose means are ShareGPT's published
  ones (the vLLM paper, Kwon et al. 2023, Fig. 11: 161.31 input and 337.99
  output tokens per request); see ``SHAREGPT_LIKE``. The text is random words:
  only the length distribution is ShareGPT's.

Scenarios are LMDeploy's four benchmark scenarios, with every token length
multiplied by ``--scale`` (default 1/8) so that SmolLM2-135M on a 2-core CPU
runs each in minutes; see ``SCENARIOS``.

The module imports nothing heavy at import time, so ``platform bench serve
--help`` is fast; httpx, numpy, tqdm, matplotlib and tokenizers are imported
inside :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
DATASETS = ("random", "sharegpt-like")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}

#: Defaults when neither an option nor a scenario sets the value. Small, for a
#: CPU: vLLM's own defaults (1000 prompts, 1024 in / 128 out) would take hours.
DEFAULTS = {"dataset": "random", "input_len": 128, "output_len": 128, "range_ratio": 0.0, "num_prompts": 32}

#: Scenario scale: LMDeploy's token lengths times this.
DEFAULT_SCALE = 1 / 8

#: LMDeploy's four benchmark scenarios at full size (tokens). ``--scale``
#: multiplies every length (input, output, and the ShareGPT-like means).
SCENARIOS: dict[str, dict[str, Any]] = {
    "short-chat": {"dataset": "sharegpt-like", "num_prompts": 64, "about": "ShareGPT-like short chat"},
    "fixed-1k": {"dataset": "random", "input_len": 1024, "output_len": 1024, "num_prompts": 16, "about": "fixed 1k in / 1k out"},
    "long-thinking": {"dataset": "random", "input_len": 2048, "output_len": 6144, "num_prompts": 8, "about": "long thinking: 2k in / 6k out"},
    "long-input": {"dataset": "random", "input_len": 6144, "output_len": 2048, "num_prompts": 8, "about": "long input: 6k in / 2k out"},
}

#: The ShareGPT-like length distribution. Means: ShareGPT's published means
#: (vLLM paper, Fig. 11). Sigmas: our choice, giving ShareGPT's long right tail
#: (median input about 98 tokens, median output about 225). Clipped as vLLM's
#: ShareGPT loader filters (at least 4 tokens, a prompt at most 1024 tokens, a
#: prompt plus output at most 2048), before ``--scale`` where a scenario scales.
SHAREGPT_LIKE = {
    "input_mean": 161.31,
    "input_sigma": 1.0,
    "output_mean": 337.99,
    "output_sigma": 0.9,
    "min_len": 4,
    "max_input": 1024,
    "max_total": 2048,
}

#: Common English words (one or two tokens each in most BPE vocabularies).
WORDS = (
    "the of and to in is was that for on as with by he at from his an were are which this be or has had not first "
    "one their its new after but who they have her she two been other when there all during into school time may "
    "years more most only over city some world would where later up such used many can state about national out "
    "known university united then made team three part under year film team also well between both while about "
    "people since before work game these through series government could season each found high called number "
    "any what including second water light place music river story small house day family back great group life "
    "early long party old power name point order book during country way among year system great local area "
    "following human design early church public show village north south east west road line several member "
    "history field near service club development age major league album released station single period common "
    "band march april june july august second large million own held until within market court general using"
).split()
WORDS = tuple(dict.fromkeys(WORDS))  # unique, in order


# ---------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------


def _scenario_help() -> str:
    rows = []
    for name, s in SCENARIOS.items():
        if s["dataset"] == "random":
            rows.append(f"{name} ({s['about']}; at the default scale {int(s['input_len'] * DEFAULT_SCALE)} / "
                        f"{int(s['output_len'] * DEFAULT_SCALE)})")
        else:
            rows.append(f"{name} ({s['about']}; means {SHAREGPT_LIKE['input_mean'] * DEFAULT_SCALE:.0f} in / "
                        f"{SHAREGPT_LIKE['output_mean'] * DEFAULT_SCALE:.0f} out at the default scale)")
    return "; ".join(rows)


def add_arguments(parser: argparse.ArgumentParser, registry: Any = None) -> None:
    parser.epilog = (
        "Scenarios are LMDeploy's four benchmark scenarios with every token length multiplied by --scale "
        f"(default 1/{round(1 / DEFAULT_SCALE)}), so that SmolLM2-135M on a 2-core CPU runs each in minutes. "
        "Metric names follow `vllm bench serve`."
    )
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    g.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions", help="API to load (default: %(default)s)")
    g.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY if set)")
    g.add_argument("--label", default=None, help="a name for this run in the result file and plot")
    g.add_argument(
        "--extra-body", default=None, metavar="JSON",
        help="JSON object merged into every request body (for servers that need their own fields)",
    )
    g.add_argument("--request-timeout", type=float, default=6 * 3600, help="seconds one request may take")
    g.add_argument(
        "--ready-timeout", type=float, default=600,
        help="wait up to this many seconds for one test request to succeed before the run (0: no test request)",
    )

    d = parser.add_argument_group("workload")
    d.add_argument("--scenario", choices=tuple(SCENARIOS), default=None, help=_scenario_help())
    d.add_argument("--scale", type=float, default=DEFAULT_SCALE, help="multiplies a scenario's token lengths (default: 1/8)")
    d.add_argument("--dataset", choices=DATASETS, default=None, help="prompt set (default: random)")
    d.add_argument("--input-len", type=int, default=None, help=f"prompt tokens, random dataset (default: {DEFAULTS['input_len']})")
    d.add_argument("--output-len", type=int, default=None, help=f"max_tokens, random dataset (default: {DEFAULTS['output_len']})")
    d.add_argument(
        "--range-ratio", type=float, default=None,
        help="random lengths are uniform in [len*(1-r), len*(1+r)] (default: 0, fixed lengths)",
    )
    d.add_argument("--num-prompts", type=int, default=None, help=f"requests to send (default: {DEFAULTS['num_prompts']})")
    d.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and arrivals")
    d.add_argument(
        "--tokenizer", default=None, metavar="PATH",
        help="a tokenizer.json, a folder with one (or a transformers tokenizer), or a .gguf file, to fit prompt "
        "lengths (default: the server's /tokenize if it has one, else characters / 4)",
    )
    d.add_argument(
        "--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
        help="send ignore_eos so every output has its full length (default: on)",
    )
    d.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")

    t = parser.add_argument_group("traffic")
    t.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    t.add_argument(
        "--request-rate", type=float, default=float("inf"),
        help="requests per second; Poisson arrivals (gamma with --burstiness) unless inf (default: inf, all at once)",
    )
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps; 1 = Poisson")

    o = parser.add_argument_group("output")
    o.add_argument("--save-result", default=None, metavar="FILE.json", help="write the result here")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="plot the latency distributions and throughput")
    o.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles to report (default: 99)")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    label: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout: float = 6 * 3600
    ready_timeout: float = 600
    scenario: str | None = None
    scale: float = DEFAULT_SCALE
    dataset: str = "random"
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    num_prompts: int = 32
    seed: int = 0
    tokenizer: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    save_result: str | None = None
    plot: str | None = None
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    disable_tqdm: bool = False


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Explicit options win, then the scenario's values, then DEFAULTS."""
    scenario = SCENARIOS.get(args.scenario) if args.scenario else None
    scale = args.scale
    if scale <= 0:
        raise ValueError("--scale must be > 0")

    def pick(name: str) -> Any:
        given = getattr(args, name)
        if given is not None:
            return given
        if scenario is not None and name in scenario:
            value = scenario[name]
            return max(1, int(round(value * scale))) if name in ("input_len", "output_len") else value
        return DEFAULTS[name]

    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    cfg = BenchConfig(
        base_url=args.base_url.rstrip("/"),
        model=args.model,
        endpoint=args.endpoint,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        label=args.label,
        extra_body=extra,
        request_timeout=args.request_timeout,
        ready_timeout=args.ready_timeout,
        scenario=args.scenario,
        scale=scale,
        dataset=pick("dataset"),
        input_len=pick("input_len"),
        output_len=pick("output_len"),
        range_ratio=pick("range_ratio"),
        num_prompts=pick("num_prompts"),
        seed=args.seed,
        tokenizer=args.tokenizer,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        save_result=args.save_result,
        plot=args.plot,
        percentiles=[float(p) for p in str(args.metric_percentiles).split(",") if p.strip()],
        disable_tqdm=args.disable_tqdm,
    )
    if cfg.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if cfg.input_len < 1 or cfg.output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    if not 0.0 <= cfg.range_ratio < 1.0:
        raise ValueError("--range-ratio must be in [0, 1)")
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if cfg.request_rate <= 0 or cfg.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    return cfg


# ---------------------------------------------------------------------------
# token counting
# ---------------------------------------------------------------------------


class CharCounter:
    """No tokenizer: about four characters per token."""

    name = "chars/4"

    def count(self, text: str) -> int:
        return max(1, math.ceil(len(text) / 4)) if text else 0


class HFCounter:
    """A local tokenizer: tokenizer.json (the `tokenizers` library), a folder, or a GGUF file."""

    def __init__(self, path: str) -> None:
        self.name = path
        tj = path if path.endswith(".json") else os.path.join(path, "tokenizer.json")
        if os.path.isfile(tj):
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(tj)
            self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
            return
        from transformers import AutoTokenizer  # a folder without tokenizer.json, or a GGUF file

        if path.endswith(".gguf"):
            hf = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
        else:
            hf = AutoTokenizer.from_pretrained(path)
        self._encode = lambda text: hf.encode(text, add_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self._encode(text))


class ServerCounter:
    """The server's ``/tokenize`` (vLLM's shape: ``{"model", "prompt"}`` -> ``{"count"|"tokens"}``)."""

    def __init__(self, client: Any, base_url: str, model: str | None) -> None:
        self.client, self.url, self.model = client, base_url + "/tokenize", model
        self.name = self.url

    def count(self, text: str) -> int:
        body: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
        if self.model:
            body["model"] = self.model
        r = self.client.post(self.url, json=body)
        r.raise_for_status()
        data = r.json()
        if "count" in data:
            return int(data["count"])
        return len(data["tokens"])


def make_counter(tokenizer: str | None, base_url: str, model: str | None, headers: dict[str, str]) -> Any:
    if tokenizer:
        return HFCounter(tokenizer)
    import httpx

    client = httpx.Client(headers=headers, timeout=30, trust_env=not _is_loopback(base_url))
    counter = ServerCounter(client, base_url, model)
    try:
        if counter.count("hello world") > 0:
            return counter
    except Exception:
        pass
    client.close()
    return CharCounter()


# ---------------------------------------------------------------------------
# datasets
# ---------------------------------------------------------------------------


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


def fit_words(rng: random.Random, target: int, count: Callable[[str], int]) -> tuple[str, int]:
    """Random words whose token count is as close to ``target`` as the counter allows."""
    words: list[str] = []

    def text(n: int) -> str:
        while len(words) < n:
            words.append(rng.choice(WORDS))
        return " ".join(words[:n])

    n = max(1, target)
    best: tuple[int, int] | None = None
    tried: set[int] = set()
    for _ in range(10):
        tried.add(n)
        c = count(text(n))
        if best is None or (abs(c - target), c > target) < (abs(best[1] - target), best[1] > target):
            best = (n, c)
        if c == target:
            break
        step = round((target - c) / max(c / n, 1e-3))
        step = step or (1 if c < target else -1)
        n = max(1, n + step)
        while n in tried and n > 1:  # never loop between two counts
            n += 1 if c < target else -1
        if n in tried:
            break
    assert best is not None
    return text(best[0]), best[1]


def sample_lengths_random(rng: Any, n: int, length: int, range_ratio: float) -> list[int]:
    lo = max(1, int(math.floor(length * (1 - range_ratio))))
    hi = max(lo, int(math.ceil(length * (1 + range_ratio))))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def sample_lengths_sharegpt_like(rng: Any, n: int, scale: float = 1.0) -> list[tuple[int, int]]:
    """(input, output) lengths from the stated log-normal distributions, clipped, then scaled."""
    p = SHAREGPT_LIKE
    pairs = []
    for _ in range(n):
        # a log-normal with mean m and sigma s has mu = ln(m) - s^2 / 2
        i = rng.lognormal(math.log(p["input_mean"]) - p["input_sigma"] ** 2 / 2, p["input_sigma"])
        o = rng.lognormal(math.log(p["output_mean"]) - p["output_sigma"] ** 2 / 2, p["output_sigma"])
        i = int(min(max(round(i), p["min_len"]), p["max_input"]))
        o = int(min(max(round(o), p["min_len"]), p["max_total"] - i))
        pairs.append((max(1, round(i * scale)), max(1, round(o * scale))))
    return pairs


def build_requests(cfg: BenchConfig, count: Callable[[str], int]) -> list[SampleRequest]:
    import numpy as np

    nprng = np.random.default_rng(cfg.seed)
    if cfg.dataset == "random":
        ins = sample_lengths_random(nprng, cfg.num_prompts, cfg.input_len, cfg.range_ratio)
        outs = sample_lengths_random(nprng, cfg.num_prompts, cfg.output_len, cfg.range_ratio)
        pairs = list(zip(ins, outs, strict=True))
    elif cfg.dataset == "sharegpt-like":
        scale = cfg.scale if cfg.scenario else 1.0
        pairs = sample_lengths_sharegpt_like(nprng, cfg.num_prompts, scale)
    else:
        raise ValueError(f"unknown dataset {cfg.dataset!r}")
    reqs = []
    for k, (in_len, out_len) in enumerate(pairs):
        rng = random.Random(f"{cfg.seed}:{k}")  # one stream per prompt: prompt k is the same whatever n is
        text, n_tok = fit_words(rng, in_len, count)
        reqs.append(SampleRequest(prompt=text, prompt_len=n_tok, expected_output_len=out_len))
    return reqs


# ---------------------------------------------------------------------------
# one request
# ---------------------------------------------------------------------------


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    output_len_source: str = ""  # usage | tokenizer | chunks
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL: from sending the request to the end of the stream
    start_time: float = 0.0  # relative to the start of the run
    chunk_times: list[float] = field(default_factory=list)  # content chunks, relative to the start of the run
    generated_text: str = ""
    usage_prompt_tokens: int | None = None


def _payload(cfg: BenchConfig, model: str, req: SampleRequest, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": cfg.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def _chunk_text(data: dict[str, Any]) -> str:
    out = []
    for choice in data.get("choices") or []:
        if "text" in choice:
            out.append(choice.get("text") or "")
        delta = choice.get("delta") or choice.get("message") or {}
        out.append(delta.get("content") or "")
        out.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
    return "".join(out)


def _error_text(data: Any) -> str:
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err if err is not None else data)


async def send_request(
    client: Any, cfg: BenchConfig, model: str, req: SampleRequest, t0: float, max_tokens: int | None = None
) -> RequestOutput:
    """Stream one request; never raises (a failure is an output with ``success=False``)."""
    out = RequestOutput(prompt_len=req.prompt_len)
    body = _payload(cfg, model, req, max_tokens or req.expected_output_len)
    st = time.perf_counter()
    out.start_time = st - t0
    last = st
    texts: list[str] = []
    try:
        async with client.stream("POST", cfg.base_url + cfg.endpoint, json=body) as resp:
            if resp.status_code != 200:
                raw = (await resp.aread()).decode(errors="replace")
                try:
                    msg = _error_text(json.loads(raw))
                except ValueError:
                    msg = raw[:500]
                out.error = f"HTTP {resp.status_code}: {msg}"
                return out
            if "text/event-stream" not in resp.headers.get("content-type", "text/event-stream"):
                data = json.loads(await resp.aread())  # a server that does not stream
                now = time.perf_counter()
                texts.append(_chunk_text(data))
                out.ttft = now - st
                out.chunk_times.append(now - t0)
                last = now
                usage = data.get("usage") or {}
                if usage.get("completion_tokens") is not None:
                    out.output_tokens, out.output_len_source = int(usage["completion_tokens"]), "usage"
                out.usage_prompt_tokens = usage.get("prompt_tokens")
            else:
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event: lines
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    now = time.perf_counter()
                    data = json.loads(payload)
                    if isinstance(data, dict) and data.get("error") is not None:
                        out.error = f"error in stream: {_error_text(data)}"
                        return out
                    text = _chunk_text(data)
                    if text:
                        if not texts:
                            out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                        texts.append(text)
                        out.chunk_times.append(now - t0)
                    usage = data.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        out.output_tokens, out.output_len_source = int(usage["completion_tokens"]), "usage"
                        out.usage_prompt_tokens = usage.get("prompt_tokens")
        end = time.perf_counter()
    except Exception as exc:  # a failed request is a result, never a crash
        out.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return out
    out.generated_text = "".join(texts)
    if not texts:
        out.error = "the stream ended without any content"
        return out
    out.latency = end - st
    if not out.output_len_source:
        out.output_tokens, out.output_len_source = len(texts), "chunks"
    if out.usage_prompt_tokens:
        out.prompt_len = int(out.usage_prompt_tokens)
    out.success = True
    return out


# ---------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------


def _stats(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    import numpy as np

    arr = np.asarray(values if len(values) else [0.0], dtype=float) * 1000.0
    res = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        res[f"p{_pword(p)}"] = float(np.percentile(arr, p))
    return res


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def calculate_metrics(outputs: Sequence[RequestOutput], duration: float, percentiles: Sequence[float]) -> dict[str, Any]:
    """The summary, with vLLM's names. Times in the lists are seconds; the *_ms keys are milliseconds."""
    ok = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_tokens for o in ok)
    ttfts = [o.ttft for o in ok]
    e2els = [o.latency for o in ok]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    itls = [x for o in ok for x in o.itl]
    m: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else 0.0,
    }
    # peak output throughput: content chunks per 1-second bucket (as vLLM counts them), and the
    # most requests in flight during any one of those seconds
    max_tok, max_conc = 0.0, 0
    if ok:
        t_start = min(o.start_time for o in ok)
        t_end = max(o.start_time + o.latency for o in ok)
        nb = int(math.ceil(t_end - t_start)) + 1
        tok = [0] * nb
        conc = [0] * nb
        for o in ok:
            for t in o.chunk_times:
                tok[min(nb - 1, int(t - t_start))] += 1
            for s in range(int(o.start_time - t_start), min(nb - 1, int(o.start_time + o.latency - t_start)) + 1):
                conc[s] += 1
        max_tok, max_conc = float(max(tok)), int(max(conc))
    m["max_output_tokens_per_s"] = max_tok
    m["max_concurrent_requests"] = max_conc
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, v in _stats(vals, percentiles).items():
            m[f"{stat}_{name}_ms"] = v
    return m


def build_result(cfg: BenchConfig, model: str, counter_name: str, outputs: Sequence[RequestOutput],
                 duration: float) -> dict[str, Any]:
    """vLLM's result file: metadata, the summary, and per-request lists."""
    import datetime

    res: dict[str, Any] = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if cfg.endpoint == "/v1/chat/completions" else "openai",
        "endpoint_type": "openai-chat" if cfg.endpoint == "/v1/chat/completions" else "openai",
        "label": cfg.label,
        "base_url": cfg.base_url,
        "endpoint": cfg.endpoint,
        "model_id": model,
        "tokenizer_id": counter_name,
        "scenario": cfg.scenario,
        "scale": cfg.scale if cfg.scenario else None,
        "dataset_name": cfg.dataset,
        "input_len": cfg.input_len,
        "output_len": cfg.output_len,
        "range_ratio": cfg.range_ratio,
        "num_prompts": cfg.num_prompts,
        "seed": cfg.seed,
        "ignore_eos": cfg.ignore_eos,
        "temperature": cfg.temperature,
        "request_rate": cfg.request_rate if cfg.request_rate != float("inf") else "inf",
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
    }
    res.update(calculate_metrics(outputs, duration, cfg.percentiles))
    res["request_goodput"] = None
    res["input_lens"] = [o.prompt_len for o in outputs]
    res["output_lens"] = [o.output_tokens if o.success else 0 for o in outputs]
    res["output_len_sources"] = [o.output_len_source for o in outputs]
    res["ttfts"] = [o.ttft if o.success else None for o in outputs]
    res["itls"] = [o.itl if o.success else [] for o in outputs]
    res["e2els"] = [o.latency if o.success else None for o in outputs]
    res["start_times"] = [o.start_time for o in outputs]
    res["generated_texts"] = [o.generated_text for o in outputs]
    res["errors"] = [o.error for o in outputs]
    return res


def format_summary(res: dict[str, Any], percentiles: Sequence[float]) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {format(value, fmt) if fmt else value:<10}")

    engine = res.get("server_engine") or {}
    if engine.get("device_name"):
        lines.append(f"Server: {engine['device_name']}, {engine.get('dtype')}, backend {engine.get('backend')}")
        lines.append(f"  instruction sets: {','.join(engine.get('isa') or []) or 'not reported'}")

    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    if res.get("max_concurrency") is not None:
        row("Maximum request concurrency:", res["max_concurrency"])
    if res.get("request_rate") not in (None, "inf"):
        row("Request rate configured (RPS):", res["request_rate"], ".2f")
    row("Benchmark duration (s):", res["duration"], ".2f")
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", res["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", res["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", res["max_concurrent_requests"], ".2f")
    row("Total Token throughput (tok/s):", res["total_token_throughput"], ".2f")
    for name in PERCENTILE_METRICS:
        short, header = METRIC_HEADERS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", res[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", res[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            row(f"P{_pword(p)} {short} (ms):", res[f"p{_pword(p)}_{name}_ms"], ".2f")
    sp = res.get("speculative")
    if sp:
        lines.append("{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"))
        row("Proposed tokens:", int(sp["num_draft_tokens"]))
        row("Accepted tokens:", int(sp["num_accepted_tokens"]))
        row("Rejected tokens:", int(sp["num_rejected_tokens"]))
        row("Acceptance rate:", sp["acceptance_rate"], ".2f")
        row("Mean accepted length:", sp["mean_accepted_length"], ".2f")
        per = sp["acceptance_rate_per_position_since_start"]
        if per:
            row("Acceptance per position:", ", ".join(f"{x:.2f}" for x in per))
    lines.append("=" * 50)
    return "\n".join(lines)


def format_errors(outputs: Sequence[RequestOutput], limit: int = 5) -> str:
    from collections import Counter

    errs = Counter(o.error for o in outputs if not o.success)
    if not errs:
        return ""
    lines = [f"{sum(errs.values())} request(s) failed:"]
    for msg, n in errs.most_common(limit):
        lines.append(f"  {n} x {msg[:300]}")
    if len(errs) > limit:
        lines.append(f"  ... and {len(errs) - limit} other error(s); all are in the result file")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# the plot
# ---------------------------------------------------------------------------


def plot_result(res: dict[str, Any], path: str) -> None:
    """Histograms of TTFT, TPOT, ITL and E2EL, output tokens per second over time, and requests in flight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [i for i, e in enumerate(res["errors"]) if not e]
    ttft = np.array([res["ttfts"][i] for i in ok], dtype=float) * 1000
    e2el = np.array([res["e2els"][i] for i in ok], dtype=float) * 1000
    outl = np.array([res["output_lens"][i] for i in ok], dtype=float)
    tpot = np.array([(e - t) / (n - 1) for e, t, n in zip(e2el, ttft, outl, strict=True) if n > 1], dtype=float)
    itl = np.array([x for i in ok for x in res["itls"][i]], dtype=float) * 1000

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    title = res.get("label") or res.get("model_id") or ""
    conc = res.get("max_concurrency")
    fig.suptitle(
        f"{title}  {res['endpoint']}  {res['dataset_name']}  concurrency {conc if conc else 'unlimited'}  "
        f"completed {res['completed']}, failed {res['failed']}  output {res['output_throughput']:.1f} tok/s"
    )
    for ax, (name, vals) in zip(axes.flat[:4], (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl), ("E2EL", e2el)), strict=True):
        if len(vals):
            ax.hist(vals, bins=min(40, max(5, len(vals) // 2)), color="tab:blue", alpha=0.8)
            med, p99 = float(np.median(vals)), float(np.percentile(vals, 99))
            ax.axvline(med, color="k", linestyle="--", label=f"median {med:.1f}")
            ax.axvline(p99, color="tab:red", linestyle=":", label=f"p99 {p99:.1f}")
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{name} (ms)")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")

    # output chunks per second over time, from each request's TTFT and ITLs
    ax = axes.flat[4]
    times = []
    for i in ok:
        t = res["start_times"][i] + res["ttfts"][i]
        times.append(t)
        for gap in res["itls"][i]:
            t += gap
            times.append(t)
    if times:
        nb = int(math.ceil(max(times))) + 1
        counts = np.bincount(np.floor(np.asarray(times)).astype(int), minlength=nb)
        ax.plot(np.arange(len(counts)), counts, drawstyle="steps-post")
        ax.axhline(res["output_throughput"], color="k", linestyle="--", label=f"mean {res['output_throughput']:.1f}")
        ax.legend(fontsize=8)
    ax.set_title("output chunks per second")
    ax.set_xlabel("s since start")

    ax = axes.flat[5]
    if ok:
        starts = np.array([res["start_times"][i] for i in ok])
        ends = starts + e2el / 1000
        grid = np.linspace(0, float(ends.max()), 400)
        inflight = [(np.sum((starts <= g) & (ends > g))) for g in grid]
        ax.plot(grid, inflight)
    ax.set_title("requests in flight")
    ax.set_xlabel("s since start")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------


def _is_loopback(url: str) -> bool:
    from urllib.parse import urlparse

    return (urlparse(url).hostname or "") in ("127.0.0.1", "localhost", "::1")


def _headers(cfg: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


def discover_model(cfg: BenchConfig) -> str:
    import httpx

    r = httpx.get(cfg.base_url + "/v1/models", headers=_headers(cfg), timeout=30, trust_env=not _is_loopback(cfg.base_url))
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{cfg.base_url}/v1/models lists no model: give --model")
    return data[0]["id"]


async def _arrivals(n: int, rate: float, burstiness: float, seed: int):
    """Yield request indices at Poisson (gamma) arrival times; all at once when the rate is inf."""
    import asyncio

    import numpy as np

    if rate == float("inf"):
        for i in range(n):
            yield i
        return
    gaps = np.random.default_rng(seed + 1).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    due = np.cumsum(gaps)
    start = time.perf_counter()
    for i in range(n):
        wait = start + float(due[i]) - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        yield i


async def _ready_check(client: Any, cfg: BenchConfig, model: str, req: SampleRequest) -> str | None:
    """One test request (few tokens) until it succeeds. None when ready, else why not."""
    import asyncio

    deadline = time.monotonic() + cfg.ready_timeout
    while True:
        out = await send_request(client, cfg, model, req, time.perf_counter(), max_tokens=req.expected_output_len)
        if out.success:
            return None
        retry = out.error.startswith(("ConnectError", "ConnectTimeout", "RemoteProtocolError", "ReadError", "HTTP 5"))
        if not retry or time.monotonic() > deadline:
            return out.error
        await asyncio.sleep(1.0)


def run_client(coro: Any) -> Any:
    """Run the client on uvloop where it is installed (a core dependency on
    CPython outside Windows), else on asyncio's loop. The client shares the
    machine with the server it measures: on 2 cores its asyncio loop took
    1.34-1.47 s of CPU a run (concurrency 16, 32 x 128 tokens) and uvloop's
    1.17-1.26, and the server it measured gave 1.06-1.14x the output tok/s
    (docs/benchmarks.md)."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def benchmark(cfg: BenchConfig, requests: list[SampleRequest], model: str, counter_name: str,
                    log: Callable[[str], None] = print) -> tuple[dict[str, Any], list[RequestOutput]]:
    import asyncio

    import httpx
    from tqdm import tqdm

    limit = cfg.max_concurrency or len(requests)
    client = httpx.AsyncClient(
        headers=_headers(cfg),
        timeout=httpx.Timeout(cfg.request_timeout, connect=60.0, pool=None),
        limits=httpx.Limits(max_connections=limit + 1, max_keepalive_connections=limit + 1),
        trust_env=not _is_loopback(cfg.base_url),
    )
    try:
        if cfg.ready_timeout > 0:
            log("Starting initial single prompt test run...")
            # its own prompt: one of the run's would then start with a prefix-cache hit
            probe = SampleRequest(prompt="Hello, are you ready?", prompt_len=6, expected_output_len=4)
            why = await _ready_check(client, cfg, model, probe)
            if why is not None:
                raise RuntimeError(f"the test request failed: {why}")
            log("Initial test run completed.")
        log(f"Traffic request rate: {cfg.request_rate}")
        log(f"Burstiness factor: {cfg.burstiness} ({'Poisson process' if cfg.burstiness == 1 else 'Gamma distribution'})")
        log(f"Maximum request concurrency: {cfg.max_concurrency}")
        sem = asyncio.Semaphore(limit)
        bar = tqdm(total=len(requests), desc="bench serve", unit="req", disable=cfg.disable_tqdm, file=sys.stderr)

        async def one(i: int, t0: float) -> RequestOutput:
            async with sem:
                out = await send_request(client, cfg, model, requests[i], t0)
            bar.update(1)
            return out

        busy0, own0 = _busy_seconds(), time.process_time()
        t0 = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed):
            tasks.append(asyncio.create_task(one(i, t0)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        busy1, own1 = _busy_seconds(), time.process_time()
        bar.close()
    finally:
        await client.aclose()
    res = build_result(cfg, model, counter_name, outputs, duration)
    # CPU over the measured window: this client's own, and the whole machine's (Linux /proc/stat; None elsewhere).
    # On a shared machine the difference from the server's own use shows other work that skewed the run.
    res["client_cpu_cores"] = (own1 - own0) / duration if duration > 0 else None
    res["machine_busy_cores"] = (busy1 - busy0) / duration if busy0 is not None and busy1 is not None and duration > 0 else None
    return res, outputs


def _busy_seconds() -> float | None:
    """CPU-seconds all CPUs spent busy since boot (user, nice, system, irq, softirq, steal), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def server_engine(cfg: BenchConfig) -> dict[str, Any] | None:
    """What the server says it runs on (its /version: device, instruction sets,
    dtype, backend), so a saved figure says which machine it came from; None
    for servers without it (vLLM, transformers)."""
    import httpx

    try:
        r = httpx.get(cfg.base_url + "/version", headers=_headers(cfg), timeout=10, trust_env=not _is_loopback(cfg.base_url))
        engine = r.json().get("engine") if r.status_code == 200 else None
        return engine if isinstance(engine, dict) else None
    except Exception:
        return None


def server_spec_counters(cfg: BenchConfig) -> dict[str, Any] | None:
    """The server's speculative-decoding counters from /metrics (plinth's
    ``plinth:spec_decode_*``); None when it has none (speculation off, or
    another server)."""
    import httpx

    try:
        r = httpx.get(cfg.base_url + "/metrics", headers=_headers(cfg), timeout=10, trust_env=not _is_loopback(cfg.base_url))
    except Exception:
        return None
    return parse_spec_metrics(r.text) if r.status_code == 200 else None


def parse_spec_metrics(text: str) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for line in text.splitlines():
        if line.startswith("plinth:spec_decode_"):
            name, _, value = line.rpartition(" ")
            key = name.split("{")[0].removeprefix("plinth:spec_decode_").removesuffix("_total")
            if "position=" in name:
                pos = int(name.split('position="')[1].split('"')[0])
                out.setdefault("acceptance_rate_per_position", {})[pos] = float(value)
            else:
                out[key] = float(value)
    return out or None


def spec_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """Proposed, accepted and rejected tokens during the run, with the rates."""
    if not after:
        return None
    b = before or {}
    d = {k: after.get(k, 0.0) - b.get(k, 0.0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_rejected_tokens")}
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0
    # tokens a sequence gains per step that scored proposals (accepted + the target's own)
    d["mean_accepted_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 0.0
    pos = after.get("acceptance_rate_per_position") or {}
    d["acceptance_rate_per_position_since_start"] = [pos[i] for i in sorted(pos)]
    return d


def run_benchmark(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Prepare the prompts, run, print, save and plot; the result dict (vLLM's keys)."""

    model = cfg.model or discover_model(cfg)
    counter = make_counter(cfg.tokenizer, cfg.base_url, model, _headers(cfg))
    log(f"Prompts: {cfg.num_prompts} x {cfg.dataset}"
        + (f" (scenario {cfg.scenario}, scale {cfg.scale:g})" if cfg.scenario else "")
        + f", lengths counted with {counter.name}")
    requests = build_requests(cfg, counter.count)
    client = getattr(counter, "client", None)
    if client is not None:
        client.close()
    spec_before = server_spec_counters(cfg)
    res, outputs = run_client(benchmark(cfg, requests, model, counter.name, log))
    res["server_engine"] = server_engine(cfg)
    res["speculative"] = spec_delta(spec_before, server_spec_counters(cfg))
    log(format_summary(res, cfg.percentiles))
    errors = format_errors(outputs)
    if errors:
        log(errors)
    if cfg.save_result:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.save_result)), exist_ok=True)
        with open(cfg.save_result, "w") as f:
            json.dump(res, f, indent=1)
        log(f"result: {cfg.save_result}")
    if cfg.plot:
        plot_result(res, cfg.plot)
        log(f"plot: {cfg.plot}")
    return res


def run(args: argparse.Namespace, registry: Any = None) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request
    try:
        res = run_benchmark(cfg)
    except Exception as exc:  # a server that never answered, a bad tokenizer path: say so, no traceback
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0 if res["completed"] > 0 else 1


__all__ = [
    "BenchConfig", "RequestOutput", "SampleRequest", "SCENARIOS", "SHAREGPT_LIKE", "add_arguments", "build_requests",
    "calculate_metrics", "config_from_args", "plot_result", "run", "run_benchmark",
]
