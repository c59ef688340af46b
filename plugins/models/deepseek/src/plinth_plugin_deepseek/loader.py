"""Loading DeepseekV3ForCausalLM checkpoints (DeepSeek-V3/R1, Kimi K2) from
a Hugging Face folder of safetensors (sharded or not), with the modelling
kit of ``plinth.api``: its name map, rope (yarn with mscale) and FP8 reader.
FP8 checkpoints (as DeepSeek-V3 is released) are streamed to the device shard
by shard in FP8, each weight dequantized there to the compute dtype: host
memory holds one shard's mapping and one tensor at a time."""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from plinth.api import (
    CheckpointLoader,
    ConfigError,
    LoadContext,
    ModelConfig,
    ModelSource,
    iter_safetensors,
    local_experts,
)
from plinth.api import modelling as kit

from plinth_plugin_deepseek.model import DeepseekArch, DeepseekLayer, DeepseekRouter, DeepseekV3ForCausalLM

log = logging.getLogger("plinth.deepseek")

# the kit's decoder names (norms, the dense layers' MLP), then MLA's
# projections, the router and the shared experts
_LAYER = {
    **{k: v for k, v in kit.HF_DECODER_LAYER.items() if v in ("input_norm", "post_norm", "gate", "up", "down")},
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.o_proj.weight": "o_proj",
    **{f"self_attn.{p}.weight": key for p, key in (("q_a_proj", "q_a"), ("q_a_layernorm", "q_a_norm"), ("q_b_proj", "q_b"),
                                                   ("kv_a_proj_with_mqa", "kv_a"), ("kv_a_layernorm", "kv_a_norm"), ("kv_b_proj", "kv_b"))},
    "mlp.gate.weight": "router",
    "mlp.gate.e_score_correction_bias": "router_bias",
    **{f"mlp.shared_experts.{p}_proj.weight": f"shared_{p}" for p in ("gate", "up", "down")},
    # transformers 5's in-memory fused experts
    "mlp.experts.gate_up_proj": "experts_gate_up",
    "mlp.experts.down_proj": "experts_down",
}  # fmt: skip
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
NAMES = kit.NameMap(kit.HF_DECODER_TOP, _LAYER, experts=_EXPERT_RE, expert_parts={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})
#: kept in float32 whatever the model's dtype, as transformers keeps them
_FLOAT32 = ("router", "router_bias")


def softmax_scale(arch: DeepseekArch) -> float:
    """1/sqrt(qk_head_dim), times yarn's mscale(factor, mscale_all_dim)
    squared: MLA scales the non-rotary dims too (transformers'
    ``yarn_apply_mscale``, DeepSeek's ``softmax_scale``)."""
    return (arch.qk_nope_head_dim + arch.qk_rope_head_dim) ** -0.5 * kit.yarn_softmax_scale(arch.rope)


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
            # the cache is one latent "head" per token: kv_lora_rank + the rope key, no separate V
            **kit.decoder_sizes(arch, num_kv_heads=1, head_dim=arch.kv_lora_rank + arch.qk_rope_head_dim),
            v_head_dim=0,
            max_model_len=arch.max_position_embeddings,
            num_experts=arch.n_routed_experts,
        )

    def load_model(self, source: ModelSource, config: ModelConfig, ctx: LoadContext) -> DeepseekV3ForCausalLM:
        cfg = dict(config.raw) if config.raw else self.hf_config(source)
        if cfg["num_attention_heads"] % ctx.tp_size:
            raise ConfigError(f"tp={ctx.tp_size} does not divide the {cfg['num_attention_heads']} attention heads")
        block = kit.fp8_block_size(cfg)
        if block is None:
            raise ConfigError(f"the deepseek plugin loads block-scaled FP8 checkpoints (weight_block_size), not {cfg['quantization_config']}")
        arch = DeepseekArch.from_hf(cfg)
        mine = rank_experts(arch, ctx)  # refuses an ep the experts cannot split over

        def wanted(name: str) -> bool:  # another ep rank's experts are never read
            where = NAMES(name)
            return where is None or not where[1].startswith("expert.") or int(where[1].split(".")[1]) in mine

        if isinstance(block, tuple):  # FP8: to the device shard by shard in FP8, dequantized there
            # the rest as stored: build_model casts (the router stays float32, as transformers keeps it)
            tensors = kit.iter_fp8_checkpoint(
                source.path, block, device=ctx.device, dtype=ctx.dtype, select=wanted, progress=ctx.progress, cast_others=False,
            )
        else:
            tensors = iter_safetensors(source.path, dtype=None, progress=ctx.progress, select=wanted)
        found = kit.sort_tensors(tensors, NAMES, arch.num_layers, experts=mine)  # layer 61 (MTP) of V3 is not used
        return build_model(arch, found.top, found.layers, ctx)


def rank_experts(arch: DeepseekArch, ctx: LoadContext) -> range:
    """The routed experts this ep rank keeps (all of them at ep = 1)."""
    return local_experts(arch.n_routed_experts, ctx.ep_rank, ctx.ep_size, has_a2a=ctx.a2a is not None)


def build_model(arch: DeepseekArch, top: dict[str, torch.Tensor], per_layer: list[dict[str, torch.Tensor]], ctx: LoadContext) -> DeepseekV3ForCausalLM:
    ops, device, dtype = ctx.ops, ctx.device, ctx.dtype

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
        layer.input_norm = put(kit.need(d, "input_norm", where))
        layer.post_norm = put(kit.need(d, "post_norm", where))
        if arch.q_lora_rank:
            layer.q_a, layer.q_b = linear(kit.need(d, "q_a", where)), linear(head_rows(kit.need(d, "q_b", where), dn + dr))
            layer.q_a_norm = put(kit.need(d, "q_a_norm", where))
        else:
            layer.q_proj = linear(head_rows(kit.need(d, "q_proj", where), dn + dr))
        layer.kv_a = linear(kit.need(d, "kv_a", where))
        layer.kv_a_norm = put(kit.need(d, "kv_a_norm", where))
        kv_b = kit.need(d, "kv_b", where)
        if tuple(kv_b.shape) != (arch.num_heads * (dn + dv), rank):
            raise ConfigError(f"{where}: kv_b_proj is {tuple(kv_b.shape)}, the config implies {(arch.num_heads * (dn + dv), rank)}")
        w_uk, w_uv = put(kv_b).view(arch.num_heads, dn + dv, rank)[mine].split((dn, dv), dim=1)
        layer.w_uk, layer.w_uv = w_uk.contiguous(), w_uv.contiguous()  # [heads, dn, L], [heads, dv, L]
        layer.o_proj = linear(kit.need(d, "o_proj", where)[:, mine.start * dv : mine.stop * dv])
        if arch.is_moe(i):
            _build_moe(arch, layer, d, where, put, linear, split, rank_experts(arch, ctx), whole=ctx.ep_size > 1)
        else:
            cut = split(arch.intermediate_size)
            layer.gate_up = linear(torch.cat((kit.need(d, "gate", where)[cut], kit.need(d, "up", where)[cut])))
            layer.down = linear(kit.need(d, "down", where)[:, cut])
        layers.append(layer)
        d.clear()

    embed = put(kit.need(top, "embed", "the embedding"))
    lm_head = kit.output_head(top, embed, arch.tie_word_embeddings, family="DeepseekV3ForCausalLM")
    # the rope part's table: yarn with its mscale, as transformers computes it
    cos_sin = kit.rope_cos_sin(arch.rope, arch.qk_rope_head_dim, arch.max_position_embeddings, arch.max_position_embeddings,
                           family="the deepseek plugin")  # fmt: skip
    return DeepseekV3ForCausalLM(
        arch,
        ops,
        ctx.attention,
        cos_sin=cos_sin.to(device),
        scale=softmax_scale(arch),
        embed=embed,
        norm=put(kit.need(top, "norm", "the final norm")),
        lm_head=ops.pack_linear(put(lm_head)),
        layers=layers,
        num_heads=heads,
        tp_group=ctx.tp_group if tp > 1 else None,
        tp_rank=tp_rank,
        tp_size=tp,
        a2a=ctx.a2a if ctx.ep_size > 1 else None,
        fixed_order=ctx.deterministic,
    )


def _build_moe(arch: DeepseekArch, layer: DeepseekLayer, d: dict[str, torch.Tensor], where: str, put: Any,
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
            gate, up, down = fused[e, :inter], fused[e, inter:], kit.need(d, "experts_down", where)[e]
        else:
            gate, up, down = (kit.need(d, f"expert.{e}.{part}", f"{where}, expert {e}") for part in ("gate", "up", "down"))
        if tuple(gate.shape) != (inter, arch.hidden_size):
            raise ConfigError(f"{where}: expert {e}'s gate is {tuple(gate.shape)}, the config implies {(inter, arch.hidden_size)}")
        w13.append(torch.cat((gate[cut], up[cut])))
        w2.append(down[:, cut])
    layer.w13, layer.w2 = put(torch.stack(w13)), put(torch.stack(w2))
    if arch.n_routed_experts % arch.n_group:
        raise ConfigError(f"{arch.n_routed_experts} routed experts do not split into n_group = {arch.n_group} groups")
    bias = d.get("router_bias")
    layer.router = DeepseekRouter(put(kit.need(d, "router", where), "router"), None if bias is None else put(bias, "router_bias"), arch)
    if arch.n_shared_experts:
        s = split(inter * arch.n_shared_experts)
        layer.shared_gate_up = linear(torch.cat((kit.need(d, "shared_gate", where)[s], kit.need(d, "shared_up", where)[s])))
        layer.shared_down = linear(kit.need(d, "shared_down", where)[:, s])
