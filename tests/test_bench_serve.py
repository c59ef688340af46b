"""`platform bench serve` against a fake OpenAI-compatible streaming server.

The fake server (FastAPI + uvicorn on 127.0.0.1, in a thread) waits a known
time before the first chunk and between chunks, so the benchmark's TTFT, ITL,
TPOT and E2EL must come out at those delays. These check our arithmetic, not
anybody's speed: the tolerances only absorb scheduling jitter.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from plinth.bench import serve as bs  # noqa: E402


@dataclass
class Behaviour:
    ttft: float = 0.2  # seconds before the first content chunk
    itl: float = 0.05  # seconds between content chunks
    usage: bool = True  # a usage chunk when stream_options.include_usage
    tokenize: bool = True  # /tokenize: one token per word
    fail_every: int = 0  # every k-th request (1-based) answers HTTP 500
    stream_error_every: int = 0  # every k-th request sends an error object mid-stream


class FakeServer:
    def __init__(self, behaviour: Behaviour) -> None:
        self.b = behaviour
        self.bodies: list[dict] = []
        self.count = 0
        app = fastapi.FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/tokenize")
        async def tokenize(body: dict):
            if not self.b.tokenize:
                return JSONResponse({"error": {"message": "not found"}}, status_code=404)
            return {"count": len(body["prompt"].split())}

        @app.post("/v1/completions")
        async def completions(body: dict):
            return self._answer(body, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(body: dict):
            return self._answer(body, chat=True)

        self.app = app

    def _answer(self, body: dict, chat: bool):
        self.bodies.append(body)
        self.count += 1
        n = self.count
        b = self.b
        if b.fail_every and n % b.fail_every == 0:
            return JSONResponse({"error": {"message": "boom", "type": "server_error", "param": None, "code": 500}},
                                status_code=500)
        max_tokens = int(body["max_tokens"])
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        stream_error = bool(b.stream_error_every and n % b.stream_error_every == 0)

        def chunk(text: str) -> str:
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
            else:
                choice = {"index": 0, "text": text, "finish_reason": None}
            return "data: " + json.dumps({"id": f"r{n}", "choices": [choice]}) + "\n\n"

        async def gen():
            if chat:  # a role-only first chunk, at once: it is not a token and must not count as TTFT
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
            await asyncio.sleep(b.ttft)
            yield chunk("tok ")
            for i in range(1, max_tokens):
                await asyncio.sleep(b.itl)
                if stream_error and i == 2:
                    yield "data: " + json.dumps({"error": {"message": "engine died"}}) + "\n\n"
                    return
                yield chunk("tok ")
            if b.usage and include_usage:
                usage = {"prompt_tokens": len(str(body.get("prompt") or body.get("messages")).split()),
                         "completion_tokens": max_tokens, "total_tokens": 0}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")


@pytest.fixture
def fake_server():
    started = []

    def start(**kw) -> tuple[FakeServer, str]:
        fake = FakeServer(Behaviour(**kw))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.01)
        started.append((server, thread, sock))
        return fake, f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, thread, sock in started:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _cfg(url: str, **kw) -> bs.BenchConfig:
    base = dict(base_url=url, model="fake-model", ready_timeout=0, disable_tqdm=True, input_len=10, output_len=6,
                num_prompts=4)
    base.update(kw)
    return bs.BenchConfig(**base)


def _quiet(_msg: str) -> None:
    pass


# ---------------------------------------------------------------------------
# against the fake server
# ---------------------------------------------------------------------------


def test_metrics_match_the_servers_delays(fake_server, tmp_path):
    fake, url = fake_server(ttft=0.2, itl=0.05)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    cfg = _cfg(url, max_concurrency=2, save_result=str(out_json), plot=str(out_png))
    res = bs.run_benchmark(cfg, log=_quiet)

    assert res["completed"] == 4 and res["failed"] == 0
    assert res["total_output_tokens"] == 4 * 6  # from the usage chunks
    assert res["output_len_sources"] == ["usage"] * 4
    # every request asked for what the config says
    for body in fake.bodies:
        assert body["max_tokens"] == 6 and body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0

    # TTFT 200 ms, ITL 50 ms, TPOT = (E2EL - TTFT) / 5 = 50 ms, E2EL = 200 + 5 * 50 = 450 ms
    assert 195 <= res["median_ttft_ms"] <= 290, res["median_ttft_ms"]
    assert 195 <= res["mean_ttft_ms"] <= 290
    assert 48 <= res["median_itl_ms"] <= 70, res["median_itl_ms"]
    assert 48 <= res["mean_tpot_ms"] <= 70, res["mean_tpot_ms"]
    assert 445 <= res["median_e2el_ms"] <= 600, res["median_e2el_ms"]
    assert res["p99_ttft_ms"] >= res["median_ttft_ms"]
    # 4 requests, 2 at a time: two waves of about 450 ms
    assert 0.89 <= res["duration"] <= 1.6
    # the throughputs are exactly the totals over the duration
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / res["duration"])
    assert res["request_throughput"] == pytest.approx(4 / res["duration"])
    assert res["total_token_throughput"] == pytest.approx(
        (res["total_input_tokens"] + res["total_output_tokens"]) / res["duration"])
    # vLLM's definition: the most requests active at any time within one 1-second bucket
    assert 2 <= res["max_concurrent_requests"] <= 4

    saved = json.loads(out_json.read_text())
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
                "input_lens", "output_lens", "ttfts", "itls", "errors", "generated_texts", "model_id", "max_concurrency"):
        assert key in saved, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{metric}_ms" in saved
    assert len(saved["itls"]) == 4 and all(len(x) == 5 for x in saved["itls"])
    assert saved["client_cpu_cores"] >= 0 and (saved["machine_busy_cores"] is None or saved["machine_busy_cores"] >= 0)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompt_lengths_come_from_tokenize(fake_server):
    fake, url = fake_server(ttft=0.0, itl=0.0)
    cfg = _cfg(url, input_len=37, num_prompts=3, range_ratio=0.0)
    res = bs.run_benchmark(cfg, log=_quiet)
    assert res["tokenizer_id"].endswith("/tokenize")
    prompts = [b["prompt"] for b in fake.bodies]
    assert [len(p.split()) for p in prompts] == [37, 37, 37]  # the fake counts one token per word
    assert len(set(prompts)) == 3  # distinct prompts: no accidental prefix-cache hits


def test_chat_endpoint_skips_the_role_chunk(fake_server):
    fake, url = fake_server(ttft=0.15, itl=0.03)
    res = bs.run_benchmark(_cfg(url, endpoint="/v1/chat/completions", num_prompts=2, output_len=4), log=_quiet)
    assert res["completed"] == 2
    assert fake.bodies[0]["messages"][0]["role"] == "user"
    assert 145 <= res["median_ttft_ms"] <= 240  # the role chunk came at once; the first token 150 ms later
    assert 28 <= res["median_itl_ms"] <= 50


def test_failed_requests_are_counted_not_fatal(fake_server, tmp_path):
    fake, url = fake_server(ttft=0.0, itl=0.001, fail_every=3, stream_error_every=5)
    cfg = _cfg(url, num_prompts=6, max_concurrency=1, save_result=str(tmp_path / "r.json"), plot=str(tmp_path / "p.png"))
    res = bs.run_benchmark(cfg, log=_quiet)
    # requests 3 and 6 answer HTTP 500; request 5 breaks mid-stream
    assert res["failed"] == 3 and res["completed"] == 3
    errs = res["errors"]
    assert errs[2].startswith("HTTP 500") and "boom" in errs[2]
    assert errs[5].startswith("HTTP 500")
    assert "engine died" in errs[4]
    assert errs[0] == errs[1] == errs[3] == ""
    assert res["total_output_tokens"] == 3 * 6
    assert res["ttfts"][2] is None and res["output_lens"][2] == 0
    assert (tmp_path / "p.png").exists()


def test_without_usage_or_tokenize(fake_server):
    _, url = fake_server(ttft=0.0, itl=0.001, usage=False, tokenize=False)
    res = bs.run_benchmark(_cfg(url, num_prompts=2, output_len=5, input_len=20), log=_quiet)
    assert res["tokenizer_id"] == "chars/4"
    assert res["output_len_sources"] == ["chunks", "chunks"]
    assert res["total_output_tokens"] == 10
    assert all(19 <= n <= 21 for n in res["input_lens"])  # chars/4 fits within a token


def test_model_is_discovered_and_ready_check_runs(fake_server):
    fake, url = fake_server(ttft=0.0, itl=0.001)
    cfg = _cfg(url, model=None, ready_timeout=30, num_prompts=2)
    res = bs.run_benchmark(cfg, log=_quiet)
    assert res["model_id"] == "fake-model" and res["completed"] == 2
    assert len(fake.bodies) == 3 and fake.bodies[0]["max_tokens"] == 4  # the test request, then the run
    # the test request has its own prompt, so no prompt of the run starts with a prefix-cache hit
    assert fake.bodies[0]["prompt"] not in (fake.bodies[1]["prompt"], fake.bodies[2]["prompt"])


def test_poisson_arrivals_spread_the_starts(fake_server):
    _, url = fake_server(ttft=0.0, itl=0.001)
    res = bs.run_benchmark(_cfg(url, num_prompts=8, output_len=2, request_rate=20.0), log=_quiet)
    starts = res["start_times"]
    assert starts == sorted(starts)
    assert starts[-1] - starts[0] > 0.05  # 7 gaps of 50 ms on average; all at once would be ~0


def test_cli_against_a_dead_port_reports_and_exits_nonzero(tmp_path):
    from plinth.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "dead.json"
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--ready-timeout", "0",
               "--num-prompts", "3", "--input-len", "8", "--output-len", "2", "--disable-tqdm",
               "--save-result", str(out)])
    assert rc == 1
    res = json.loads(out.read_text())
    assert res["completed"] == 0 and res["failed"] == 3
    assert all(e.startswith("Connect") for e in res["errors"])


def test_cli_end_to_end(fake_server, tmp_path, capsys):
    from plinth.cli import main

    _, url = fake_server(ttft=0.01, itl=0.005)
    out = tmp_path / "cli.json"
    rc = main(["bench", "serve", "--base-url", url, "--model", "fake-model", "--scenario", "long-input", "--scale",
               "0.01", "--num-prompts", "2", "--max-concurrency", "2", "--disable-tqdm", "--save-result", str(out),
               "--metric-percentiles", "50,90,99"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Median TTFT (ms):" in text and "P90 ITL (ms):" in text
    res = json.loads(out.read_text())
    assert res["scenario"] == "long-input" and res["input_len"] == 61 and res["output_len"] == 20
    assert "p90_tpot_ms" in res and "p50_e2el_ms" in res


# ---------------------------------------------------------------------------
# no server at all
# ---------------------------------------------------------------------------


def test_calculate_metrics_arithmetic():
    a = bs.RequestOutput(success=True, prompt_len=10, output_tokens=3, ttft=0.1, itl=[0.02, 0.03], latency=0.15,
                         start_time=0.0, chunk_times=[0.1, 0.12, 0.15])
    b = bs.RequestOutput(success=True, prompt_len=20, output_tokens=5, ttft=0.3, itl=[0.1] * 4, latency=0.7,
                         start_time=0.5, chunk_times=[0.8, 0.9, 1.0, 1.1, 1.2])
    c = bs.RequestOutput(success=False, error="HTTP 500: x", prompt_len=99)
    m = bs.calculate_metrics([a, b, c], duration=2.0, percentiles=[50, 99])
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 4.0 and m["total_token_throughput"] == 19.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT: (0.15 - 0.1) / 2 = 25 ms and (0.7 - 0.3) / 4 = 100 ms
    assert m["mean_tpot_ms"] == pytest.approx(62.5) and m["p50_tpot_ms"] == pytest.approx(62.5)
    # ITL: all gaps pooled: 20, 30, 100, 100, 100, 100
    assert m["mean_itl_ms"] == pytest.approx(75.0) and m["median_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx(425.0)
    # content chunks per 1-second bucket: a's 3 and b's 0.8 and 0.9 in second 0, b's other 3 in second 1
    assert m["max_output_tokens_per_s"] == 5.0
    assert m["max_concurrent_requests"] == 2


def test_scenarios_scale_and_explicit_options_win():
    import argparse

    p = argparse.ArgumentParser()
    bs.add_arguments(p)
    cfg = bs.config_from_args(p.parse_args(["--scenario", "long-input"]))
    assert (cfg.dataset, cfg.input_len, cfg.output_len) == ("random", 768, 256)  # 6k / 2k at 1/8
    cfg = bs.config_from_args(p.parse_args(["--scenario", "long-thinking", "--output-len", "10", "--scale", "0.25"]))
    assert (cfg.input_len, cfg.output_len) == (512, 10)
    cfg = bs.config_from_args(p.parse_args(["--scenario", "short-chat"]))
    assert cfg.dataset == "sharegpt-like"
    cfg = bs.config_from_args(p.parse_args([]))
    assert (cfg.dataset, cfg.input_len, cfg.output_len, cfg.num_prompts) == ("random", 128, 128, 32)
    assert cfg.request_rate == float("inf") and cfg.ignore_eos is True


def test_datasets_are_seeded_and_fit_lengths():
    words = lambda text: len(text.split())  # noqa: E731
    cfg = bs.BenchConfig(dataset="random", input_len=50, output_len=7, range_ratio=0.2, num_prompts=20, seed=3)
    a = bs.build_requests(cfg, words)
    b = bs.build_requests(cfg, words)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(40 <= r.prompt_len <= 60 and len(r.prompt.split()) == r.prompt_len for r in a)
    assert all(5 <= r.expected_output_len <= 9 for r in a) and len({r.expected_output_len for r in a}) > 1
    fixed = bs.build_requests(bs.BenchConfig(input_len=30, output_len=5, num_prompts=5), words)
    assert {r.prompt_len for r in fixed} == {30} and {r.expected_output_len for r in fixed} == {5}
    # prompt k does not depend on how many prompts there are
    more = bs.build_requests(bs.BenchConfig(input_len=30, output_len=5, num_prompts=8), words)
    assert [r.prompt for r in more[:5]] == [r.prompt for r in fixed]


def test_fit_words_with_a_lumpy_counter():
    import random

    count = lambda text: len(text) // 3  # noqa: E731
    for target in (1, 7, 64, 300):
        text, n = bs.fit_words(random.Random(target), target, count)
        assert n == count(text) and abs(n - target) <= 3


def test_sharegpt_like_follows_the_stated_distribution():
    import math

    import numpy as np

    pairs = bs.sample_lengths_sharegpt_like(np.random.default_rng(0), 20000)
    ins = np.array([p[0] for p in pairs])
    outs = np.array([p[1] for p in pairs])
    p = bs.SHAREGPT_LIKE
    assert ins.min() >= 4 and ins.max() <= p["max_input"] and (ins + outs).max() <= p["max_total"]
    med_in = math.exp(math.log(p["input_mean"]) - p["input_sigma"] ** 2 / 2)
    med_out = math.exp(math.log(p["output_mean"]) - p["output_sigma"] ** 2 / 2)
    assert abs(np.median(ins) / med_in - 1) < 0.05 and abs(np.median(outs) / med_out - 1) < 0.05
    assert abs(ins.mean() / p["input_mean"] - 1) < 0.08 and abs(outs.mean() / p["output_mean"] - 1) < 0.08
    scaled = bs.sample_lengths_sharegpt_like(np.random.default_rng(0), 2000, scale=1 / 8)
    assert abs(np.mean([s[1] for s in scaled]) / (p["output_mean"] / 8) - 1) < 0.1


def test_module_import_is_light_and_help_works():
    code = ("import sys, plinth.bench.serve; heavy = {'httpx', 'numpy', 'matplotlib', 'tqdm', 'transformers', "
            "'tokenizers', 'torch'} & set(sys.modules); assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "plinth.cli", "bench", "serve", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for flag in ("--base-url", "--scenario", "--dataset", "--max-concurrency", "--request-rate", "--plot", "1/8"):
        assert flag in out
