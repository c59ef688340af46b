"""Tiny random Mixtral, Qwen2-MoE (shared expert, a dense layer) and
Qwen3-MoE against transformers in float32: every prefill logit and 32 greedy
tokens through paged KV caches, experts through the torch backend's fused_moe."""

from __future__ import annotations

import pytest
import torch
from driver import PagedDriver, torch_attention, torch_ops
from plinth.api import LoadContext, ModelSource, load_hf_config
from plinth_plugin_llama.loader import LlamaLoader
from tiny_moe import prompts, reference, reference_greedy, saved_model

MODELS = ["qwen3moe", "qwen2moe", "mixtral"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny_moe"))


def load_ours(path: str):
    ops = torch_ops()
    hf = load_hf_config(path)
    source = ModelSource(path=path, format="hf", architecture=hf["architectures"][0], hf_config=hf)
    loader = LlamaLoader()
    cfg = loader.load_config(source)
    model = loader.load_model(source, cfg, LoadContext(device=torch.device("cpu"), dtype=torch.float32, ops=ops, attention=torch_attention(), progress=False))
    return model, ops, cfg, loader


@pytest.mark.parametrize("name", MODELS)
def test_prefill_logits_match_transformers(root, name):
    path = saved_model(name, root)
    model, ops, cfg, _ = load_ours(path)
    ours = PagedDriver(model, cfg, page_size=16).prefill_logits(prompts())
    worst = 0.0
    with torch.no_grad():
        for prompt, logits in zip(prompts(), ours):
            ref = reference(path)(torch.tensor([prompt])).logits[0]
            worst = max(worst, (logits - ref).abs().max().item())
    assert worst < 1e-4, f"max |logit diff| {worst:.3g}"


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_match_transformers(root, name):
    path = saved_model(name, root)
    model, ops, cfg, _ = load_ours(path)
    ours = PagedDriver(model, cfg, page_size=7, seed=1).greedy(prompts(), NEW_TOKENS, chunk=29)
    assert ours == reference_greedy(path, NEW_TOKENS)


def test_moe_config_and_layout(root):
    model, _, cfg, loader = load_ours(saved_model("qwen2moe", root))
    assert cfg.num_experts == 8 and "fused_moe" in loader.required_ops(cfg)
    moe = model.layers[0].moe
    assert moe is not None and model.layers[1].moe is None  # mlp_only_layers=[1]: a dense MLP
    assert moe.w13.shape == (8, 2 * 32, 64) and moe.w2.shape == (8, 64, 32)
    assert moe.shared_gate_up.shape == (2 * 48, 64) and moe.shared_gate.shape == (1, 64)
    assert (moe.top_k, moe.renormalize) == (3, False)
    mixtral, _, _, _ = load_ours(saved_model("mixtral", root))
    assert mixtral.layers[0].moe.renormalize and mixtral.layers[0].moe.shared_gate_up is None
