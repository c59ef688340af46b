"""CheckpointLoader: the config, tokenizer and special-token reading every
model plugin shares."""

from __future__ import annotations

import json

import pytest
from plinth.api import CheckpointLoader, ConfigError, ModelSource
from test_tokenizer import write_hf_tokenizer

SIZES = dict(architecture="X", vocab_size=300, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, max_model_len=64)


class FolderOnly(CheckpointLoader):
    def load_config(self, source):
        return self.model_config(source, self.hf_config(source), **SIZES)

    def load_model(self, source, config, ctx):
        raise NotImplementedError


def test_special_tokens_from_config_generation_config_and_tokenizer(tmp_path):
    folder = write_hf_tokenizer(tmp_path / "m", generation_eos=[7, 1])
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump({"eos_token_id": 5, "bos_token_id": 2, "torch_dtype": "torch.float16"}, f)
    loader = FolderOnly()
    source = ModelSource(path=folder, format="hf", architecture="X")
    cfg = loader.load_config(source)
    tok = loader.load_tokenizer(source)
    assert loader.load_tokenizer(source) is tok  # read once per path
    # config.json's, then generation_config.json's, then the tokenizer's, each once
    assert cfg.eos_token_ids == tuple(dict.fromkeys((5, 7, 1, *tok.eos_token_ids)))
    assert tok.token_to_id("<|im_end|>") in cfg.eos_token_ids
    assert (cfg.bos_token_id, cfg.dtype, cfg.raw["eos_token_id"], cfg.num_heads) == (2, "float16", 5, 2)


def test_without_a_tokenizer_the_config_still_loads(tmp_path, caplog):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    cfg = FolderOnly().load_config(ModelSource(path=str(tmp_path), format="hf", architecture="X"))
    assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.dtype) == ((3, 4), None, "bfloat16")
    assert "no tokenizer for" in caplog.text


def test_gguf_refused_unless_the_loader_reads_it(tmp_path):
    with pytest.raises(ConfigError, match="loads Hugging Face folders of safetensors, not GGUF"):
        FolderOnly().hf_config(ModelSource(path=str(tmp_path / "m.gguf"), format="gguf", architecture="x"))
