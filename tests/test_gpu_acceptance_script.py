"""bench/gpu/acceptance.sh --dry-run lists every step the GPU acceptance
runs, within its 8-minute budget, without running any (no GPU here)."""

from __future__ import annotations

import pathlib
import py_compile
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = ("install", "cuda", "kernels", "smollm2", "moe", "fp8", "budget", "decode", "summary")


def test_dry_run_lists_every_step_within_8_minutes():
    out = subprocess.run(["bash", str(ROOT / "bench/gpu/acceptance.sh"), "--dry-run"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    listed = [line.split()[0] for line in out.stdout.splitlines()[1:] if line and line.split()[0] in STEPS]
    assert listed == list(STEPS)
    total = int(out.stdout.split("time limits add up to ")[1].split("s")[0])
    assert total <= 480
    assert "--no-index" in out.stdout  # offline: carried wheels only
    for step in ("smollm2", "moe", "fp8", "budget", "decode"):
        assert f"acceptance_checks.py {step}" in out.stdout
    py_compile.compile(str(ROOT / "bench/gpu/acceptance_checks.py"), doraise=True)
