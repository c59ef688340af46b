"""A real mooncake_master on 127.0.0.1 for the tests (free ports; stopped by its PID)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "tests"))  # tiny_models


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    def __init__(self) -> None:
        exe = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        if not os.path.exists(exe):
            pytest.fail("mooncake_master is not installed (make setup installs mooncake-transfer-engine-non-cuda)")
        self.exe = exe
        self.rpc, self.http, self.metrics = _free_port(), _free_port(), _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def config(self) -> dict:
        return {
            "metadata_server": f"http://127.0.0.1:{self.http}/metadata",
            "master_server_address": f"127.0.0.1:{self.rpc}",
            "protocol": "tcp",
            "global_segment_size": "64MB",  # size strings, as Mooncake's config reader takes them
            "local_buffer_size": "32 mb",
        }

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc}", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={self.http}",
             "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/health", timeout=1)
                # the metrics server can answer before the RPC and metadata
                # listeners are bound (a connector then saw "connection
                # refused" on the RPC port in CI): ready when all three are
                for port in (self.rpc, self.http):
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}") from None
                time.sleep(0.1)
        raise RuntimeError("mooncake_master did not become ready in 20 s")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            # a killed master can take a while to be reaped while the kernel
            # unmaps its segments (seen >10 s on a busy 2-core machine)
            self.proc.wait(120)


@pytest.fixture
def master():
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    m = Master()
    m.start()
    yield m
    m.kill()


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture
def master_down():
    """A master that is not running yet (ports chosen): the test starts it."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    m = Master()
    yield m
    m.kill()
