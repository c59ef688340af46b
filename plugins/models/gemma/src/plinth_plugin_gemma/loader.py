"""Loading Gemma 3 text models from a Hugging Face folder (safetensors) or a
GGUF file (llama.cpp's tensor names). GGUF linear weights of the types the
backend runs stay in their quantized blocks (the backend's capabilities,
``gguf_formats``, say which); the rest is
dequantized to the compute dtype at load."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import Counter
from typing import Any, Iterator

import torch
from plinth.api import (
    CheckpointLoader,
    ConfigError,
    GGUFFile,
    LoadContext,
    ModelConfig,
    ModelSource,
    QuantizedWeight,
    Tokenizer,
    iter_safetensors,
)

from plinth_plugin_gemma.arch import GemmaArch, arch_from_hf, hf_config_from_gguf
from plinth_plugin_gemma.chat import GEMMA3_CHAT_TEMPLATE
from plinth_plugin_gemma.model import Gemma3ForCausalLM, GemmaLayer

log = logging.getLogger("plinth.gemma")

_HF_GLOBAL = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
_HF_LAYER = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "pre_mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

_GGUF_GLOBAL = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
_GGUF_LAYER = {
    "attn_norm.weight": "input_norm",
    "post_attention_norm.weight": "post_attn_norm",
    "ffn_norm.weight": "pre_mlp_norm",
    "post_ffw_norm.weight": "post_mlp_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_output.weight": "o",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
}
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
#: per layer, the GGUF weights fused into one linear: kept in blocks only together (of one type:
#: fused; of several, as llama.cpp's Q4_K_M mixes them in attn_q/k/v: one linear each, see _fuse)
_GGUF_LINEARS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))
_NORMS = ("input_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm", "q_norm", "k_norm")
_EMBEDDING, _OUTPUT = "token_embd.weight", "output.weight"


def _map_name(name: str, global_map: dict[str, str], layer_map: dict[str, str], layer_re: re.Pattern[str]) -> tuple[int | None, str] | None:
    if name in global_map:
        return None, global_map[name]
    m = layer_re.match(name)
    if m and m.group(2) in layer_map:
        return int(m.group(1)), layer_map[m.group(2)]
    return None


class GemmaLoader(CheckpointLoader):
    """Builds Gemma3ForCausalLM (and GGUF files of gemma3)."""

    gguf_config = staticmethod(hf_config_from_gguf)

    def adapt_tokenizer(self, tokenizer: Tokenizer, source: ModelSource) -> Tokenizer:
        if tokenizer.chat_template is None:
            # base checkpoints (gemma-3-270m's GGUF) carry none: the
            # instruction-tuned models' turn format, so chat routes work
            log.info("%s has no chat template: using Gemma 3's turn format", source.path)
            tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
            end_of_turn = tokenizer.token_to_id("<end_of_turn>")
            if end_of_turn is not None:
                tokenizer.eos_token_ids = tuple(dict.fromkeys((*tokenizer.eos_token_ids, end_of_turn)))
        return tokenizer

    def load_config(self, source: ModelSource) -> ModelConfig:
        cfg = self.hf_config(source)
        arch = arch_from_hf(cfg)
        if arch.attn_logit_softcapping:
            log.warning("attn_logit_softcapping %s is not applied: Gemma 3 (as transformers runs it) has none", arch.attn_logit_softcapping)
        return self.model_config(
            source,
            cfg,
            architecture="Gemma3ForCausalLM",
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            num_layers=arch.num_layers,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            max_model_len=arch.max_position_embeddings,
            sliding_window=max((w for w in arch.sliding_windows if w), default=None),
        )

    def required_ops(self, config: ModelConfig) -> tuple[str, ...]:
        # GeGLU is computed in torch (gelu-tanh), not through silu_and_mul
        return ("rms_norm", "pack_linear", "linear", "rotary")

    def load_model(self, source: ModelSource, config: ModelConfig, ctx: LoadContext) -> Gemma3ForCausalLM:
        if ctx.tp_size > 1 or ctx.ep_size > 1:
            raise ConfigError("the gemma plugin runs at tp = ep = 1")
        cfg = dict(config.raw) if config.raw else self.hf_config(source)
        arch = arch_from_hf(cfg)
        if source.format == "gguf":
            tensors = _gguf_tensors(GGUFFile(source.path), ctx, arch.num_layers)
            names = (_GGUF_GLOBAL, _GGUF_LAYER, _GGUF_LAYER_RE)
        else:
            tensors = iter_safetensors(source.path, dtype=ctx.dtype, progress=ctx.progress)
            names = (_HF_GLOBAL, _HF_LAYER, _HF_LAYER_RE)
        top: dict[str, Any] = {}
        per_layer: list[dict[str, Any]] = [{} for _ in range(arch.num_layers)]
        for name, tensor in tensors:
            where = _map_name(name, *names)
            if where is None:
                log.debug("ignoring checkpoint tensor %s", name)
                continue
            layer, key = where
            if source.format == "hf" and (key in _NORMS or key == "norm"):
                tensor = tensor.float() + 1.0  # Gemma scales by (1 + weight); GGUF files store the sum
            if layer is None:
                top[key] = tensor
            elif layer < arch.num_layers:
                per_layer[layer][key] = tensor
        return build_model(arch, top, per_layer, ctx)


def _gguf_tensors(gguf: GGUFFile, ctx: LoadContext, num_layers: int) -> Iterator[tuple[str, Any]]:
    """Every tensor, dequantized to the compute dtype, except the linear
    weights kept in their blocks (a tied head as ``output.weight``: the
    embedding's blocks; the embedding itself, a gather, is dequantized)."""
    dtype = str(ctx.dtype).removeprefix("torch.")
    quantized = [n for n in gguf.tensor_names if gguf.tensor_type(n) not in ("F32", "F16", "BF16", "F64")]
    caps = ctx.ops.capabilities
    kept: set[str] = set()
    if not quantized:
        why = "no quantized weights in the file"
    elif ctx.dequantize:
        why = f"dequantized at load to {dtype}: --dequantize"
    elif not caps.gguf_formats:
        why = f"dequantized at load to {dtype}: the backend runs no GGUF formats (its capabilities declare none)"
    else:
        formats, path = caps.gguf_formats, caps.gguf_path

        def runnable(name: str) -> bool:
            return gguf.has_tensor(name) and gguf.tensor_type(name) in formats and len(gguf.tensor_shape(name)) == 2

        for i in range(num_layers):
            for group in _GGUF_LINEARS:
                group_names = [f"blk.{i}.{part}.weight" for part in group]
                if all(runnable(n) for n in group_names):
                    kept.update(group_names)
        head = _OUTPUT if gguf.has_tensor(_OUTPUT) else _EMBEDDING
        if runnable(head):
            kept.add(head)
        types = Counter(gguf.tensor_type(n) for n in kept)
        rest = Counter(gguf.tensor_type(n) for n in quantized if n not in kept and n != _EMBEDDING)
        why = (
            f"{len(kept)} linear weights kept in their blocks ({', '.join(f'{c} {t}' for t, c in sorted(types.items()))}), "
            f"the backend's {path}; embedding dequantized to {dtype}"
            + (f"; dequantized: {', '.join(f'{c} {t}' for t, c in sorted(rest.items()))} (a type it does not run, or grouped with one)" if rest else "")
        )
    log.info("GGUF weights: %s", why)
    skip = kept - {_EMBEDDING}
    yield from gguf.iter_tensors(dtype=ctx.dtype, progress=ctx.progress, select=lambda n: n not in skip)
    for name in sorted(kept):
        yield (_OUTPUT if name == _EMBEDDING else name), gguf.quantized_weight(name)


def _fuse(parts: tuple[Any, ...], pack: Any) -> Any:
    """One packed linear of the parts stacked along their output rows, or,
    where GGUF parts differ in type (gemma-3-270m's Q4_K_M file: Q5_0 q/k
    beside a Q8_0 v), a tuple of one packed linear per part, each kept in
    its own blocks (the model runs them one by one)."""
    if len({getattr(p, "format", None) for p in parts}) > 1 and all(isinstance(p, QuantizedWeight) for p in parts):
        return tuple(pack(p) for p in parts)
    return pack(_cat_rows(parts))


def _cat_rows(parts: tuple[Any, ...]) -> Any:
    """Weights stacked along their output rows: tensors by torch.cat, GGUF
    blocks of one type by stacking their rows of blocks."""
    if not any(isinstance(p, QuantizedWeight) for p in parts):
        return torch.cat(parts)
    first = parts[0]
    if len(parts) == 1:
        return first
    rows = sum(p.shape[0] for p in parts)
    return dataclasses.replace(first, qweight=torch.cat([p.qweight for p in parts]), shape=(rows, first.shape[1]))


def rope_table(rope: dict[str, Any], head_dim: int, num_positions: int) -> torch.Tensor:
    """[num_positions, head_dim] float32, cos of every position's angles then
    their sin (the rotary op's layout), computed as transformers does:
    default rope, or linear scaling (frequencies divided by the factor)."""
    base = float(rope["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    if rope.get("rope_type") == "linear":
        inv_freq = inv_freq / float(rope["factor"])
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def build_model(arch: GemmaArch, top: dict[str, Any], per_layer: list[dict[str, Any]], ctx: LoadContext) -> Gemma3ForCausalLM:
    """Fuse q/k/v and gate/up, hand every linear weight to ``ops.pack_linear``."""
    ops, device, dtype = ctx.ops, ctx.device, ctx.dtype

    def need(d: dict[str, Any], key: str, where: str) -> Any:
        if key not in d:
            raise ConfigError(f"the checkpoint has no {key} weight for {where}")
        return d[key]

    def put(t: Any) -> Any:
        return t if isinstance(t, QuantizedWeight) else t.to(device=device, dtype=dtype).contiguous()

    tables = {
        "global": rope_table(arch.rope_global, arch.head_dim, arch.max_position_embeddings).to(device),
        "local": rope_table(arch.rope_local, arch.head_dim, arch.max_position_embeddings).to(device),
    }
    layers = []
    hd = arch.head_dim
    for i, d in enumerate(per_layer):
        where = f"layer {i}"
        layer = GemmaLayer()
        q, k, v = need(d, "q", where), need(d, "k", where), need(d, "v", where)
        expected = (arch.num_heads * hd, arch.num_kv_heads * hd, arch.num_kv_heads * hd)
        if (q.shape[0], k.shape[0], v.shape[0]) != expected:
            raise ConfigError(f"{where}: q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} rows, the config implies {expected}")
        layer.qkv = _fuse(tuple(put(p) for p in (q, k, v)), ops.pack_linear)
        layer.o_proj = ops.pack_linear(put(need(d, "o", where)))
        layer.gate_up = _fuse((put(need(d, "gate", where)), put(need(d, "up", where))), ops.pack_linear)
        layer.down = ops.pack_linear(put(need(d, "down", where)))
        for name in _NORMS:
            setattr(layer, name, put(need(d, name, where)))
        layer.sliding_window = arch.sliding_windows[i]
        layer.cos_sin = tables["global" if layer.sliding_window is None else "local"]
        layers.append(layer)
        d.clear()  # drop the unfused copies as we go

    embed = put(need(top, "embed", "the embedding"))
    lm_head = top.get("lm_head")
    if lm_head is None:
        if not arch.tie_word_embeddings:
            log.warning("the checkpoint has no lm_head: tying it to the embedding")
        lm_head = embed
    return Gemma3ForCausalLM(
        arch, ops, ctx.attention, embed=embed, norm=put(need(top, "norm", "the final norm")),
        lm_head=ops.pack_linear(put(lm_head)), layers=layers, tables=list(tables.values()),
    )
