"""Loading paths: sharded safetensors, GGUF files (llama.cpp names, the q/k
row permutation, qwen biases and head_dim), and refusing pickle checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from driver import PagedDriver, torch_attention, torch_ops
from plinth.api import ConfigError, GGUFFile, LoadContext, ModelSource, load_hf_config
from plinth_plugin_llama.loader import LlamaLoader
from test_llama_vs_transformers import prompts, reference, saved_model


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny_llamas_loading"))


def _ctx(ops):
    return LoadContext(device=torch.device("cpu"), dtype=torch.float32, ops=ops, attention=torch_attention(), progress=False)


def _logits_diff(model, ops, cfg, ref_model) -> float:
    ours = PagedDriver(model, cfg, page_size=16).prefill_logits(prompts()[:3])
    worst = 0.0
    with torch.no_grad():
        for prompt, logits in zip(prompts()[:3], ours):
            worst = max(worst, (logits - ref_model(torch.tensor([prompt])).logits[0]).abs().max().item())
    return worst


def test_sharded_safetensors(root, tmp_path):
    from transformers import AutoModelForCausalLM

    ref = reference(saved_model("qwen2", root))
    ref.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    cfg_json = load_hf_config(tmp_path)
    source = ModelSource(str(tmp_path), "hf", cfg_json["architectures"][0], cfg_json)
    loader, ops = LlamaLoader(), torch_ops()
    cfg = loader.load_config(source)
    model = loader.load_model(source, cfg, _ctx(ops))
    assert _logits_diff(model, ops, cfg, AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)) < 1e-4


def test_pickle_checkpoint_is_refused(tmp_path):
    ref = reference(saved_model("llama", str(tmp_path / "src")))
    (tmp_path / "model").mkdir()
    ref.config.save_pretrained(tmp_path / "model")
    torch.save(ref.state_dict(), tmp_path / "model" / "pytorch_model.bin")
    cfg_json = load_hf_config(tmp_path / "model")
    source = ModelSource(str(tmp_path / "model"), "hf", "LlamaForCausalLM", cfg_json)
    loader = LlamaLoader()
    with pytest.raises(ConfigError) as err:
        loader.load_model(source, loader.load_config(source), _ctx(torch_ops()))
    message = str(err.value)
    assert "pytorch_model.bin" in message and "pickle" in message and "unsafe" in message and "safetensors" in message


# ---- GGUF ----------------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_model, path: str, arch: str) -> None:
    """A GGUF file of a tiny transformers model, as llama.cpp's converter writes it."""
    import gguf

    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    if head_dim != c.hidden_size // c.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for name, tensor in hf_model.state_dict().items():
        if name.startswith("model.layers."):
            _, _, idx, rest = name.split(".", 3)
            gname = f"blk.{idx}.{per_layer[rest]}"
        else:
            gname = names[name]
        array = tensor.float().numpy()
        if arch == "llama" and gname.endswith("attn_q.weight"):
            array = _llama_cpp_permute(array, c.num_attention_heads)
        elif arch == "llama" and gname.endswith("attn_k.weight"):
            array = _llama_cpp_permute(array, c.num_key_value_heads)
        writer.add_tensor(gname, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name,arch", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_gguf_matches_transformers(root, tmp_path, name, arch):
    ref = reference(saved_model(name, root))
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(ref, path, arch)
    source = ModelSource(path, "gguf", GGUFFile(path).architecture)
    loader, ops = LlamaLoader(), torch_ops()
    cfg = loader.load_config(source)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.max_model_len) == (
        ref.config.num_attention_heads, ref.config.num_key_value_heads,
        getattr(ref.config, "head_dim", None) or ref.config.hidden_size // ref.config.num_attention_heads, 512,
    )
    model = loader.load_model(source, cfg, _ctx(ops))
    assert _logits_diff(model, ops, cfg, ref) < 1e-4


def test_gguf_with_unsupported_architecture_is_refused(tmp_path):
    import gguf

    path = str(tmp_path / "x.gguf")
    writer = gguf.GGUFWriter(path, "gemma2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="gemma2"):
        LlamaLoader().load_config(ModelSource(path, "gguf", "gemma2"))


def test_generation_config_eos_ids(root, tmp_path):
    import shutil

    src = saved_model("llama", root)
    shutil.copytree(src, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9], "bos_token_id": 1}))
    cfg_json = load_hf_config(tmp_path / "m")
    cfg = LlamaLoader().load_config(ModelSource(str(tmp_path / "m"), "hf", "LlamaForCausalLM", cfg_json))
    assert cfg.eos_token_ids == (7, 9) and cfg.bos_token_id == 1
