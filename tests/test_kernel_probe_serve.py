"""A kernel path that dies in the cpukernels start-up probe (probe.py) never
takes the server down: `platform serve` on the default model, with the AVX2
build's linear kernel forced to die in the probe's child, starts on the next
path (the portable build), answers both official clients, and `platform
plugins` says what was dropped and why."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from server_fixtures import smollm2_missing, wait_until_healthy
from test_server_cli import free_port

PLATFORM = str(Path(sys.executable).with_name("platform"))


def _avx2_cpu() -> bool:
    from plinth.api import load_accelerator

    isa = set(load_accelerator("cpu").info().isa)
    return platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma"} <= isa


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two sets of kernel builds on a cold cache (the AVX2 and the portable ones)
def test_a_kernel_that_dies_in_the_probe_leaves_the_server_serving():
    why = smollm2_missing()
    if why:
        pytest.skip(why)
    if not _avx2_cpu():
        pytest.skip("needs an x86 CPU with AVX2 (the build whose kernel the test makes die)")
    from plinth_plugin_cpukernels.probe import FAULT_ENV

    env = dict(os.environ, PLINTH_CPU_ISA="avx2,fma", **{FAULT_ENV: "on avx2+fma (fp32 fma)=SIGILL"})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [PLATFORM, "serve", "--port", str(port), "--backend", "cpukernels", "--max-model-len", "512", "--kv-cache-memory", "0.25"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        wait_until_healthy(proc, url, timeout=1500)  # the portable build's compile, on a cold cache
        import anthropic
        import openai

        oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        done = oai.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=4, temperature=0)
        assert done.usage.completion_tokens == 4 and done.choices[0].text.startswith(" Paris")
        msg = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
            model="SmolLM2-135M-Instruct", max_tokens=4, messages=[{"role": "user", "content": "Hi!"}]
        )
        assert msg.content[0].text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log = proc.stdout.read()
    # the reason is logged once, with what runs instead
    assert log.count("avx2: probe died with SIGILL in linear_small float32 on avx2+fma (fp32 fma)") == 1, log
    shown = subprocess.run([PLATFORM, "plugins", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    row = next(r for r in json.loads(shown.stdout)["plugins"] if r["category"] == "backend" and r["name"] == "cpukernels")
    assert row["status"] == "ok", row
    lines = {line for caps in row["capabilities"].values() for line in caps["dropped_paths"]}
    assert len(lines) == 1, lines
    (line,) = lines
    assert line.startswith("avx2: probe died with SIGILL in linear_small float32 on avx2+fma (fp32 fma) rows=1")
    assert line.endswith("; using scalar")
    text = subprocess.run([PLATFORM, "plugins"], env=env, capture_output=True, text=True, timeout=300).stdout
    assert "kernel path dropped: avx2: probe died with SIGILL" in text
