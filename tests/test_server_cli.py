"""`platform serve`: its options, start-up failures that exit 2 with a clear
message, and (slow) the real thing: the default model served on a free port,
both official clients, and a clean stop on SIGINT."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_fixtures import smollm2_missing, wait_until_healthy

PLATFORM = str(Path(sys.executable).with_name("platform"))


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PLATFORM, *args], capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_cli_is_cheap_to_import():
    code = "import sys, plinth.server.cli; bad = [m for m in ('fastapi', 'uvicorn', 'torch') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_default_model_name():
    from plinth.server.cli import default_model_name

    assert default_model_name(None) == "SmolLM2-135M-Instruct"
    assert default_model_name("/models/x") == "/models/x"


def test_serve_help_lists_the_options():
    out = run("serve", "--help").stdout
    for flag in (
        "--host", "--port", "--api-key", "--served-model-name", "--max-model-len", "--max-num-seqs", "--page-size",
        "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-metrics", "--device", "--backend", "--a2a",
        "--kv-connector", "--tp", "--ep", "--max-request-body-size", "--max-waiting-requests",
    ):  # fmt: skip
        assert flag in out, flag


def test_busy_port_exits_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = run("serve", "--port", str(port))
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr


def test_unknown_device_exits_2():
    r = run("serve", "--port", str(free_port()), "--device", "no-such-device")
    assert r.returncode == 2, r.stderr
    assert "no-such-device" in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_parser_exits_2_before_the_model_loads():
    # the model does not exist: had it been loaded first, that would be the error
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        r = run("serve", "/no/such/model", "--port", str(free_port()), flag, "no-such-parser")
        assert r.returncode == 2, r.stderr
        assert "no-such-parser" in r.stderr and "/no/such/model" not in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_platform_serve_default_model():
    why = smollm2_missing()
    if why:
        pytest.skip(why)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PLINTH_API_KEY="k")
    proc = subprocess.Popen(
        [PLATFORM, "serve", "--port", str(port), "--max-model-len", "1024", "--kv-cache-memory", "0.5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        wait_until_healthy(proc, url, timeout=240)
        import anthropic
        import openai

        oai = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        (model,) = [m.id for m in oai.models.list().data]
        assert model == "SmolLM2-135M-Instruct"
        r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=5)
        assert r.choices[0].message.content
        a = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
        m = a.messages.create(model=model, max_tokens=5, messages=[{"role": "user", "content": "Hi!"}])
        assert m.content[0].text
        assert httpx.post(url + "/v1/chat/completions", json={}).status_code == 401  # $PLINTH_API_KEY
        with httpx.Client() as keep_alive:  # TCP_NODELAY on the socket platform serve binds
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                keep_alive.get(url + "/health")
                times.append(time.perf_counter() - t0)
        assert sorted(times)[2] < 0.025, times
        v = httpx.get(url + "/version").json()
        assert v["engine"]["device"] == "cpu" and v["engine"]["model_loader"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log = proc.stdout.read()
    assert rc == 0, log
    assert f"http://127.0.0.1:{port}" in log  # the URL is logged
