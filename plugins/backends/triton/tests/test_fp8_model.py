"""An FP8 checkpoint through the triton backend (under the interpreter): the
llama loader finds the backend's declared ``fp8`` capability and keeps the dense layers'
projections in FP8 (q/k/v and gate/up fused with their block scales), which
the backend packs for its weight-only kernel here (W8A8 needs native FP8).
Logits within 1e-3 of the dequantized twin run by transformers."""

from __future__ import annotations

import logging
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "plugins" / "models" / "llama" / "tests"))

TOLERANCE = 1e-3
PROMPTS = [[5, 17, 99, 3], list(range(40, 61))]


def triton_ops():
    from plinth.api import SelectionContext, load_accelerator
    from plinth.testing import op_table

    return op_table(SelectionContext(accelerator=load_accelerator("cpu"), dtype=torch.float32), backend="triton")


def triton_attention(ops):
    from plinth.api import SelectionContext, load_accelerator
    from plinth.testing import attention_backend

    return attention_backend(SelectionContext(accelerator=load_accelerator("cpu"), dtype=torch.float32), "triton", ops)


@pytest.mark.parametrize("scheme", ["block", "tensor"])
def test_fp8_checkpoint_kept_in_fp8(tmp_path, scheme, caplog):
    from driver import PagedDriver
    from plinth.api import LoadContext, ModelSource, load_hf_config
    from plinth_plugin_llama.loader import LlamaLoader
    from plinth_plugin_triton.fp8 import FP8Linear
    from tiny_fp8 import save_fp8_and_twin
    from transformers import AutoModelForCausalLM

    fp8_dir, twin = save_fp8_and_twin(str(tmp_path), scheme)
    ops = triton_ops()
    hf = load_hf_config(fp8_dir)
    source = ModelSource(path=fp8_dir, format="hf", architecture=hf["architectures"][0], hf_config=hf)
    loader = LlamaLoader()
    cfg = loader.load_config(source)
    with caplog.at_level(logging.INFO, logger="plinth.llama"):
        model = loader.load_model(source, cfg, LoadContext(device=torch.device("cpu"), dtype=torch.float32, ops=ops, attention=triton_attention(ops), progress=False))
    assert "kept in FP8, the backend's weight_only path" in caplog.text and "8 projections kept in FP8" in caplog.text
    for layer in model.layers:
        for attr in ("qkv", "o_proj", "gate_up", "down"):
            w = getattr(layer, attr)
            assert type(w) is FP8Linear and w.qweight.dtype == torch.float8_e4m3fn and w.mode == "weight_only", attr
    assert model.layers[0].qkv.shape == (256 + 128 + 128, 256)
    ours = PagedDriver(model, cfg, page_size=16).prefill_logits(PROMPTS)
    ref = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    with torch.no_grad():
        worst = max(float((a - ref(torch.tensor([p])).logits[0]).abs().max()) for a, p in zip(ours, PROMPTS))
    assert worst < TOLERANCE, f"max |logit diff| {worst:.3g}"
