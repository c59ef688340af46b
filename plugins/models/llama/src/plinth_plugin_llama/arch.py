"""What the dense Llama family's variants differ in, read from a Hugging Face
config.json or from GGUF metadata into one ``LlamaArch``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from plinth.api import ConfigError, DecoderShape, GGUFFile, decoder_shape_from_hf, rope_from_hf

#: GGUF general.architecture -> the Hugging Face class it corresponds to
GGUF_TO_HF = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass
class LlamaArch(DecoderShape):
    architecture: str = ""
    tie_word_embeddings: bool = False
    #: rope: theta, type and its parameters, as transformers' rope_parameters
    rope: dict[str, Any] = field(default_factory=dict)
    partial_rotary_factor: float = 1.0
    #: per layer: the sliding window, or None for full attention
    sliding_windows: list[int | None] = field(default_factory=list)
    #: per-head RMS norms of q and k (Qwen3)
    qk_norm: bool = False
    #: mixture of experts (0: dense). Routing is softmax over all experts,
    #: then top-k, then (norm_topk_prob) the k weights renormalized to sum 1.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    #: Qwen2-MoE: one always-on expert, scaled by sigmoid(shared_expert_gate(x))
    shared_expert_intermediate_size: int = 0
    #: per layer: True where the MLP is the experts (False: a dense MLP)
    moe_layers: list[bool] = field(default_factory=list)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def _sliding_windows(cfg: Mapping[str, Any], arch: str, num_layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    if not window:
        return [None] * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if arch.startswith("Qwen"):  # older Qwen2 configs: a flag and the first full-attention layers
        if not cfg.get("use_sliding_window", False):
            return [None] * num_layers
        first = cfg.get("max_window_layers", num_layers)
        return [window if i >= first else None for i in range(num_layers)]
    return [window] * num_layers  # Mistral: every layer


#: the MoE architectures and whether they always renormalize the top-k weights
MOE_ARCHITECTURES = {"MixtralForCausalLM": True, "Qwen2MoeForCausalLM": False, "Qwen3MoeForCausalLM": False}


def _moe_fields(cfg: Mapping[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    if arch not in MOE_ARCHITECTURES:
        return {}
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if num_experts < 1:
        raise ConfigError(f"{arch}: the config names no experts (num_experts / num_local_experts)")
    if arch == "MixtralForCausalLM":  # every layer sparse; the experts' size is intermediate_size
        moe_size, layers = int(cfg["intermediate_size"]), [True] * num_layers
    else:  # Qwen: dense MLPs on mlp_only_layers and between every decoder_sparse_step-th layer
        only, step = set(cfg.get("mlp_only_layers") or ()), int(cfg.get("decoder_sparse_step") or 1)
        moe_size = int(cfg["moe_intermediate_size"])
        layers = [i not in only and (i + 1) % step == 0 for i in range(num_layers)]
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=moe_size,
        norm_topk_prob=MOE_ARCHITECTURES[arch] or bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0,
        moe_layers=layers,
    )


def arch_from_hf(cfg: Mapping[str, Any]) -> LlamaArch:
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    arch = archs[0]
    shape = decoder_shape_from_hf(cfg)
    num_layers = shape["num_layers"]
    rope = rope_from_hf(cfg)
    return LlamaArch(
        **shape,
        architecture=arch,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope=rope,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)),
        sliding_windows=_sliding_windows(cfg, arch, num_layers),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        **_moe_fields(cfg, arch, num_layers),
    )


def hf_config_from_gguf(gguf: GGUFFile) -> dict[str, Any]:
    """A config.json-like dict from GGUF metadata (the keys arch_from_hf reads)."""
    arch = gguf.architecture
    if arch not in GGUF_TO_HF:
        raise ConfigError(f"{gguf.path}: GGUF architecture {arch!r} is not one the llama plugin builds ({', '.join(GGUF_TO_HF)})")
    hidden = int(gguf.require(f"{arch}.embedding_length"))
    heads = int(gguf.require(f"{arch}.attention.head_count"))
    rotary = gguf.arch_get("rope.dimension_count")
    head_dim = int(gguf.arch_get("attention.key_length") or hidden // heads)
    cfg: dict[str, Any] = {
        "architectures": [GGUF_TO_HF[arch]],
        "model_type": arch,
        "vocab_size": gguf.tensor_shape("token_embd.weight")[0],
        "hidden_size": hidden,
        "intermediate_size": int(gguf.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(gguf.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf.arch_get("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(gguf.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(gguf.arch_get("context_length", 2048)),
        "tie_word_embeddings": not gguf.has_tensor("output.weight"),
        "rope_theta": float(gguf.arch_get("rope.freq_base", 10000.0)),
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf.get("tokenizer.ggml.eos_token_id"),
    }
    if rotary and int(rotary) != head_dim:
        cfg["partial_rotary_factor"] = int(rotary) / head_dim
    scaling = gguf.arch_get("rope.scaling.type")
    if scaling and scaling != "none":
        rope = {"rope_type": scaling, "rope_theta": cfg["rope_theta"], "factor": float(gguf.arch_get("rope.scaling.factor", 1.0))}
        original = gguf.arch_get("rope.scaling.original_context_length")
        if original:
            rope["original_max_position_embeddings"] = int(original)
        for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if gguf.arch_get(key) is not None:
                rope[name] = float(gguf.arch_get(key))
        cfg["rope_parameters"] = rope
    return cfg
