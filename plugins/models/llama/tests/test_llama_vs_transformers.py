"""Tiny random Llama-family models against transformers, in float32:
every prefill logit and 32 greedy tokens, through paged KV caches."""

from __future__ import annotations

import functools

import pytest
import torch
from driver import PagedDriver, torch_attention, torch_ops
from plinth.api import LoadContext, ModelSource, load_hf_config
from plinth_plugin_llama.loader import LlamaLoader

PROMPT_LENS = [3, 17, 40, 64, 101]
NEW_TOKENS = 32
VOCAB = 256


def tiny_config(name: str):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        # no eos: generate() would ban it before min_new_tokens, and we decode with no stop token
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if name == "llama":  # grouped-query attention
        return transformers.LlamaConfig(**common)
    if name == "llama3-tied-hd40":  # llama3 rope, tied embeddings, head_dim 40, multi-query
        cfg = dict(common, hidden_size=160, num_key_value_heads=1, tie_word_embeddings=True)
        return transformers.LlamaConfig(
            **cfg,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
        )
    if name == "llama-bias-yarn":  # attention and mlp biases, yarn rope
        return transformers.LlamaConfig(
            **common, attention_bias=True, mlp_bias=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
        )
    if name == "llama-linear-rope":
        return transformers.LlamaConfig(**common, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    if name == "qwen2":  # q/k/v biases
        return transformers.Qwen2Config(**common)
    if name == "qwen3":  # per-head q/k norms, head_dim 48 (not hidden / heads)
        return transformers.Qwen3Config(**common, head_dim=48)
    if name == "mistral":  # sliding window shorter than the prompts
        return transformers.MistralConfig(**common, sliding_window=24)
    raise ValueError(name)


MODELS = ["llama", "llama3-tied-hd40", "qwen2", "qwen3", "mistral"]
EXTRA_MODELS = ["llama-bias-yarn", "llama-linear-rope"]


@functools.cache
def saved_model(name: str, root: str) -> str:
    from transformers import AutoModelForCausalLM

    path = f"{root}/{name}"
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32)
    with torch.no_grad():  # larger than the default init: logits far from flat, no greedy near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return path


@functools.cache
def reference(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def reference_greedy(path: str) -> list[list[int]]:
    model = reference(path)
    out = []
    with torch.no_grad():
        for prompt in prompts():
            ids = torch.tensor([prompt])
            # an explicit mask: without one, generate masks out every token equal to pad_token_id
            ids = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def load_ours(path: str):
    ops = torch_ops()
    source = ModelSource(path=path, format="hf", architecture=load_hf_config(path)["architectures"][0], hf_config=load_hf_config(path))
    loader = LlamaLoader()
    cfg = loader.load_config(source)
    model = loader.load_model(source, cfg, LoadContext(device=torch.device("cpu"), dtype=torch.float32, ops=ops, attention=torch_attention(), progress=False))
    return model, ops, cfg


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny_llamas"))


@pytest.mark.parametrize("name", MODELS + EXTRA_MODELS)
def test_prefill_logits_match_transformers(root, name):
    path = saved_model(name, root)
    model, ops, cfg = load_ours(path)
    ours = PagedDriver(model, cfg, page_size=16).prefill_logits(prompts())
    ref_model = reference(path)
    worst = 0.0
    with torch.no_grad():
        for prompt, logits in zip(prompts(), ours):
            ref = ref_model(torch.tensor([prompt])).logits[0]
            worst = max(worst, (logits - ref).abs().max().item())
    assert worst < 1e-4, f"max |logit diff| {worst:.3g}"


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("page_size", [16, 48, 7])
def test_greedy_tokens_match_transformers(root, name, page_size):
    path = saved_model(name, root)
    model, ops, cfg = load_ours(path)
    ours = PagedDriver(model, cfg, page_size=page_size, seed=page_size).greedy(prompts(), NEW_TOKENS)
    assert ours == reference_greedy(path)


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_chunked_prefill_mixed_with_decode_matches(root, name):
    """Prompts prefilled 13 tokens per step while finished prompts decode:
    every step after the first mixes cached-prefix chunks with decodes."""
    path = saved_model(name, root)
    model, ops, cfg = load_ours(path)
    ours = PagedDriver(model, cfg, page_size=7, seed=3).greedy(prompts(), NEW_TOKENS, chunk=13)
    assert ours == reference_greedy(path)


def test_config_and_layout(root):
    path = saved_model("qwen3", root)
    model, ops, cfg = load_ours(path)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("Qwen3ForCausalLM", 2, 4, 2, 48)
    assert cfg.max_model_len == 512 and cfg.vocab_size == VOCAB
    layer = model.layers[0]
    assert layer.qkv.shape == ((4 + 2 + 2) * 48, 96)  # q, k, v fused
    assert layer.gate_up.shape == (2 * 160, 96)  # gate, up fused
    assert layer.q_norm is not None and layer.qkv_bias is None
    assert model.weight_bytes() > 0
    mistral, _, _ = load_ours(saved_model("mistral", root))
    assert [layer.sliding_window for layer in mistral.layers] == [24, 24]
    tied, _, _ = load_ours(saved_model("llama3-tied-hd40", root))
    assert tied.lm_head is tied.embed
