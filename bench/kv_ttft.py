"""KV connector benchmark (not a test): TTFT of a long shared prefix with the
store cold and warm (local and mooncake), TTFT while the Mooncake master is
down, and a prefill/decode pair behind `platform proxy` against one instance.

    .venv/bin/python bench/kv_ttft.py [--model PATH] [--prefix 2048] [--out results.json]

Every server is a real `platform serve` process on 127.0.0.1; "warm" is a
second process (B) that finds on the store the prefix another process (A)
computed; its own prefix cache is empty. Prompts are token ids (a shared
"system prompt" of --prefix tokens, then a short turn of its own).
"""

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from kv_servers import PLATFORM, Proc, free_port  # noqa: E402


def prompt(seed: int, n: int, turn: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)] + [rng.randrange(1000, 40000) for _ in range(24 + turn)]


def ttft(url: str, ids: list[int], max_tokens: int = 8) -> tuple[float, float, int]:
    """(time to the first token, end to end, cached tokens) of one streamed request."""
    t0 = time.monotonic()
    first = None
    cached = 0
    body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if first is None and d.get("choices") and d["choices"][0].get("text"):
                first = time.monotonic() - t0
            if d.get("usage"):
                cached = (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return first or float("nan"), time.monotonic() - t0, cached


def warm_up(url: str) -> None:
    """One short request first: a fresh server's first step pays one-time costs."""
    ttft(url, prompt(99999, 32, 0), 2)


def med(xs):
    return statistics.median(xs)


#: every server under the same OpenMP wait policy. Under load from other
#: processes, libgomp's default (spin, then sleep) made a server without a
#: connector ~4-5x slower than one with (whose extra threads tip libgomp into
#: passive waiting): PASSIVE for all keeps the comparisons about the KV path.
ENV = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def serve(args, name, *extra):
    base = ["serve", *([args.model] if args.model else []), "--served-model-name", "m", "--max-model-len",
            str(args.prefix + 512), "--kv-cache-memory", "1"]
    return Proc(base + list(extra), os.path.join(args.logs, name + ".log"), wait_s=300, env=ENV)


class Master:
    def __init__(self) -> None:
        self.exe = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc}", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={self.http}",
             "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for _ in range(200):
            try:
                httpx.get(f"http://127.0.0.1:{self.metrics}/health", timeout=1)
                return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("mooncake_master did not start")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def config(self) -> dict:
        return {"metadata_server": f"http://127.0.0.1:{self.http}/metadata", "master_server_address": f"127.0.0.1:{self.rpc}",
                "protocol": "tcp", "global_segment_size": 1 << 30, "local_buffer_size": 256 << 20, "deadline_s": 2.0}


def cold_warm(args, label, connector, config, seed, res):
    """A computes prompt(seed, turn 0) (cold store); B, a fresh process, serves turns 1..reps (warm)."""
    cfg = ["--kv-connector", connector, "--kv-connector-config", json.dumps(config)]
    a = serve(args, f"{label}-a", *cfg)
    try:
        warm_up(a.url)
        cold = [ttft(a.url, prompt(seed, args.prefix, 0))]
        time.sleep(1.0)  # saves are asynchronous
        # A stays up: a Mooncake client's values live in the memory segment it lends the store
        b = serve(args, f"{label}-b", *cfg)
    finally:
        if connector != "mooncake":
            a.stop()
    b.peer = a
    try:
        warm_up(b.url)
        warm, cold_b = [], []
        for t in range(1, args.reps + 1):  # interleaved: the machine's load drifts
            warm.append(ttft(b.url, prompt(seed, args.prefix, t)))  # A's prefix, through the store
            cold_b.append(ttft(b.url, prompt(seed + 1000 + t, args.prefix, 0)))  # a prefix nobody computed
        res[label] = {"cold_ttft_a": cold[0][0], "cold_ttft": [c[0] for c in cold_b], "warm_ttft": [w[0] for w in warm],
                      "warm_cached_tokens": [w[2] for w in warm], "cold_cached_tokens": [c[2] for c in cold_b]}
        res[label]["speedup"] = med(res[label]["cold_ttft"]) / med(res[label]["warm_ttft"])
        print(label, json.dumps(res[label]), flush=True)
        return b
    except BaseException:
        b.stop()
        a.stop()
        raise


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip", default="", help="comma-separated: local,mooncake,pd")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    work = tempfile.mkdtemp(prefix="kv-bench-")
    args.logs = work
    res: dict = {"prefix_tokens": args.prefix, "loadavg_before": open("/proc/loadavg").read().strip(), "env": ENV}
    info = subprocess.run([PLATFORM, "plugins"], capture_output=True, text=True).stdout
    res["accelerator"] = next((ln for ln in info.splitlines() if ln.startswith("accelerator") and " ok " in ln), "")
    try:
        if "local" not in skip:
            b = cold_warm(args, "local", "local", {"cpu_bytes": 0, "disk_dir": os.path.join(work, "kv-local")}, 11, res)
            b.stop()
        if "mooncake" not in skip and shutil.which("mooncake_master", path=os.path.dirname(sys.executable)):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
            m = Master()
            m.start()
            b = None
            try:
                b = cold_warm(args, "mooncake", "mooncake", m.config(), 21, res)
                m.kill()
                down = [ttft(b.url, prompt(40 + t, args.prefix, 0)) for t in range(args.reps)]
                res["mooncake_master_down"] = {"ttft": [d[0] for d in down], "e2e": [d[1] for d in down],
                                               "extra_ttft_vs_cold": med([d[0] for d in down]) - med(res["mooncake"]["cold_ttft"])}
                print("master down", json.dumps(res["mooncake_master_down"]), flush=True)
            finally:
                if b is not None:
                    b.stop()
                    b.peer.stop()
                m.kill()
        if "pd" not in skip:  # one instance and a PD pair up together, requests alternating
            kv = json.dumps({"cpu_bytes": 0, "disk_dir": os.path.join(work, "kv-pd")})
            single = serve(args, "single")
            pre = serve(args, "prefill", "--role", "prefill", "--kv-connector", "local", "--kv-connector-config", kv)
            dec = serve(args, "decode", "--role", "decode", "--kv-connector", "local", "--kv-connector-config", kv)
            px = Proc(["proxy", "--prefill", pre.url, "--decode", dec.url], os.path.join(work, "proxy.log"))
            try:
                warm_up(single.url)
                warm_up(px.url)
                one, pd = [], []
                for t in range(args.reps):
                    one.append(ttft(single.url, prompt(500 + t, args.prefix, 0), 32))
                    pd.append(ttft(px.url, prompt(600 + t, args.prefix, 0), 32))
                res["single"] = {"ttft": [r[0] for r in one], "e2e": [r[1] for r in one]}
                res["pd"] = {"ttft": [r[0] for r in pd], "e2e": [r[1] for r in pd], "decode_cached": [r[2] for r in pd]}
                print("single", json.dumps(res["single"]), flush=True)
                print("pd", json.dumps(res["pd"]), flush=True)
            finally:
                for p in (px, pre, dec, single):
                    p.stop()
    finally:
        res["load_after"] = open("/proc/loadavg").read().strip()
        print(json.dumps(res, indent=1, default=str))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, default=str)
        print("logs in", work, file=sys.stderr)


if __name__ == "__main__":
    main()
