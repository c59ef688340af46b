"""Loading Gemma 3 text models from a Hugging Face folder (safetensors) or a
GGUF file (llama.cpp's tensor names). GGUF linear weights of the types the
backend runs stay in their quantized blocks (the backend's capabilities,
``gguf_formats``, say which); the rest is
dequantized to the compute dtype at load."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Iterator

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
from plinth.api import modelling as kit

from plinth_plugin_gemma.arch import GemmaArch, arch_from_hf, hf_config_from_gguf
from plinth_plugin_gemma.chat import GEMMA3_CHAT_TEMPLATE
from plinth_plugin_gemma.model import Gemma3ForCausalLM, GemmaLayer

log = logging.getLogger("plinth.gemma")

# the kit's decoder names; Gemma's four norms a layer (its post_attention_layernorm
# follows the attention's output, not the residual add)
HF_NAMES = kit.NameMap(kit.HF_DECODER_TOP, {
    **kit.HF_DECODER_LAYER,
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "pre_mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
})  # fmt: skip
GGUF_NAMES = kit.NameMap(kit.GGUF_DECODER_TOP, {
    **kit.GGUF_DECODER_LAYER,
    "post_attention_norm.weight": "post_attn_norm",
    "ffn_norm.weight": "pre_mlp_norm",
    "post_ffw_norm.weight": "post_mlp_norm",
}, layer_re=kit.GGUF_LAYER)  # fmt: skip
#: per layer, the GGUF weights fused into one linear: kept in blocks only together (of one type:
#: fused; of several, as llama.cpp's Q4_K_M mixes them in attn_q/k/v: one linear each, see _fuse)
_GGUF_LINEARS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))
_NORMS = ("input_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm", "q_norm", "k_norm")
_EMBEDDING, _OUTPUT = "token_embd.weight", "output.weight"


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
            **kit.decoder_sizes(arch),
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
            found = kit.sort_tensors(tensors, GGUF_NAMES, arch.num_layers)
        else:
            tensors = iter_safetensors(source.path, dtype=ctx.dtype, progress=ctx.progress)
            found = kit.sort_tensors(tensors, HF_NAMES, arch.num_layers, transform=_one_plus_norms)
        return build_model(arch, found.top, found.layers, ctx)


def _one_plus_norms(name: str, layer: int | None, key: str, tensor: Any) -> Any:
    """Gemma scales by (1 + weight): the norms of a Hugging Face checkpoint
    become the sum (GGUF files store it so), for the plain rms_norm op."""
    return tensor.float() + 1.0 if key in _NORMS or key == "norm" else tensor


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
    return pack(kit.stack_rows(parts))


def build_model(arch: GemmaArch, top: dict[str, Any], per_layer: list[dict[str, Any]], ctx: LoadContext) -> Gemma3ForCausalLM:
    """Fuse q/k/v and gate/up, hand every linear weight to ``ops.pack_linear``."""
    ops, device, dtype = ctx.ops, ctx.device, ctx.dtype

    def put(t: Any) -> Any:
        return t if isinstance(t, QuantizedWeight) else t.to(device=device, dtype=dtype).contiguous()

    # each layer's rope: the local base for sliding-window layers, the global one for the rest
    ropes = [arch.rope_global if window is None else arch.rope_local for window in arch.sliding_windows]
    # (the global and local ones first: model.tables lists them in that order)
    host = kit.rope_tables([arch.rope_global, arch.rope_local, *ropes], arch.head_dim, arch.max_position_embeddings,
                       arch.max_position_embeddings, family="Gemma 3")  # fmt: skip
    on_device = {id(t): t.to(device) for t in host}  # layers with one rope share one table
    per_layer_tables = [on_device[id(t)] for t in host[2:]]
    tables = list(on_device.values())
    layers = []
    hd = arch.head_dim
    for i, d in enumerate(per_layer):
        where = f"layer {i}"
        layer = GemmaLayer()
        q, k, v = kit.need(d, "q", where), kit.need(d, "k", where), kit.need(d, "v", where)
        expected = (arch.num_heads * hd, arch.num_kv_heads * hd, arch.num_kv_heads * hd)
        if (q.shape[0], k.shape[0], v.shape[0]) != expected:
            raise ConfigError(f"{where}: q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} rows, the config implies {expected}")
        layer.qkv = _fuse(tuple(put(p) for p in (q, k, v)), ops.pack_linear)
        layer.o_proj = ops.pack_linear(put(kit.need(d, "o", where)))
        layer.gate_up = _fuse((put(kit.need(d, "gate", where)), put(kit.need(d, "up", where))), ops.pack_linear)
        layer.down = ops.pack_linear(put(kit.need(d, "down", where)))
        for name in _NORMS:
            setattr(layer, name, put(kit.need(d, name, where)))
        layer.sliding_window = arch.sliding_windows[i]
        layer.cos_sin = per_layer_tables[i]
        layers.append(layer)
        d.clear()  # drop the unfused copies as we go

    embed = put(kit.need(top, "embed", "the embedding"))
    lm_head = kit.output_head(top, embed, arch.tie_word_embeddings, family="Gemma3ForCausalLM")
    return Gemma3ForCausalLM(
        arch, ops, ctx.attention, embed=embed, norm=put(kit.need(top, "norm", "the final norm")),
        lm_head=ops.pack_linear(put(lm_head)), layers=layers, tables=tables,
    )
