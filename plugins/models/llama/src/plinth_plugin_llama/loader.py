"""Loading Llama-family models (dense, and the Mixtral / Qwen2-MoE / Qwen3-MoE
mixtures of experts) from a Hugging Face folder (safetensors, per-expert
weights) or a GGUF file (llama.cpp tensor names), cut to
this rank's share when the world is tensor or expert parallel. GGUF weights
of the types the backend runs stay in their quantized blocks (gguf_quant.py)."""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import torch
from plinth.api import (
    CheckpointLoader,
    ConfigError,
    GGUFFile,
    LoadContext,
    ModelConfig,
    ModelSource,
    QuantizedWeight,
    iter_safetensors,
)
from plinth.api import modelling as kit

from plinth_plugin_llama.arch import LlamaArch, arch_from_hf, hf_config_from_gguf
from plinth_plugin_llama.fp8 import fp8_plan
from plinth_plugin_llama.gguf_quant import GGUFWeights
from plinth_plugin_llama.model import LlamaForCausalLM, LlamaLayer
from plinth_plugin_llama.moe import MoEBlock
from plinth_plugin_llama.parallel import Parallel, head_cols, head_rows, vocab_rows

log = logging.getLogger("plinth.llama")

# checkpoint tensor name -> (layer or None, our name): the kit's decoder names,
# plus the biases, the mixtures of experts' router, Qwen2-MoE's shared expert
# and its gate, and transformers 5's in-memory fused experts
_HF_LAYER = {
    **kit.HF_DECODER_LAYER,
    **{f"self_attn.{p}_proj.bias": f"{p}_bias" for p in ("q", "k", "v", "o")},
    **{f"mlp.{p}_proj.bias": f"{p}_bias" for p in ("gate", "up", "down")},
    "mlp.gate.weight": "router",
    "block_sparse_moe.gate.weight": "router",
    "mlp.shared_expert.gate_proj.weight": "shared_gate_proj",
    "mlp.shared_expert.up_proj.weight": "shared_up",
    "mlp.shared_expert.down_proj.weight": "shared_down",
    "mlp.shared_expert_gate.weight": "shared_expert_gate",
    "mlp.experts.gate_up_proj": "experts_gate_up",
    "mlp.experts.down_proj": "experts_down",
}
#: per-expert weights: Qwen's gate/up/down_proj, Mixtral's w1 (gate), w3 (up), w2 (down)
_HF_EXPERT_RE = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
HF_NAMES = kit.NameMap(kit.HF_DECODER_TOP, _HF_LAYER, experts=_HF_EXPERT_RE, expert_parts=_EXPERT_PART)
GGUF_NAMES = kit.NameMap(
    {**kit.GGUF_DECODER_TOP, "rope_freqs.weight": "rope_freqs"},
    {**kit.GGUF_DECODER_LAYER, **{f"attn_{p}.bias": f"{p}_bias" for p in ("q", "k", "v")}, "attn_output.bias": "o_bias"},
    layer_re=kit.GGUF_LAYER,
)


def unpermute_gguf_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time reordering of q/k rows for the llama
    architecture (each head's rotary pairs interleaved), back to the
    half-split layout of Hugging Face checkpoints (transformers'
    LlamaTensorProcessor does the same)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class LlamaLoader(CheckpointLoader):
    """Builds LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    MistralForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM and
    Qwen3MoeForCausalLM (and GGUF files of llama, qwen2, qwen3)."""

    gguf_config = staticmethod(hf_config_from_gguf)

    def load_config(self, source: ModelSource) -> ModelConfig:
        cfg = self.hf_config(source)
        arch = arch_from_hf(cfg)
        return self.model_config(
            source,
            cfg,
            architecture=arch.architecture,
            **kit.decoder_sizes(arch),
            max_model_len=_max_model_len(arch),
            num_experts=arch.num_experts,
            sliding_window=max((w for w in arch.sliding_windows if w), default=None),
        )

    # ---- weights -----------------------------------------------------------------------

    def load_model(self, source: ModelSource, config: ModelConfig, ctx: LoadContext) -> LlamaForCausalLM:
        cfg = dict(config.raw) if config.raw else self.hf_config(source)
        arch = arch_from_hf(cfg)
        par = Parallel.from_ctx(ctx)
        par.check(arch.num_heads, arch.num_kv_heads, arch.num_experts)
        mine = par.local_experts(arch.num_experts) if arch.num_experts else None
        transform = None
        if source.format == "gguf":
            gguf = GGUFFile(source.path)
            tensors = GGUFWeights(gguf, ctx, arch.num_layers).tensors()
            names = GGUF_NAMES
            transform = _gguf_transform(gguf, arch)
        else:
            names = HF_NAMES
            fp8 = fp8_plan(cfg, ctx.ops, ctx.dtype, ctx.tp_size)  # FP8 weights: plinth_plugin_llama.fp8
            if fp8 is not None:
                tensors = fp8.tensors(source.path, names, ctx)
            else:
                tensors = iter_safetensors(source.path, dtype=ctx.dtype, progress=ctx.progress)
        found = kit.sort_tensors(tensors, names, arch.num_layers, experts=mine, transform=transform)
        return build_model(arch, found.top, found.layers, ctx, par)


def _gguf_transform(gguf: GGUFFile, arch: LlamaArch) -> Any:
    """What a llama.cpp file stores differently: q/k rows reordered at convert
    time (the llama architecture), frequency factors kept in float32."""
    permute = gguf.architecture == "llama"

    def transform(name: str, layer: int | None, key: str, tensor: Any) -> Any:
        if key == "rope_freqs":
            return gguf.tensor(name)  # frequency factors stay float32
        if permute and key in ("q", "q_bias", "k", "k_bias"):
            heads = arch.num_heads if key.startswith("q") else arch.num_kv_heads
            if isinstance(tensor, QuantizedWeight):  # rows of blocks: the same row order
                return dataclasses.replace(tensor, qweight=unpermute_gguf_rows(tensor.qweight, heads))
            return unpermute_gguf_rows(tensor, heads)
        return tensor

    return transform


def _max_model_len(arch: LlamaArch) -> int:
    rope = arch.rope
    if rope.get("rope_type") == "yarn" and rope.get("factor") and rope.get("original_max_position_embeddings"):
        return max(arch.max_position_embeddings, int(rope["original_max_position_embeddings"] * rope["factor"]))
    return arch.max_position_embeddings


def build_model(arch: LlamaArch, top: dict[str, torch.Tensor], per_layer: list[dict[str, torch.Tensor]], ctx: LoadContext, par: Parallel | None = None) -> LlamaForCausalLM:
    """Fuse q/k/v and gate/up (and each expert's gate/up), cut this rank's
    share, hand every linear weight to ``ops.pack_linear``. Quantized weights
    (GGUF blocks, FP8 ones already on the device) are fused in their format
    and packed as they are: no dense copy of them is made."""
    ops, device, dtype = ctx.ops, ctx.device, ctx.dtype
    par = par or Parallel()
    heads, kv_heads, hd = par.heads(arch.num_heads), par.kv_heads(arch.num_kv_heads), arch.head_dim
    first_rank = par.tp_rank == 0  # row-parallel biases are added once, before the all-reduce
    fp8_kept = 0

    def put(t: Any) -> Any:
        if isinstance(t, QuantizedWeight):  # kept in its blocks for pack_linear (tp = 1 only)
            if par.tp_size > 1:
                raise ConfigError("quantized weights are kept only at tp = 1")
            return t
        return None if t is None else t.to(device=device, dtype=dtype).contiguous()

    def fused(parts: tuple[Any, ...], where: str) -> Any:
        """The parts stacked and packed; FP8 parts whose block scales cannot stack are dequantized (on the device)."""
        nonlocal fp8_kept
        try:
            weight = kit.stack_rows(parts)
        except ValueError as exc:
            if not all(isinstance(p, QuantizedWeight) and p.format.startswith("fp8") for p in parts):
                raise
            log.info("%s: %s: kept dequantized", where, exc)
            weight = torch.cat([kit.dequantize_fp8(p, dtype) for p in parts])
        if isinstance(weight, QuantizedWeight) and weight.format.startswith("fp8"):
            fp8_kept += 1
        return ops.pack_linear(put(weight))

    def whole(cut: Any) -> Any:  # a cut to this rank's share; quantized weights are whole (tp = 1)
        return lambda t, *a: t if isinstance(t, QuantizedWeight) else cut(t, *a)

    def fused_bias(d: dict[str, torch.Tensor], keys: tuple[str, ...], sizes: list[int], cut: list[Any]) -> torch.Tensor | None:
        if not any(f"{k}_bias" in d for k in keys):
            return None
        return torch.cat([cut_fn(d[f"{k}_bias"]) if f"{k}_bias" in d else torch.zeros(n) for k, n, cut_fn in zip(keys, sizes, cut)])

    @whole
    def q_rows(t: torch.Tensor) -> torch.Tensor:
        return head_rows(t, heads, hd)

    @whole
    def kv_rows(t: torch.Tensor) -> torch.Tensor:
        return head_rows(t, kv_heads, hd)

    @whole
    def mlp_rows(t: torch.Tensor) -> torch.Tensor:  # column-parallel gate/up
        return t[par.split(t.shape[0])]

    @whole
    def mlp_cols(t: torch.Tensor) -> torch.Tensor:  # row-parallel down
        return t[:, par.split(t.shape[1])]

    o_cols = whole(head_cols)

    layers = []
    for i, d in enumerate(per_layer):
        where = f"layer {i}"
        layer = LlamaLayer()
        q, k, v = kit.need(d, "q", where), kit.need(d, "k", where), kit.need(d, "v", where)
        expected = (arch.num_heads * hd, arch.num_kv_heads * hd, arch.num_kv_heads * hd)
        if (q.shape[0], k.shape[0], v.shape[0]) != expected:
            raise ConfigError(f"{where}: q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} rows, the config implies {expected}")
        q, k, v = q_rows(q), kv_rows(k), kv_rows(v)
        layer.qkv = fused((q, k, v), f"{where} qkv")
        layer.qkv_bias = put(fused_bias(d, ("q", "k", "v"), [q.shape[0], k.shape[0], v.shape[0]], [q_rows, kv_rows, kv_rows]))
        layer.o_proj = fused((o_cols(kit.need(d, "o", where), heads, hd),), f"{where} o")
        layer.o_bias = put(d.get("o_bias")) if first_rank else None
        is_moe = bool(arch.num_experts) and i < len(arch.moe_layers) and arch.moe_layers[i]
        if is_moe:
            layer.moe = _build_moe(arch, d, where, ops, par, put)
        else:
            gate, up = mlp_rows(kit.need(d, "gate", where)), mlp_rows(kit.need(d, "up", where))
            layer.gate_up = fused((gate, up), f"{where} gate_up")
            layer.gate_up_bias = put(fused_bias(d, ("gate", "up"), [gate.shape[0], up.shape[0]], [mlp_rows, mlp_rows]))
            layer.down = fused((mlp_cols(kit.need(d, "down", where)),), f"{where} down")
            layer.down_bias = put(d.get("down_bias")) if first_rank else None
        layer.input_norm = put(kit.need(d, "input_norm", where))
        layer.post_norm = put(kit.need(d, "post_norm", where))
        if arch.qk_norm or "q_norm" in d:
            layer.q_norm, layer.k_norm = put(kit.need(d, "q_norm", where)), put(kit.need(d, "k_norm", where))
        layer.sliding_window = arch.sliding_windows[i] if i < len(arch.sliding_windows) else None
        layers.append(layer)
        d.clear()  # drop the unfused copies as we go

    first, rows = par.vocab(arch.vocab_size)
    embed_full = kit.need(top, "embed", "the embedding")
    embed = put(vocab_rows(embed_full, first, rows)) if par.tp_size > 1 else put(embed_full)
    lm_head = kit.output_head(top, embed, arch.tie_word_embeddings, family=arch.architecture)
    if lm_head is not embed:
        lm_head = put(vocab_rows(lm_head, first, rows)) if par.tp_size > 1 and not isinstance(lm_head, QuantizedWeight) else put(lm_head)
    cos_sin = kit.rope_cos_sin(
        arch.rope, arch.rotary_dim, arch.max_position_embeddings, _max_model_len(arch), freq_factors=top.get("rope_freqs"),
        family="the llama plugin",
    ).to(device)
    if fp8_kept:
        log.info("FP8: %d projections kept in FP8", fp8_kept)
    return LlamaForCausalLM(
        arch,
        ops,
        ctx.attention,
        cos_sin=cos_sin,
        embed=embed,
        norm=put(kit.need(top, "norm", "the final norm")),
        lm_head=ops.pack_linear(lm_head),
        layers=layers,
        par=par,
    )


def _build_moe(arch: LlamaArch, d: dict[str, torch.Tensor], where: str, ops: Any, par: Parallel, put: Any) -> MoEBlock:
    """This rank's experts as w13 [E_local, 2I', H] and w2 [E_local, H, I'] (I'
    = I / tp when ep = 1: each expert split like a dense MLP)."""
    inter = arch.moe_intermediate_size
    cut = par.split(inter) if par.ep_size == 1 else slice(0, inter)
    fused_gate_up = d.get("experts_gate_up")
    w13, w2 = [], []
    for e in par.local_experts(arch.num_experts):
        if fused_gate_up is not None:  # [E, 2I, H], [E, H, I]
            gate, up, down = fused_gate_up[e, :inter], fused_gate_up[e, inter:], kit.need(d, "experts_down", where)[e]
        else:
            gate, up, down = (kit.need(d, f"expert.{e}.{part}", f"{where}, expert {e}") for part in ("gate", "up", "down"))
        w13.append(torch.cat((gate[cut], up[cut])))
        w2.append(down[:, cut])
    shared = {}
    if arch.shared_expert_intermediate_size:
        gate, up = kit.need(d, "shared_gate_proj", where), kit.need(d, "shared_up", where)
        s = par.split(gate.shape[0])
        shared = dict(
            shared_gate_up=ops.pack_linear(put(torch.cat((gate[s], up[s])))),
            shared_down=ops.pack_linear(put(kit.need(d, "shared_down", where)[:, s])),
            shared_gate=ops.pack_linear(put(kit.need(d, "shared_expert_gate", where))),
        )
    return MoEBlock(
        ops,
        par,
        router=ops.pack_linear(put(kit.need(d, "router", where))),
        w13=put(torch.stack(w13)),
        w2=put(torch.stack(w2)),
        top_k=arch.num_experts_per_tok,
        renormalize=arch.norm_topk_prob,
        weights_in_activation_dtype=arch.architecture != "MixtralForCausalLM",
        **shared,
    )
