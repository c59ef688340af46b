"""Loading dense Llama-family models from a Hugging Face folder (safetensors)
or a GGUF file (llama.cpp tensor names, dequantized at load)."""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from plinth.api import (
    ConfigError,
    GGUFFile,
    LoadContext,
    ModelConfig,
    ModelLoader,
    ModelSource,
    Tokenizer,
    iter_safetensors,
    load_hf_config,
)

from plinth_plugin_llama.arch import LlamaArch, arch_from_hf, hf_config_from_gguf
from plinth_plugin_llama.model import LlamaForCausalLM, LlamaLayer
from plinth_plugin_llama.rope import cos_sin_table

log = logging.getLogger("plinth.llama")

# checkpoint tensor name -> (layer or None, our name)
_HF_GLOBAL = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
_HF_LAYER = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.weight": "o",
    "self_attn.o_proj.bias": "o_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
    "mlp.gate_proj.bias": "gate_bias",
    "mlp.up_proj.bias": "up_bias",
    "mlp.down_proj.bias": "down_bias",
}
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

_GGUF_GLOBAL = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head", "rope_freqs.weight": "rope_freqs"}
_GGUF_LAYER = {
    "attn_norm.weight": "input_norm",
    "ffn_norm.weight": "post_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_output.weight": "o",
    "attn_output.bias": "o_bias",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
}
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _map_name(name: str, global_map: dict[str, str], layer_map: dict[str, str], layer_re: re.Pattern[str]) -> tuple[int | None, str] | None:
    if name in global_map:
        return None, global_map[name]
    m = layer_re.match(name)
    if m and m.group(2) in layer_map:
        return int(m.group(1)), layer_map[m.group(2)]
    return None


def unpermute_gguf_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time reordering of q/k rows for the llama
    architecture (each head's rotary pairs interleaved), back to the
    half-split layout of Hugging Face checkpoints (transformers'
    LlamaTensorProcessor does the same)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class LlamaLoader(ModelLoader):
    """Builds LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and
    MistralForCausalLM (and GGUF files of llama, qwen2, qwen3)."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, Tokenizer] = {}

    # ---- config and tokenizer -------------------------------------------------------

    @staticmethod
    def hf_config(source: ModelSource) -> dict[str, Any]:
        if source.format == "gguf":
            return hf_config_from_gguf(GGUFFile(source.path))
        return dict(source.hf_config or load_hf_config(source.path))

    def load_tokenizer(self, source: ModelSource) -> Tokenizer:
        if source.path not in self._tokenizers:
            if source.format == "gguf":
                self._tokenizers[source.path] = Tokenizer.from_gguf(source.path)
            else:
                self._tokenizers[source.path] = Tokenizer.from_hf_dir(source.path)
        return self._tokenizers[source.path]

    def load_config(self, source: ModelSource) -> ModelConfig:
        cfg = self.hf_config(source)
        arch = arch_from_hf(cfg)
        eos = list(_ids(cfg.get("eos_token_id")))
        bos = cfg.get("bos_token_id")
        if source.format == "hf":
            import json
            import os

            gen_path = os.path.join(source.path, "generation_config.json")
            if os.path.exists(gen_path):
                with open(gen_path) as f:
                    gen = json.load(f)
                eos += _ids(gen.get("eos_token_id"))
                bos = bos if bos is not None else gen.get("bos_token_id")
        try:
            tokenizer = self.load_tokenizer(source)
            eos += tokenizer.eos_token_ids  # the chat format's end-of-turn token too
            bos = bos if bos is not None else tokenizer.bos_token_id
        except ConfigError as exc:
            log.warning("no tokenizer for %s: %s", source.path, exc)
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
        return ModelConfig(
            architecture=arch.architecture,
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            num_layers=arch.num_layers,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            max_model_len=_max_model_len(arch),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos)),
            bos_token_id=None if bos is None else int(bos),
            dtype=dtype.removeprefix("torch."),
            raw=cfg,
        )

    # ---- weights -----------------------------------------------------------------------

    def load_model(self, source: ModelSource, config: ModelConfig, ctx: LoadContext) -> LlamaForCausalLM:
        if ctx.tp_size != 1:
            raise ConfigError("the llama plugin does not shard models for tensor parallelism yet (tp must be 1)")
        cfg = dict(config.raw) if config.raw else self.hf_config(source)
        arch = arch_from_hf(cfg)
        if source.format == "gguf":
            gguf = GGUFFile(source.path)
            permute = gguf.architecture == "llama"
            tensors = gguf.iter_tensors(dtype=ctx.dtype, progress=ctx.progress)
            names = (_GGUF_GLOBAL, _GGUF_LAYER, _GGUF_LAYER_RE)
        else:
            permute = False
            tensors = iter_safetensors(source.path, dtype=ctx.dtype, progress=ctx.progress)
            names = (_HF_GLOBAL, _HF_LAYER, _HF_LAYER_RE)

        top: dict[str, torch.Tensor] = {}
        per_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(arch.num_layers)]
        for name, tensor in tensors:
            where = _map_name(name, *names)
            if where is None:
                log.debug("ignoring checkpoint tensor %s", name)
                continue
            layer, key = where
            if key == "rope_freqs" and source.format == "gguf":
                tensor = gguf.tensor(name)  # frequency factors stay float32
            if permute and key in ("q", "q_bias"):
                tensor = unpermute_gguf_rows(tensor, arch.num_heads)
            elif permute and key in ("k", "k_bias"):
                tensor = unpermute_gguf_rows(tensor, arch.num_kv_heads)
            if layer is None:
                top[key] = tensor
            elif layer < arch.num_layers:
                per_layer[layer][key] = tensor
        return build_model(arch, top, per_layer, ctx)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _max_model_len(arch: LlamaArch) -> int:
    rope = arch.rope
    if rope.get("rope_type") == "yarn" and rope.get("factor") and rope.get("original_max_position_embeddings"):
        return max(arch.max_position_embeddings, int(rope["original_max_position_embeddings"] * rope["factor"]))
    return arch.max_position_embeddings


def build_model(arch: LlamaArch, top: dict[str, torch.Tensor], per_layer: list[dict[str, torch.Tensor]], ctx: LoadContext) -> LlamaForCausalLM:
    """Fuse q/k/v and gate/up, hand every linear weight to ``ops.pack_linear``."""
    ops, device, dtype = ctx.ops, ctx.device, ctx.dtype

    def need(d: dict[str, torch.Tensor], key: str, where: str) -> torch.Tensor:
        if key not in d:
            raise ConfigError(f"the checkpoint has no {key} weight for {where}")
        return d[key]

    def put(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=dtype).contiguous()

    def fused_bias(d: dict[str, torch.Tensor], keys: tuple[str, ...], weights: list[torch.Tensor]) -> torch.Tensor | None:
        if not any(f"{k}_bias" in d for k in keys):
            return None
        return torch.cat([d.get(f"{k}_bias", torch.zeros(w.shape[0], dtype=w.dtype)) for k, w in zip(keys, weights)])

    layers = []
    for i, d in enumerate(per_layer):
        where = f"layer {i}"
        layer = LlamaLayer()
        q, k, v = need(d, "q", where), need(d, "k", where), need(d, "v", where)
        expected = (arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim)
        if (q.shape[0], k.shape[0], v.shape[0]) != expected:
            raise ConfigError(f"{where}: q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} rows, the config implies {expected}")
        layer.qkv = ops.pack_linear(put(torch.cat((q, k, v))))
        layer.qkv_bias = put(fused_bias(d, ("q", "k", "v"), [q, k, v]))
        layer.o_proj = ops.pack_linear(put(need(d, "o", where)))
        layer.o_bias = put(d.get("o_bias"))
        gate, up = need(d, "gate", where), need(d, "up", where)
        layer.gate_up = ops.pack_linear(put(torch.cat((gate, up))))
        layer.gate_up_bias = put(fused_bias(d, ("gate", "up"), [gate, up]))
        layer.down = ops.pack_linear(put(need(d, "down", where)))
        layer.down_bias = put(d.get("down_bias"))
        layer.input_norm = put(need(d, "input_norm", where))
        layer.post_norm = put(need(d, "post_norm", where))
        if arch.qk_norm or "q_norm" in d:
            layer.q_norm, layer.k_norm = put(need(d, "q_norm", where)), put(need(d, "k_norm", where))
        layer.sliding_window = arch.sliding_windows[i] if i < len(arch.sliding_windows) else None
        layers.append(layer)
        d.clear()  # drop the unfused copies as we go

    embed = put(need(top, "embed", "the embedding"))
    lm_head = top.get("lm_head")
    if lm_head is None:
        if not arch.tie_word_embeddings:
            log.warning("the checkpoint has no lm_head: tying it to the embedding")
        lm_head = embed
    else:
        lm_head = put(lm_head)
    cos_sin = cos_sin_table(
        arch.rope,
        arch.rotary_dim,
        arch.max_position_embeddings,
        _max_model_len(arch),
        freq_factors=top.get("rope_freqs"),
    ).to(device)
    return LlamaForCausalLM(
        arch,
        ops,
        cos_sin=cos_sin,
        embed=embed,
        norm=put(need(top, "norm", "the final norm")),
        lm_head=ops.pack_linear(lm_head),
        layers=layers,
    )
