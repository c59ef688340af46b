"""bench/npu/acceptance.sh: --dry-run prints every step and runs nothing; its
embedded Python compiles; here (no NPU) a real run stops at step 1 naming
what cannot run."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[4]
SCRIPT = ROOT / "bench" / "npu" / "acceptance.sh"


def _env(out: pathlib.Path) -> dict[str, str]:
    bin_dir = pathlib.Path(sys.executable).parent
    return dict(os.environ, OUT=str(out), PLATFORM=str(bin_dir / "platform"), PYTHON=sys.executable)


def test_dry_run_prints_the_steps_and_runs_nothing(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=_env(out), timeout=60)
    assert proc.returncode == 0, proc.stderr
    steps = re.findall(r"^== (\d)\.", proc.stdout, flags=re.M)
    assert steps == ["0", "1", "2", "3", "4"], proc.stdout
    for needle in ("plugins --json", "check_backend('dlinfer'", "--backend dlinfer", "--backend torch", "bench offline --device ascend"):
        assert needle in proc.stdout, needle
    assert not out.exists()


def test_embedded_python_compiles():
    text = SCRIPT.read_text()
    blocks = re.findall(r"<<'PY'\n(.*?)\nPY\n", text, flags=re.S)
    assert len(blocks) == 3
    for block in blocks:
        compile(block, str(SCRIPT), "exec")


@pytest.mark.slow  # runs `platform plugins`
def test_a_real_run_here_stops_at_the_availability_step(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=_env(out), timeout=300)
    assert proc.returncode != 0
    assert "accelerator ascend cannot run here" in proc.stderr + proc.stdout
    assert (out / "plugins.json").exists() and not (out / "conformance.txt").exists()
