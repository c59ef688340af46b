"""Real `platform serve` / `platform proxy` processes on 127.0.0.1 for the
KV-connector tests (tests/ and plugins/kv_connectors/*/tests)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

import httpx

PLATFORM = os.path.join(os.path.dirname(sys.executable), "platform")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One server process; its log goes to a file (read on failure)."""

    def __init__(
        self, args: list[str], log_path: str, *, wait_s: float = 120.0, env: dict[str, str] | None = None,
        platform: str = PLATFORM, base_env: Mapping[str, str] = os.environ,
    ) -> None:  # fmt: skip
        """``platform``: another environment's console script, run with ``base_env`` (that environment's) plus ``env``."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [platform, *args, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env={**base_env, **(env or {})},
        )
        end = time.monotonic() + wait_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"{args[0]} did not come up in {wait_s}s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/health", timeout=5).json()

    def metrics(self) -> dict[str, float]:
        """Prometheus samples, name{labels} -> value."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                key, _, val = line.rpartition(" ")
                out[key] = float(val)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(8)  # a mooncake client whose master is gone takes ~13 s to close
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(60)  # reaping a killed server can be slow on a busy machine
        self._log.close()


def serve(model: str, log_path: str, *extra: str, connector: str | None = None, config: dict | None = None, **kw: Any) -> Proc:
    args = ["serve", model, "--dtype", "float32", "--backend", "torch", "--num-pages", "256", "--page-size", "16",
            "--served-model-name", "tiny", *extra]
    if connector:
        args += ["--kv-connector", connector]
    if config is not None:
        args += ["--kv-connector-config", json.dumps(config)]
    return Proc(args, log_path, **kw)


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for key, v in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total
