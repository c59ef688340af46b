"""FP8 checkpoints (block-scaled 128x128 as DeepSeek-V3 / Qwen3-FP8, and per
tensor) load through the torch backend, which has no FP8 kernels: every FP8
weight is dequantized at load to the compute dtype (float32 here). Their
logits are within 1e-4 of the dequantized twin run by transformers (the same
real-valued weights: the difference is float32 summation order only)."""

from __future__ import annotations

import logging
import pathlib
import sys

import pytest
import torch
from driver import PagedDriver, torch_attention, torch_ops
from plinth.api import ConfigError, LoadContext, ModelSource, load_hf_config
from plinth.api import fuse_fp8_rows as fuse_rows
from plinth_plugin_llama.loader import LlamaLoader

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4] / "tests"))
from tiny_fp8 import quantize_block, save_fp8_and_twin  # noqa: E402

TOLERANCE = 1e-4
PROMPTS = [[5, 17, 99, 3], list(range(40, 77))]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fp8"))


def load(path: str, ops, dtype=torch.float32):
    hf = load_hf_config(path)
    source = ModelSource(path=path, format="hf", architecture=hf["architectures"][0], hf_config=hf)
    loader = LlamaLoader()
    cfg = loader.load_config(source)
    return loader.load_model(source, cfg, LoadContext(device=torch.device("cpu"), dtype=dtype, ops=ops, attention=torch_attention(), progress=False)), cfg


def twin_logits(twin: str) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in PROMPTS]


@pytest.mark.parametrize("scheme", ["block", "tensor"])
def test_fp8_checkpoint_matches_dequantized_twin(root, scheme, caplog):
    fp8_dir, twin = save_fp8_and_twin(root, scheme)
    ops = torch_ops()
    with caplog.at_level(logging.INFO, logger="plinth.llama"):
        model, cfg = load(fp8_dir, ops)
    assert "dequantized at load to float32" in caplog.text and "declare no fp8 path" in caplog.text
    assert model.layers[0].qkv.dtype == torch.float32  # weight-only: dense in the compute dtype
    ours = PagedDriver(model, cfg, page_size=16).prefill_logits(PROMPTS)
    worst = max(float((a - b).abs().max()) for a, b in zip(ours, twin_logits(twin)))
    assert worst < TOLERANCE, f"max |logit diff| {worst:.3g}"


def test_fp8_block_quantization_is_lossy_but_close(root):
    """The twin is not the original model: FP8 changed the weights (so the
    test above compares real FP8 values), by about FP8's 2^-4 relative step."""
    w = torch.randn(256, 384) * 0.06
    q, s = quantize_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    deq = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    rel = float((deq - w).norm() / w.norm())
    assert 1e-3 < rel < 0.06


def test_unknown_quant_method_fails_loudly(root):
    import json
    import shutil

    fp8_dir, _ = save_fp8_and_twin(root, "block")
    bad = pathlib.Path(root) / "awq"
    shutil.copytree(fp8_dir, bad, dirs_exist_ok=True)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="awq"):
        load(str(bad), torch_ops())


def test_fuse_rows_stacks_blocks_and_per_tensor_scales():
    from plinth.api import QuantizedWeight

    def qw(n, scale, block):
        return QuantizedWeight(format="fp8_e4m3", qweight=torch.zeros(n, 256, dtype=torch.float8_e4m3fn), scale=scale, shape=(n, 256), block_size=block)

    fused = fuse_rows([qw(256, torch.ones(2, 2), (128, 128)), qw(128, torch.ones(1, 2) * 2, (128, 128))])
    assert fused.shape == (384, 256) and fused.scale.shape == (3, 2) and fused.block_size == (128, 128)
    assert fuse_rows([qw(100, torch.ones(1, 2), (128, 128)), qw(128, torch.ones(1, 2), (128, 128))]) is None  # 100 rows: not whole blocks
    fused = fuse_rows([qw(3, torch.tensor(2.0), None), qw(2, torch.tensor([5.0]), None)])
    assert fused.scale.tolist() == [2, 2, 2, 5, 5] and fused.block_size is None


def test_fp8_weights_are_made_on_the_device_with_no_dense_copy_of_kept_projections(root, caplog):
    """The production placement code (LlamaLoader.load_model) with a backend
    that declares an FP8 path, on a device other than the host (``meta``: no
    memory, so a tensor that is not there shows): every tensor handed to the
    backend's pack_linear must already be on the model's device, and the kept
    projections reach it only in FP8 (no dense copy is packed first). Before,
    the FP8 weights stayed on the host (the triton fp8.pack got CPU tensors)
    and a dense copy of every projection was packed, then swapped."""
    from plinth.api import BackendCapabilities, OpTable, QuantizedWeight

    device = torch.device("meta")
    fp8_dir, _ = save_fp8_and_twin(root, "block")
    base = torch_ops()
    packed = []

    def pack_linear(weight):
        tensors = [weight.qweight, weight.scale] if isinstance(weight, QuantizedWeight) else [weight]
        assert all(t.device == device for t in tensors), f"pack_linear got a tensor on {[str(t.device) for t in tensors]}, not {device}"
        packed.append(weight)
        return weight

    ops = OpTable({**{n: getattr(base, n) for n in base.names()}, "pack_linear": pack_linear},
                  BackendCapabilities(fp8="weight_only", fp8_why="a test backend's FP8 path"))  # fmt: skip
    hf = load_hf_config(fp8_dir)
    source = ModelSource(path=fp8_dir, format="hf", architecture=hf["architectures"][0], hf_config=hf)
    loader = LlamaLoader()
    cfg = loader.load_config(source)
    with caplog.at_level(logging.INFO, logger="plinth.llama"):
        model = loader.load_model(source, cfg, LoadContext(device=device, dtype=torch.bfloat16, ops=ops, attention=torch_attention(), progress=False))
    kept = [w for w in packed if isinstance(w, QuantizedWeight)]
    assert len(kept) == 4 * cfg.num_layers and f"{4 * cfg.num_layers} projections kept in FP8" in caplog.text
    assert all(w.qweight.dtype == torch.float8_e4m3fn for w in kept)
    projection_shapes = {tuple(w.shape) for w in kept}
    dense = [tuple(w.shape) for w in packed if not isinstance(w, QuantizedWeight)]
    assert not projection_shapes & set(dense), f"dense copies packed of kept projections: {dense}"
    for layer in model.layers:
        assert all(isinstance(getattr(layer, a), QuantizedWeight) for a in ("qkv", "o_proj", "gate_up", "down"))
    assert all(t.device == device for t in model.weights() if isinstance(t, torch.Tensor))
