"""Loading DeepseekV3ForCausalLM checkpoints (DeepSeek-V3/R1, Kimi K2) from
a Hugging Face folder of safetensors (sharded or not)."""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Sequence

import torch
from plinth.api import (
    BASE_OPS,
    CheckpointLoader,
    ConfigError,
    LoadContext,
    ModelConfig,
    ModelSource,
    iter_safetensors,
    local_experts,
)

from plinth_plugin_deepseek.model import DeepseekArch, DeepseekLayer, DeepseekRouter, DeepseekV3ForCausalLM

log = logging.getLogger("plinth.deepseek")

_GLOBAL = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
_LAYER = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.q_a_proj.weight": "q_a",
    "self_attn.q_a_layernorm.weight": "q_a_norm",
    "self_attn.q_b_proj.weight": "q_b",
    "self_attn.kv_a_proj_with_mqa.weight": "kv_a",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm",
    "self_attn.kv_b_proj.weight": "kv_b",
    "self_attn.o_proj.weight": "o_proj",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
    "mlp.gate.weight": "router",
    "mlp.gate.e_score_correction_bias": "router_bias",
    "mlp.shared_experts.gate_proj.weight": "shared_gate",
    "mlp.shared_experts.up_proj.weight": "shared_up",
    "mlp.shared_experts.down_proj.weight": "shared_down",
    # transformers 5's in-memory fused experts
    "mlp.experts.gate_up_proj": "experts_gate_up",
    "mlp.experts.down_proj": "experts_down",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
#: kept in float32 whatever the model's dtype, as transformers keeps them
_FLOAT32 = ("router", "router_bias")


def _map_name(name: str) -> tuple[int | None, str] | None:
    if name in _GLOBAL:
        return None, _GLOBAL[name]
    m = _LAYER_RE.match(name)
    if not m:
        return None
    if m.group(2) in _LAYER:
        return int(m.group(1)), _LAYER[m.group(2)]
    e = _EXPERT_RE.match(m.group(2))
    if e:
        return int(m.group(1)), f"expert.{int(e.group(1))}.{e.group(2).removesuffix('_proj')}"
    return None


# ---- rope: transformers' modeling_rope_utils (default, yarn), operation for operation in float32 ----


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_scaling(rope: dict, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], cos/sin scaling) of the rope part."""
    base = float(rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", "default")
    default = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if kind == "default":
        return default, 1.0
    if kind != "yarn":
        raise ConfigError(f"rope type {kind!r} is not supported by the deepseek plugin (default, yarn)")
    original_max = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / original_max
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def softmax_scale(arch: DeepseekArch) -> float:
    """1/sqrt(qk_head_dim), times yarn's mscale(factor, mscale_all_dim)
    squared: MLA scales the non-rotary dims too (transformers'
    ``yarn_apply_mscale``, DeepSeek's ``softmax_scale``)."""
    scale = (arch.qk_nope_head_dim + arch.qk_rope_head_dim) ** -0.5
    rope = arch.rope
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = _yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * m * m
    return scale


def cos_sin_table(arch: DeepseekArch) -> torch.Tensor:
    """[max_positions, rope_dim] float32: cos of every position's angles, then their sin."""
    inv_freq, scaling = inv_freq_and_scaling(arch.rope, arch.qk_rope_head_dim, arch.max_position_embeddings)
    angles = torch.arange(arch.max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos() * scaling, angles.sin() * scaling), dim=-1)


# ---- FP8 checkpoints (DeepSeek-V3/R1, Kimi K2 as released) ----


def fp8_block_size(cfg: dict) -> tuple[int, int] | None:
    """The weight blocks of a block-scaled FP8 checkpoint, None when not
    quantized; other quantizations are refused."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    block = quant.get("weight_block_size")
    if quant.get("quant_method") != "fp8" or not block or len(block) != 2:
        raise ConfigError(f"the deepseek plugin loads block-scaled FP8 checkpoints (quant_method fp8 with weight_block_size), not {quant}")
    return int(block[0]), int(block[1])


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 weight [out, in] from FP8 values and one float32 scale per
    block [ceil(out / b0), ceil(in / b1)] (DeepSeek's ``weight_dequant``:
    w = fp8 * scale_inv, edge blocks cut to the weight)."""
    out, inp = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return weight.float() * scale


def _dequantized(tensors: Any, block: tuple[int, int] | None) -> Any:
    """The checkpoint's tensors with FP8 weights dequantized to float32 at
    load (no backend op keeps DeepSeek's FP8 here yet): FP8 weights wait for
    their ``weight_scale_inv``, which may come later or from another shard."""
    if block is None:
        yield from tensors
        return
    waiting: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith("_scale_inv"):
            weight = name.removesuffix("_scale_inv")
            if weight in waiting:
                yield weight, dequantize_fp8(waiting.pop(weight), tensor, block)
            else:
                scales[weight] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            if name in scales:
                yield name, dequantize_fp8(tensor, scales.pop(name), block)
            else:
                waiting[name] = tensor
        else:
            yield name, tensor
    if waiting:
        raise ConfigError(f"FP8 weights without a weight_scale_inv: {sorted(waiting)[:3]}")


class DeepseekLoader(CheckpointLoader):
    """Builds DeepseekV3ForCausalLM (Hugging Face folders; config, tokenizer
    and special tokens as every loader reads them: ``CheckpointLoader``)."""

    def load_config(self, source: ModelSource) -> ModelConfig:
        cfg = self.hf_config(source)
        arch = DeepseekArch.from_hf(cfg)
        return self.model_config(
            source,
            cfg,
            architecture="DeepseekV3ForCausalLM",
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            num_layers=arch.num_layers,
            num_heads=arch.num_heads,
            # the cache is one latent "head" per token: kv_lora_rank + the rope key, no separate V
            num_kv_heads=1,
            head_dim=arch.kv_lora_rank + arch.qk_rope_head_dim,
            v_head_dim=0,
            max_model_len=arch.max_position_embeddings,
            num_experts=arch.n_routed_experts,
        )

    def required_ops(self, config: ModelConfig) -> Sequence[str]:
        # attention goes through this plugin's MLA ops (mla.py) over the attention backend's pages
        return BASE_OPS + (("fused_moe",) if config.num_experts else ())

    def load_model(self, source: ModelSource, config: ModelConfig, ctx: LoadContext) -> DeepseekV3ForCausalLM:
        cfg = dict(config.raw) if config.raw else self.hf_config(source)
        if cfg["num_attention_heads"] % ctx.tp_size:
            raise ConfigError(f"tp={ctx.tp_size} does not divide the {cfg['num_attention_heads']} attention heads")
        block = fp8_block_size(cfg)
        arch = DeepseekArch.from_hf(cfg)
        mine = rank_experts(arch, ctx)  # refuses an ep the experts cannot split over
        top: dict[str, torch.Tensor] = {}
        per_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(arch.num_layers)]
        for name, tensor in _dequantized(iter_safetensors(source.path, dtype=None, progress=ctx.progress), block):
            where = _map_name(name)
            if where is None:
                log.debug("ignoring checkpoint tensor %s", name)
                continue
            layer, key = where
            if key.startswith("expert.") and int(key.split(".")[1]) not in mine:
                continue  # another ep rank's expert: never kept
            if layer is None:
                top[key] = tensor
            elif layer < arch.num_layers:  # DeepSeek-V3's multi-token-prediction layer (61) is not used
                per_layer[layer][key] = tensor
        return build_model(arch, top, per_layer, ctx)


def rank_experts(arch: DeepseekArch, ctx: LoadContext) -> range:
    """The routed experts this ep rank keeps (all of them at ep = 1)."""
    return local_experts(arch.n_routed_experts, ctx.ep_rank, ctx.ep_size, has_a2a=ctx.a2a is not None)


def build_model(arch: DeepseekArch, top: dict[str, torch.Tensor], per_layer: list[dict[str, torch.Tensor]], ctx: LoadContext) -> DeepseekV3ForCausalLM:
    ops, device, dtype = ctx.ops, ctx.device, ctx.dtype

    def need(d: dict[str, torch.Tensor], key: str, where: str) -> torch.Tensor:
        if key not in d:
            raise ConfigError(f"the checkpoint has no {key} weight for {where}")
        return d[key]

    def put(t: torch.Tensor, key: str = "") -> torch.Tensor:
        return t.to(device=device, dtype=torch.float32 if key in _FLOAT32 else dtype).contiguous()

    def linear(t: torch.Tensor) -> Any:
        return ops.pack_linear(put(t))

    dn, dr, dv, rank = arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim, arch.kv_lora_rank
    tp, tp_rank = ctx.tp_size, ctx.tp_rank
    heads = arch.num_heads // tp  # this rank's heads: the latent cache is whole on every rank, as in vLLM
    mine = slice(tp_rank * heads, (tp_rank + 1) * heads)

    def head_rows(t: torch.Tensor, per_head: int) -> torch.Tensor:
        return t.view(arch.num_heads, per_head, *t.shape[1:])[mine].reshape(heads * per_head, *t.shape[1:])

    def split(size: int) -> slice:  # this rank's slice of an MLP's intermediate dimension
        if size % tp:
            raise ConfigError(f"tp={tp} does not divide an intermediate size of {size}")
        return slice(tp_rank * size // tp, (tp_rank + 1) * size // tp)

    layers = []
    for i, d in enumerate(per_layer):
        where = f"layer {i}"
        layer = DeepseekLayer()
        layer.input_norm = put(need(d, "input_norm", where))
        layer.post_norm = put(need(d, "post_norm", where))
        if arch.q_lora_rank:
            layer.q_a, layer.q_b = linear(need(d, "q_a", where)), linear(head_rows(need(d, "q_b", where), dn + dr))
            layer.q_a_norm = put(need(d, "q_a_norm", where))
        else:
            layer.q_proj = linear(head_rows(need(d, "q_proj", where), dn + dr))
        layer.kv_a = linear(need(d, "kv_a", where))
        layer.kv_a_norm = put(need(d, "kv_a_norm", where))
        kv_b = need(d, "kv_b", where)
        if tuple(kv_b.shape) != (arch.num_heads * (dn + dv), rank):
            raise ConfigError(f"{where}: kv_b_proj is {tuple(kv_b.shape)}, the config implies {(arch.num_heads * (dn + dv), rank)}")
        w_uk, w_uv = put(kv_b).view(arch.num_heads, dn + dv, rank)[mine].split((dn, dv), dim=1)
        layer.w_uk, layer.w_uv = w_uk.contiguous(), w_uv.contiguous()  # [heads, dn, L], [heads, dv, L]
        layer.o_proj = linear(need(d, "o_proj", where)[:, mine.start * dv : mine.stop * dv])
        if arch.is_moe(i):
            _build_moe(arch, layer, d, where, put, need, linear, split, rank_experts(arch, ctx), whole=ctx.ep_size > 1)
        else:
            cut = split(arch.intermediate_size)
            layer.gate_up = linear(torch.cat((need(d, "gate", where)[cut], need(d, "up", where)[cut])))
            layer.down = linear(need(d, "down", where)[:, cut])
        layers.append(layer)
        d.clear()

    embed = put(need(top, "embed", "the embedding"))
    lm_head = top.get("lm_head")
    if lm_head is None:
        if not arch.tie_word_embeddings:
            log.warning("the checkpoint has no lm_head: tying it to the embedding")
        lm_head = embed
    return DeepseekV3ForCausalLM(
        arch,
        ops,
        ctx.attention,
        cos_sin=cos_sin_table(arch).to(device),
        scale=softmax_scale(arch),
        embed=embed,
        norm=put(need(top, "norm", "the final norm")),
        lm_head=ops.pack_linear(put(lm_head)),
        layers=layers,
        num_heads=heads,
        tp_group=ctx.tp_group if tp > 1 else None,
        tp_rank=tp_rank,
        tp_size=tp,
        a2a=ctx.a2a if ctx.ep_size > 1 else None,
        fixed_order=ctx.deterministic,
    )


def _build_moe(arch: DeepseekArch, layer: DeepseekLayer, d: dict[str, torch.Tensor], where: str, put: Any, need: Any,
               linear: Any, split: Any, experts: range, *, whole: bool) -> None:
    """The router, this rank's experts as w13 [E', 2I', H] / w2 [E', H, I']
    for ``fused_moe``, and the shared experts as one dense MLP. At ep = 1
    E' = E and I' = I / tp (each expert split over tp like a dense MLP); at
    ep > 1 the rank's experts are whole (I' = I) and E' its share."""
    inter = arch.moe_intermediate_size
    cut = slice(0, inter) if whole else split(inter)
    fused = d.get("experts_gate_up")
    w13, w2 = [], []
    for e in experts:
        if fused is not None:
            gate, up, down = fused[e, :inter], fused[e, inter:], need(d, "experts_down", where)[e]
        else:
            gate, up, down = (need(d, f"expert.{e}.{part}", f"{where}, expert {e}") for part in ("gate", "up", "down"))
        if tuple(gate.shape) != (inter, arch.hidden_size):
            raise ConfigError(f"{where}: expert {e}'s gate is {tuple(gate.shape)}, the config implies {(inter, arch.hidden_size)}")
        w13.append(torch.cat((gate[cut], up[cut])))
        w2.append(down[:, cut])
    layer.w13, layer.w2 = put(torch.stack(w13)), put(torch.stack(w2))
    if arch.n_routed_experts % arch.n_group:
        raise ConfigError(f"{arch.n_routed_experts} routed experts do not split into n_group = {arch.n_group} groups")
    bias = d.get("router_bias")
    layer.router = DeepseekRouter(put(need(d, "router", where), "router"), None if bias is None else put(bias, "router_bias"), arch)
    if arch.n_shared_experts:
        s = split(inter * arch.n_shared_experts)
        layer.shared_gate_up = linear(torch.cat((need(d, "shared_gate", where)[s], need(d, "shared_up", where)[s])))
        layer.shared_down = linear(need(d, "shared_down", where)[:, s])
