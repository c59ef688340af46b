"""check() with every reason, a forbidden page size refused at start-up, and
``auto`` honouring an accelerator that prefers dlinfer."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from plinth.api import ModelConfig, PluginError, SelectionContext
from plinth_plugin_dlinfer.backend import DlinferBackend, page_size_problem

ROOT = pathlib.Path(__file__).resolve().parents[4]


def _accelerator(registry, name):
    return registry.get("accelerator", name).load()()


def _cpu():
    from plinth.testing import discover_all

    return _accelerator(discover_all(), "cpu")


def test_dlinfer_absent(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "dlinfer" else real(name, *a))
    reasons = DlinferBackend.check(SelectionContext(accelerator=_cpu(), dtype=torch.bfloat16))
    assert len(reasons) == 2, reasons
    assert "dlinfer is not installed" in reasons[0] and "dlinfer-ascend" in reasons[0]
    assert "no NPU, MLU or MACA device" in reasons[1] and "the chosen device is cpu" in reasons[1]


def test_fake_present_but_no_device(fake_dlinfer):
    """The fake says vendor ascend; the cpu accelerator is no NPU."""
    reasons = DlinferBackend.check(SelectionContext(accelerator=_cpu(), dtype=torch.float16))
    assert reasons == ["no NPU device: dlinfer (ascend) runs on npu devices, the chosen device is cpu"]


def test_fake_on_an_npu(fake_npu):
    npu = _accelerator(fake_npu, "fakenpu")
    assert DlinferBackend.check(SelectionContext(accelerator=npu, dtype=torch.bfloat16)) == []
    assert DlinferBackend.check(SelectionContext(accelerator=npu, dtype=torch.float16)) == []
    reasons = DlinferBackend.check(SelectionContext(accelerator=npu, dtype=torch.float32))
    assert reasons == ["dtype float32: dlinfer's Ascend attention kernels take float16 or bfloat16"]


@pytest.mark.parametrize(
    "vendor, expected",
    [
        ("camb", "dlinfer was built for camb; this backend implements ascend's KV cache layout"),
        ("maca", "dlinfer was built for maca; this backend implements ascend's KV cache layout"),
        ("tpu", "dlinfer was built for vendor 'tpu', which this backend does not know"),
        (None, "has no vendor/vendor.yaml"),
    ],
)
def test_the_vendor_dlinfer_was_built_for(tmp_path, monkeypatch, fake_dlinfer, vendor, expected):
    copy = tmp_path / "other"
    shutil.copytree(fake_dlinfer, copy)
    yaml = copy / "dlinfer" / "vendor" / "vendor.yaml"
    if vendor is None:
        yaml.unlink()
    else:
        yaml.write_text(f"dispatch_key: PrivateUse1\nvendor: {vendor}\n")
    monkeypatch.syspath_prepend(str(copy))
    reasons = DlinferBackend.check(SelectionContext())
    assert len(reasons) == 1 and expected in reasons[0], reasons


def test_model_features_it_cannot_run(fake_npu):
    npu = _accelerator(fake_npu, "fakenpu")

    def model(**kw):
        raw = kw.pop("raw", {})
        return ModelConfig(architecture="X", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                           head_dim=8, max_model_len=8, raw=raw, **kw)

    def reasons(m):
        return DlinferBackend.check(SelectionContext(accelerator=npu, dtype=torch.float16, model=m))

    assert reasons(model()) == []
    assert "sliding-window" in reasons(model(raw={"use_sliding_window": True}))[0]
    assert "sliding-window" in reasons(model(raw={"layer_types": ["full_attention", "sliding_attention"]}))[0]
    assert "soft-caps" in reasons(model(raw={"attn_logit_softcapping": 50.0}))[0]
    assert "MLA" in reasons(model(v_head_dim=4))[0]


def test_page_size_rule():
    for ok in (16, 32, 64, 128, 256):
        assert page_size_problem(ok) is None
    for bad in (1, 7, 8, 24, 48, 96, 100):
        assert f"page size {bad} is not allowed" in page_size_problem(bad)


@pytest.mark.slow  # builds and loads a tiny model
@pytest.mark.parametrize("page_size", [7, 48])
def test_forbidden_page_size_refused_at_start_up(tmp_path, fake_npu, page_size):
    sys.path.insert(0, str(ROOT / "tests"))
    from plinth import LLM
    from tiny_models import tiny_model_dir

    path = tiny_model_dir("llama", str(tmp_path))
    with pytest.raises(PluginError, match=f"page size {page_size} is not allowed by dlinfer's paged attention kernels"):
        LLM(path, device="fakenpu", dtype="float16", backend="dlinfer", page_size=page_size, num_pages=8,
            max_num_batched_tokens=32, load_progress=False, registry=fake_npu)


def test_auto_honours_the_accelerator_preference(fake_npu):
    npu = _accelerator(fake_npu, "fakenpu")
    assert npu.info().preferred_backends[0] == "dlinfer"
    ctx = SelectionContext(accelerator=npu, dtype=torch.float16)
    assert fake_npu.select("backend", "auto", ctx, prefer=npu.info().preferred_backends).name == "dlinfer"
    # on the cpu the same preference passes over it, with its reason
    cpu = SelectionContext(accelerator=_cpu(), dtype=torch.float16)
    assert fake_npu.select("backend", "auto", cpu, prefer=("dlinfer", "torch")).name == "torch"
    with pytest.raises(PluginError, match="no NPU device"):
        fake_npu.select("backend", "dlinfer", cpu)


@pytest.mark.slow  # a `platform plugins` process
def test_platform_plugins_lists_it_with_its_reasons():
    out = subprocess.run([str(pathlib.Path(sys.executable).parent / "platform"), "plugins"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("backend") and " dlinfer " in line)
    assert "plinth-plugin-dlinfer" in row and "unavailable" in row
    if importlib.util.find_spec("dlinfer") is None:
        assert "dlinfer is not installed" in row
    assert "the chosen device is cpu" in row  # judged on the accelerator auto takes here
