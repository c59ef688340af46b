"""What a Gemma 3 text model is made of, read from a Hugging Face config.json
(``Gemma3ForCausalLM``, model type ``gemma3_text``) or from GGUF metadata
(``general.architecture = gemma3``) into one ``GemmaArch``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from plinth.api import ConfigError, DecoderShape, GGUFFile, decoder_shape_from_hf

ARCHITECTURE = "Gemma3ForCausalLM"
GGUF_ARCHITECTURE = "gemma3"
#: transformers' and llama.cpp's defaults: every sixth layer global
SLIDING_WINDOW_PATTERN = 6
#: rope bases when the config names none (transformers' Gemma3TextConfig.default_theta)
DEFAULT_GLOBAL_THETA, DEFAULT_LOCAL_THETA = 1_000_000.0, 10_000.0


@dataclass
class GemmaArch(DecoderShape):
    #: per layer: the sliding window (tokens a query sees, itself included), or None (global)
    sliding_windows: list[int | None] = field(default_factory=list[int | None])
    #: rope of the global layers and of the sliding ones: rope_type, rope_theta, factor
    rope_global: dict[str, Any] = field(default_factory=dict)
    rope_local: dict[str, Any] = field(default_factory=dict)
    #: attention scores are scaled by query_pre_attn_scalar ** -0.5 (not head_dim's)
    query_pre_attn_scalar: float = 256.0
    #: read but not applied: transformers' Gemma3Attention never passes it to
    #: the attention function (Gemma 3 bounds scores with q/k norms instead;
    #: Gemma 2 capped them), and its checkpoints set null
    attn_logit_softcapping: float | None = None
    #: logits = cap * tanh(logits / cap)
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"

    @property
    def scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5


def _layer_types(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ConfigError(f"layer_types names {len(types)} layers, num_hidden_layers is {num_layers}")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ConfigError(f"layer types {sorted(unknown)} are not Gemma 3's (sliding_attention, full_attention)")
        return list(types)
    pattern = int(cfg.get("sliding_window_pattern") or SLIDING_WINDOW_PATTERN)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _rope(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) rope parameters: transformers 5 nests them per layer
    type in ``rope_parameters``; older configs have rope_theta,
    rope_local_base_freq and rope_scaling (for the global layers) at the top."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(cfg.get("rope_scaling") or {})
        local = {}
    full.setdefault("rope_theta", float(cfg.get("rope_theta") or DEFAULT_GLOBAL_THETA))
    local.setdefault("rope_theta", float(cfg.get("rope_local_base_freq") or DEFAULT_LOCAL_THETA))
    for rope in (full, local):
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        if rope["rope_type"] not in ("default", "linear"):  # what Gemma 3 configs use (the kit computes others too)
            raise ConfigError(f"Gemma 3 rope type {rope['rope_type']!r} is not supported (default, linear)")
    return full, local


def arch_from_hf(cfg: Mapping[str, Any]) -> GemmaArch:
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("bidirectional Gemma 3 (an embedding model) is not a causal LM")
    shape = decoder_shape_from_hf(cfg, max_position_embeddings=131072)
    num_layers = shape["num_layers"]
    window = cfg.get("sliding_window")
    types = _layer_types(cfg, num_layers)
    if window is None and "sliding_attention" in types:
        raise ConfigError("the config has sliding-window layers but no sliding_window")
    window_size = 0 if window is None else int(window)  # read only by sliding layers, which have one
    full, local = _rope(cfg)
    head_dim = shape["head_dim"]
    return GemmaArch(
        **shape,
        sliding_windows=[window_size if t == "sliding_attention" else None for t in types],
        rope_global=full,
        rope_local=local,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
        attn_logit_softcapping=_cap(cfg.get("attn_logit_softcapping")),
        final_logit_softcapping=_cap(cfg.get("final_logit_softcapping")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        hidden_activation=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"),
    )


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def hf_config_from_gguf(gguf: GGUFFile) -> dict[str, Any]:
    """A config.json-like dict from GGUF metadata, as llama.cpp reads a
    gemma3 file: the global rope base from rope.freq_base, the local one
    10000, every sixth layer global, scores scaled by head_dim ** -0.5 except
    for the 27B model (62 layers), which llama.cpp scales by (hidden / heads)
    ** -0.5 (llama-model.cpp, LLM_ARCH_GEMMA3)."""
    if gguf.architecture != GGUF_ARCHITECTURE:
        raise ConfigError(f"{gguf.path}: GGUF architecture {gguf.architecture!r} is not one the gemma plugin builds (gemma3)")
    hidden = int(gguf.require("gemma3.embedding_length"))
    heads = int(gguf.require("gemma3.attention.head_count"))
    layers = int(gguf.require("gemma3.block_count"))
    head_dim = int(gguf.arch_get("attention.key_length") or hidden // heads)
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "gemma3_text",
        "vocab_size": gguf.tensor_shape("token_embd.weight")[0],
        "hidden_size": hidden,
        "intermediate_size": int(gguf.require("gemma3.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf.arch_get("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(gguf.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(gguf.arch_get("context_length", 131072)),
        "sliding_window": int(gguf.require("gemma3.attention.sliding_window")),
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "tie_word_embeddings": not gguf.has_tensor("output.weight"),
        "rope_theta": float(gguf.arch_get("rope.freq_base", DEFAULT_GLOBAL_THETA)),
        "rope_local_base_freq": DEFAULT_LOCAL_THETA,
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = gguf.arch_get("rope.scaling.type")
    if scaling and scaling != "none":
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(gguf.arch_get("rope.scaling.factor", 1.0))}
    return cfg
