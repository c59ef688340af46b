#!/usr/bin/env python
"""Issue 23: `platform router` with llm-d's prefix scoring vs round-robin vs least-loaded.

    .venv/bin/python bench/router.py [--replicas 3] [--users 12] [--turns 4] [--threads 1] [--kv-fraction 0.5] [--json out.json]

Starts ``--replicas`` `platform serve` processes of the default model
(SmolLM2-135M-Instruct GGUF, bf16, the default backend), each with
``--cpu-threads`` torch threads, bound one thread per core to its own cores
(``--cpu-bind``) when the machine has a core for every thread, else unbound
(the OS shares the cores), and KV events (with a replay socket) on ipc
endpoints; then for each policy a `platform router` process in front of them
(tokenizing prompts itself: ``--model``), and runs the workload llm-d's
benchmarks use: multi-turn chats, each user under one of a few shared system
prompts, its history growing turn by turn (every turn sends the whole
conversation so far plus a new question), all users at once, each user's
turns in sequence. Each policy gets fresh system prompts and users (a salt),
so no policy is helped by an earlier one's cache.

What makes routing matter is the KV pool: each replica's holds
``--kv-fraction`` of the workload's working set (the system prompts plus
every user's final conversation, counted with the model's tokenizer), but
never less than its ``--max-num-seqs`` longest conversations. A router that
keeps a user on one replica needs a third of the working set per replica
(three replicas) and keeps hitting; round-robin sends every conversation
everywhere, so every replica cycles through all of it and keeps evicting.

Per policy: output tok/s over the run, TTFT p50/p90 (streamed, as the client
sees it), and the prefix-cache hit rate (``vllm:prefix_cache_hits /
vllm:prefix_cache_queries`` over the replicas, the run's deltas).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

PLATFORM = os.path.join(os.path.dirname(sys.executable), "platform")
PAGE = 16  # the replicas' KV page size (plinth's default)
WORDS = ("river mountain signal garden engine harbor lantern copper meadow orbit canvas thunder violet marble "
         "falcon cedar prism quartz willow ember glacier compass anchor beacon summit tundra").split()  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], log: str) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    cmd = [PLATFORM, *args, "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}", log


def wait_healthy(p: subprocess.Popen, url: str, log: str) -> None:
    end = time.monotonic() + 900
    while time.monotonic() < end:
        if p.poll() is not None:
            raise RuntimeError(f"{p.args} exited: {open(log).read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{p.args} did not start: {open(log).read()[-3000:]}")


def start(args: list[str], log: str) -> tuple[subprocess.Popen, str]:
    p, url, _ = launch(args, log)
    wait_healthy(p, url, log)
    return p, url


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(30)


def counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in urls:
        for line in httpx.get(u + "/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompts(a: argparse.Namespace, salt: int) -> list[str]:
    rng = random.Random(salt)
    return [f"[{salt}-{k}] You are assistant {k}. " + text(rng, a.system_words) for k in range(a.systems)]


def questions(a: argparse.Namespace, salt: int, u: int) -> list[str]:
    r = random.Random(salt * 1000 + u)
    return [text(r, a.question_words) + "?" for _ in range(a.turns)]


def kv_pages(a: argparse.Namespace, model: str) -> tuple[int, int, int]:
    """(pages per replica, working-set tokens, longest conversation in tokens) for ``--kv-fraction``."""
    from plinth.engine.startup import load_tokenizer

    tok = load_tokenizer(model)
    answer = " ".join(["word"] * a.max_tokens)  # an answer's length in tokens, about
    systems = system_prompts(a, 1)
    shared = sum(len(tok.encode(s)) for s in systems)
    longest, unique = 0, 0
    for u in range(a.users):
        msgs = [{"role": "system", "content": systems[u % a.systems]}]
        for q in questions(a, 1, u):
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]
        n = len(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=False), add_special_tokens=False))
        longest = max(longest, n)
        unique += n - len(tok.encode(systems[u % a.systems]))
    working = shared + unique
    floor = a.max_num_seqs * (longest + PAGE - 1) // PAGE + a.max_num_seqs
    return max(floor, int(a.kv_fraction * working / PAGE)), working, longest


async def one_turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    ttft = None
    out, n = [], 0
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    out.append(piece)
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t0), n, "".join(out)


async def workload(url: str, a: argparse.Namespace, salt: int) -> dict:
    systems = system_prompts(a, salt)
    ttfts: list[float] = []
    tokens = 0

    async def user(u: int, client: httpx.AsyncClient) -> None:
        nonlocal tokens
        msgs = [{"role": "system", "content": systems[u % a.systems]}]
        for q in questions(a, salt, u):
            msgs.append({"role": "user", "content": q})
            ttft, n, answer = await one_turn(client, url, model, msgs, a.max_tokens)
            ttfts.append(ttft)
            tokens += n
            msgs.append({"role": "assistant", "content": answer})

    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(user(u, client) for u in range(a.users)))
    wall = time.perf_counter() - t0
    ttfts.sort()

    def q(p: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))]

    return {"requests": len(ttfts), "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "ttft_p50_s": q(0.5), "ttft_p90_s": q(0.9)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica (--cpu-threads)")
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--systems", type=int, default=3, help="distinct shared system prompts")
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--question-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--policies", default="prefix,round-robin,least-loaded")
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--backend", default=None, help="the replicas' --backend (default: auto)")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="the replicas' --max-num-seqs")
    ap.add_argument("--kv-fraction", type=float, default=0.5,
                    help="each replica's KV pool as a fraction of the workload's working set (default 0.5)")
    ap.add_argument("--num-pages", type=int, default=None, help="the replicas' --num-pages (overrides --kv-fraction)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still stops its servers (the finally below)

    tmp = tempfile.mkdtemp(prefix="plinth-router-bench-")
    ncpu = os.cpu_count() or 1
    pin = ncpu >= a.replicas * a.threads
    model = a.model
    if model is None:
        from plinth.engine.model_source import default_model_path

        model = str(default_model_path())
    if a.num_pages:
        pages, working, longest = a.num_pages, 0, 0
    else:
        pages, working, longest = kv_pages(a, model)
    procs: list[subprocess.Popen] = []
    urls, logs, events, replays = [], [], [], []
    try:
        for i in range(a.replicas):
            ep, replay = f"ipc://{tmp}/kv{i}", f"ipc://{tmp}/replay{i}"
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ep, "replay_endpoint": replay}
            bind = f"{i * a.threads}-{(i + 1) * a.threads - 1}" if pin else "none"
            args = ["serve", model, *(["--backend", a.backend] if a.backend else []), "--num-pages", str(pages),
                    "--max-num-batched-tokens", "512", "--max-num-seqs", str(a.max_num_seqs),
                    "--cpu-threads", str(a.threads), "--cpu-bind", bind, "--kv-events-config", json.dumps(cfg)]  # fmt: skip
            p, url, log = launch(args, f"{tmp}/replica{i}.log")  # all at once: they load in parallel
            procs.append(p)
            urls.append(url)
            logs.append(log)
            events.append(ep)
            replays.append(replay)
        for p, url, log in zip(procs, urls, logs):
            wait_healthy(p, url, log)
        cores = (f"each bound to its own {a.threads} core(s)" if pin else f"unbound, sharing the machine's {ncpu} CPUs")
        print(f"{a.replicas} replicas, {a.threads} torch thread(s) each, {cores}; KV pool {pages} pages x {PAGE} tokens per replica"
              + (f" ({pages * PAGE / working:.0%} of the {working}-token working set; longest conversation {longest} tokens)" if working else "")
              + f"; {a.users} users x {a.turns} turns, {a.systems} system prompts of ~{a.system_words} words", flush=True)  # fmt: skip
        results = {}
        for k, policy in enumerate(a.policies.split(",")):
            rp, rurl = start(["router", "--replicas", *urls, "--kv-events", *events, "--kv-events-replay", *replays, "--model", model,
                              "--policy", policy, "--poll-interval", "0.5"], f"{tmp}/router-{policy}.log")  # fmt: skip
            try:
                h0, q0 = counters(urls)
                res = asyncio.run(workload(rurl, a, salt=k + 1))
                h1, q1 = counters(urls)
                res["prefix_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
            finally:
                stop(rp)
            results[policy] = res
            print(f"{policy:13s} {res['output_tok_s']:7.2f} out tok/s  TTFT p50 {res['ttft_p50_s']:6.3f} s  p90 {res['ttft_p90_s']:6.3f} s  "
                  f"prefix hit {res['prefix_hit_rate']:.1%}  ({res['requests']} requests, {res['wall_s']:.1f} s)", flush=True)  # fmt: skip
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"config": vars(a), "pinned": pin, "num_pages": pages, "working_set_tokens": working, "results": results}, f, indent=2)
    finally:
        for p in procs:
            stop(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
