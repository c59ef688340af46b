"""Peers measured beside plinth on the same weights."""

from __future__ import annotations

from pathlib import Path


def gguf_to_hf_folder(gguf: str | Path, out: str | Path) -> None:
    """A plain Hugging Face folder (float32 safetensors + tokenizer) holding a
    GGUF model's dequantized weights. transformers 5.x keeps a GGUF model's
    weights quantized (and its serve command does not take GGUF files at
    all), so a fair bfloat16 peer is rebuilt from this folder."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = copy.deepcopy(quantized.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    cfg.architectures = [type(quantized).__name__]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)  # the state dict holds dequantized tensors
    model.generation_config = quantized.generation_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
