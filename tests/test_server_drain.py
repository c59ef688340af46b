"""`platform serve` on SIGTERM drains: new requests get 503 with the reason,
/ready turns 503 while /health stays 200, a stream running at the signal
finishes, one still running after --shutdown-timeout ends cleanly with
finish_reason "abort" (the official openai client reads it to [DONE]), the
KV connector's saves are flushed to its disk tier and the server exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_fixtures import wait_until_healthy
from tiny_models import tiny_model_dir

pytest.importorskip("plinth_plugin_kv_local")

PLATFORM = str(Path(sys.executable).with_name("platform"))
SHUTDOWN_TIMEOUT = 0.75
LONG = 960  # tokens (the tiny model holds 1024 positions): more than it makes in SHUTDOWN_TIMEOUT seconds on a quiet CPU (900 finished within 1.5 s in CI)
SHORT = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_drains_streams_in_flight_then_exits_0(tiny_root, tmp_path):
    import openai

    model = tiny_model_dir("llama", tiny_root)
    disk = tmp_path / "kv"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [PLATFORM, "serve", model, "--port", str(port), "--device", "cpu", "--backend", "torch", "--dtype", "float32",
         "--num-pages", "256", "--max-num-batched-tokens", "256", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
         "--kv-connector", "local", "--kv-connector-config", json.dumps({"cpu_bytes": 0, "disk_dir": str(disk)})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_until_healthy(proc, url, timeout=120)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        name = client.models.list().data[0].id
        results: dict[str, tuple[int, str | None]] = {}
        errors: list[BaseException] = []
        started = {"long": threading.Event(), "short": threading.Event()}

        def stream(key: str, prompt: list[int], max_tokens: int) -> None:
            try:
                chunks = client.completions.create(
                    model=name, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                )  # fmt: skip
                reason, tokens = None, None
                for chunk in chunks:  # to [DONE]: an error here fails the test
                    started[key].set()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        reason = chunk.choices[0].finish_reason
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                results[key] = (tokens, reason)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                started[key].set()

        threads = [
            threading.Thread(target=stream, args=("long", list(range(1, 40)), LONG)),
            threading.Thread(target=stream, args=("short", list(range(50, 90)), SHORT)),
        ]
        threads[0].start()
        assert started["long"].wait(60), "the long stream never started"
        threads[1].start()
        assert started["short"].wait(60), "the short stream never started"
        assert not errors, errors

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        refused = httpx.post(url + "/v1/completions", json={"model": name, "prompt": [1, 2, 3], "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503, refused.text
        assert "shutting down" in refused.json()["error"]["message"]
        ready = httpx.get(url + "/ready", timeout=5)
        assert ready.status_code == 503 and "shutting down" in ready.json()["status"]
        assert httpx.get(url + "/health", timeout=5).status_code == 200  # alive while draining

        for t in threads:
            t.join(60)
        assert not errors, errors
        assert results["short"] == (SHORT, "length")  # running at the signal: it finished
        tokens, reason = results["long"]
        assert reason == "abort" and tokens < LONG, results["long"]  # aborted after the timeout, cleanly
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < SHUTDOWN_TIMEOUT + 20
        out = proc.stdout.read()
        assert "Traceback" not in out, out
        assert any(disk.rglob("*")), "the KV connector's disk tier is empty"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
