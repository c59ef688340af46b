"""Rotary tables (the modelling kit's, plinth.api.rope_cos_sin, as the llama
plugin calls it) against transformers' LlamaRotaryEmbedding, every scaling type."""

from __future__ import annotations

import pytest
import torch
from plinth.api import rope_cos_sin
from plinth_plugin_llama.arch import arch_from_hf

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512, "attention_factor": 1.3, "truncate": False},
}


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("head_dim", [64, 40])
def test_cos_sin_match_transformers(name, head_dim):
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_theta": 50000.0, **(ROPES[name] or {"rope_type": "default"})}
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=1024, rope_parameters=params
    )
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(1024)[None]
    ref_cos, ref_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    arch = arch_from_hf(config.to_dict())
    table = rope_cos_sin(arch.rope, arch.rotary_dim, arch.max_position_embeddings, 1024)
    half = head_dim // 2
    # transformers repeats each angle for both halves; the table keeps one copy
    torch.testing.assert_close(table[:, :half], ref_cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(table[:, half:], ref_sin[0, :, :half], atol=1e-6, rtol=0)


def test_old_style_rope_scaling_keys():
    """config.json of transformers 4: rope_theta and rope_scaling at the top."""
    cfg = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 4096, "rope_theta": 500000.0,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    }  # fmt: skip
    arch = arch_from_hf(cfg)
    assert arch.rope["rope_type"] == "llama3" and arch.rope["rope_theta"] == 500000.0
    assert arch.num_kv_heads == 4 and arch.head_dim == 16 and arch.sliding_windows == [None]


def test_entry_point_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, plinth_plugin_llama.plugin as p; p.plinth_register_model_loaders(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
