"""`platform plugins --device cuda` shows the FP8 path triton's capabilities
choose for the GPU it finds: the real cuda accelerator plugin on a simulated
CUDA runtime (torch.cuda's functions replaced, as its own tests do), the real
triton backend, the real CLI."""

from __future__ import annotations

import json
import types

import pytest
import torch
from plinth.cli import main


def _gpu(monkeypatch: pytest.MonkeyPatch, name: str, cap: tuple[int, int]) -> None:
    from plinth_plugin_cuda import accelerator as cuda

    monkeypatch.setattr(cuda, "_torch_version", lambda: "2.13.0")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace(total_memory=80 << 30))


@pytest.mark.parametrize(
    "name, cap, path",
    [("NVIDIA A100-SXM4-80GB", (8, 0), "weight_only_bits"), ("NVIDIA L40S", (8, 9), "weight_only"), ("NVIDIA H200", (9, 0), "w8a8")],
)
def test_platform_plugins_shows_the_fp8_path_for_the_gpu(monkeypatch, capsys, name, cap, path):
    _gpu(monkeypatch, name, cap)
    assert main(["plugins", "--json", "--device", "cuda"]) == 0
    rows = {(r["category"], r["name"]): r for r in json.loads(capsys.readouterr().out)["plugins"]}
    triton = rows[("backend", "triton")]
    assert triton["status"] == "ok", triton["reasons"]
    caps = triton["capabilities"]
    assert set(caps) == {"bfloat16", "float16", "float32"}  # every dtype the GPU offers
    for dtype_caps in caps.values():
        assert dtype_caps["fp8"] == path and f"sm_{cap[0]}{cap[1]}" in dtype_caps["fp8_why"]
    if path == "weight_only_bits":  # below sm_89: no float8 pointer reaches Triton
        assert "uint8" in caps["bfloat16"]["fp8_why"] and "sm_89" in caps["bfloat16"]["fp8_why"]
    assert "capabilities" not in rows[("backend", "cpukernels")]  # not usable on a GPU: nothing declared
    # the table says the same, once for the dtypes that share it
    assert main(["plugins", "--device", "cuda"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("backend") and " triton " in ln)
    assert f"; in bfloat16, float16, float32, FP8 weights {path}: " in line, line
