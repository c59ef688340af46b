"""check() and its attention backend's problems() with every reason, a
forbidden page size refused at start-up, and ``auto`` honouring an
accelerator that prefers dlinfer."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from plinth.api import ModelConfig, PluginError, SelectionContext
from plinth_plugin_dlinfer.attention import PAGE_SIZES, DlinferAttention
from plinth_plugin_dlinfer.backend import DlinferBackend

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
    assert DlinferBackend.validate(SelectionContext(accelerator=npu, dtype=torch.bfloat16)) == []
    assert DlinferBackend.validate(SelectionContext(accelerator=npu, dtype=torch.float16)) == []
    reasons = DlinferBackend.validate(SelectionContext(accelerator=npu, dtype=torch.float32))
    assert reasons == ["dtype float32 is not one of float16, bfloat16"]  # its attention backend's dtypes


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
        return DlinferBackend.validate(SelectionContext(accelerator=npu, dtype=torch.float16, model=m))

    assert reasons(model()) == []
    assert "sliding-window" in reasons(model(sliding_window=4096))[0]
    assert "soft-caps" in reasons(model(attn_logit_softcap=50.0))[0]
    assert "MLA" in reasons(model(v_head_dim=4))[0]


@pytest.mark.parametrize(
    "family, config, window",
    [
        # Mistral / Mixtral: a plain sliding_window every layer uses, no flag (the case the
        # raw-config check missed: it looked only for use_sliding_window and layer_types)
        ("MistralForCausalLM", {"sliding_window": 64}, 64),
        ("Qwen2ForCausalLM", {"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1}, 64),
        ("Qwen2ForCausalLM", {"sliding_window": 64, "use_sliding_window": False}, None),  # written but unused
        ("LlamaForCausalLM", {}, None),
    ],
)
def test_a_loaders_windows_are_what_it_declines(tmp_path, fake_npu, family, config, window):
    """The llama plugin's config as it reads it (ModelConfig.sliding_window)
    decides: Mistral's plain sliding_window is refused with its reason."""
    import json

    from plinth.api import ModelSource
    from plinth_plugin_llama.loader import LlamaLoader

    cfg = {"architectures": [family], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, **config}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    source = ModelSource(path=str(tmp_path), format="hf", architecture=family, hf_config=cfg)
    model = LlamaLoader().load_config(source)
    assert model.sliding_window == window
    npu = _accelerator(fake_npu, "fakenpu")
    reasons = DlinferBackend.validate(SelectionContext(accelerator=npu, dtype=torch.float16, model=model, page_size=16))
    if window:
        assert reasons == [f"{family} uses sliding-window attention (window {window}), which dlinfer's paged attention ops do not take"]
    else:
        assert reasons == []


def test_page_size_rule():
    for ok in (16, 32, 64, 128, 256):
        assert PAGE_SIZES.problem(ok) is None
        assert DlinferAttention.problems(SelectionContext(page_size=ok)) == []
    for bad in (1, 7, 8, 24, 48, 96, 100):
        assert PAGE_SIZES.problem(bad) == f"page size {bad} is not at least 16 and a power of two"
        assert DlinferAttention.problems(SelectionContext(page_size=bad)) == [f"page size {bad} is not at least 16 and a power of two, as its kernels need"]


@pytest.mark.slow  # builds and loads a tiny model
@pytest.mark.parametrize("page_size", [7, 48])
def test_forbidden_page_size_refused_at_start_up(tmp_path, fake_npu, page_size):
    sys.path.insert(0, str(ROOT / "tests"))
    from plinth import LLM
    from tiny_models import tiny_model_dir

    path = tiny_model_dir("llama", str(tmp_path))
    with pytest.raises(PluginError, match=f"backend dlinfer .*page size {page_size} is not at least 16 and a power of two"):
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


def test_check_imports_what_the_backend_imports_in_a_child_process(fake_npu, monkeypatch):
    """dlinfer-ascend imports lmdeploy at import time (the fake does as v0.2.7
    does): without it check() says so, from a child process, and the parent
    never imported dlinfer."""
    from plinth_plugin_dlinfer.backend import import_problem

    npu = _accelerator(fake_npu, "fakenpu")
    ctx = SelectionContext(accelerator=npu, dtype=torch.float16)
    assert DlinferBackend.check(ctx) == []  # with the fake lmdeploy beside the fake dlinfer
    lmdeploy_dirs = [p for p in sys.path if p.endswith("fake_lmdeploy")]
    assert lmdeploy_dirs
    for p in lmdeploy_dirs:
        monkeypatch.setattr(sys, "path", [q for q in sys.path if q != p])
    import_problem.cache_clear()
    reasons = DlinferBackend.check(ctx)
    assert len(reasons) == 1 and "dlinfer cannot be imported (checked in a child process)" in reasons[0], reasons
    assert "No module named 'lmdeploy'" in reasons[0] and "plinth-plugin-dlinfer[ascend]" in reasons[0]
    assert "dlinfer" not in sys.modules and "lmdeploy" not in sys.modules
    with pytest.raises(PluginError, match="No module named 'lmdeploy'"):
        fake_npu.select("backend", "dlinfer", ctx)


def test_the_fake_imports_attention_and_moe_as_upstream(fake_dlinfer_without_lmdeploy):
    """importing dlinfer imports the vendor, its torch_npu_ops, its attention
    module and LMDeploy's graph runner (dlinfer v0.2.7 torch_npu_ops.py:19-20,
    attention.py:4-8, ascend_cudagraph.py:14-21)."""
    with pytest.raises(ModuleNotFoundError, match="No module named 'lmdeploy'"):
        import dlinfer.ops  # noqa: F401
    assert "dlinfer.vendor.ascend.attention" not in sys.modules or "dlinfer.vendor.ascend.moe" not in sys.modules


def test_an_older_api_is_refused_with_the_reason(fake_npu, tmp_path, monkeypatch):
    """dlinfer-ascend 0.2.7 (PyPI) has no q_seq_len in paged_decode_attention,
    which this backend passes: check() says so instead of a misread argument
    at the first decode."""
    from plinth_plugin_dlinfer.backend import import_problem

    old = tmp_path / "old"
    shutil.copytree(pathlib.Path(__file__).parent / "fake_dlinfer", old)
    llm = old / "dlinfer" / "ops" / "llm.py"
    llm.write_text(llm.read_text().replace("    q_seq_len: Tensor,\n    kv_seq_len: Tensor,\n    max_kv_seq_len: int,", "    kv_seq_len: Tensor,\n    max_kv_seq_len: int,", 1))
    monkeypatch.syspath_prepend(str(old))
    import_problem.cache_clear()
    reasons = DlinferBackend.check(SelectionContext(accelerator=_accelerator(fake_npu, "fakenpu"), dtype=torch.float16))
    assert len(reasons) == 1 and "paged_decode_attention takes no q_seq_len" in reasons[0] and "v0.2.8" in reasons[0], reasons
