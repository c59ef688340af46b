"""The DeepSeek-V3 decoder (Kimi K2 shares it), computing through the
backend's ops and this plugin's MLA ops.

Per layer: rms_norm (fused with the residual add), multi-head latent
attention (mla.py), rms_norm, then a dense MLP for the first
``first_k_dense_replace`` layers and a routed mixture of experts with shared
experts after them. Routing is DeepSeek's noaux_tc, as transformers'
``DeepseekV3TopkRouter`` computes it: sigmoid scores in float32, the
``e_score_correction_bias`` added for choosing only, experts chosen inside
the ``topk_group`` best of ``n_group`` groups (a group scored by its two best
biased scores), weights from the unbiased scores, renormalized when
``norm_topk_prob``, times ``routed_scaling_factor``. With tensor
parallelism a rank holds its share of the heads and of every MLP's
intermediate dimension, and the layer's two outputs are all-reduced. With
expert parallelism (ep > 1) a rank keeps its run of routed experts whole
(``plinth.api.expert_ranges``) and their tokens travel through the a2a
plugin (``plinth.api.routed_experts``, the path every MoE model shares); the
shared experts stay a dense MLP, split over tp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed
from plinth.api import (
    AllToAll,
    AttentionBackend,
    AttentionMetadata,
    LayerWeights,
    all_reduce_sum,
    decoder_weight_bytes,
    rope_from_hf,
    routed_experts,
)

from plinth_plugin_deepseek import mla
from plinth_plugin_deepseek.mla import MLALatentSpec


@dataclass(frozen=True)
class DeepseekArch:
    """The config.json fields the model reads."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: dict

    @classmethod
    def from_hf(cls, cfg: dict) -> "DeepseekArch":
        rope = rope_from_hf(cfg)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            intermediate_size=cfg["intermediate_size"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
            n_routed_experts=cfg.get("n_routed_experts") or 0,
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 1),
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope=rope,
        )

    def is_moe(self, layer: int) -> bool:
        return bool(self.n_routed_experts) and layer >= self.first_k_dense_replace


class DeepseekRouter:
    """noaux_tc grouped top-k (see the module docstring); weight float32 [E, H]."""

    __slots__ = ("weight", "bias", "top_k", "n_group", "topk_group", "renormalize", "scaling")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, arch: DeepseekArch) -> None:
        self.weight = weight
        self.bias = bias
        self.top_k, self.n_group, self.topk_group = arch.num_experts_per_tok, arch.n_group, arch.topk_group
        self.renormalize, self.scaling = arch.norm_topk_prob, arch.routed_scaling_factor

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights float32, topk_ids) [T, K]."""
        scores = torch.nn.functional.linear(x.float(), self.weight).sigmoid()
        choice = scores if self.bias is None else scores + self.bias
        num_tokens, num_experts = choice.shape
        if self.n_group > 1:
            per_group = choice.view(num_tokens, self.n_group, num_experts // self.n_group)
            group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
            best = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class DeepseekLayer(LayerWeights):
    """One decoder layer's weights (no compute of its own)."""

    __slots__ = (
        "input_norm", "q_proj", "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "w_uk", "w_uv", "o_proj", "post_norm",
        "gate_up", "down", "router", "w13", "w2", "shared_gate_up", "shared_down",
    )


class DeepseekV3ForCausalLM(torch.nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, H];
    compute_logits(hidden [N, H]) -> float32 logits [N, vocab]."""

    def __init__(self, arch: DeepseekArch, ops: Any, attention: AttentionBackend[Any], *, cos_sin: torch.Tensor, scale: float, embed: torch.Tensor,
                 norm: torch.Tensor, lm_head: Any, layers: Sequence[DeepseekLayer], num_heads: int | None = None,
                 tp_group: Any = None, tp_rank: int = 0, tp_size: int = 1, a2a: AllToAll | None = None,
                 fixed_order: bool = False) -> None:
        super().__init__()
        self.arch, self.ops = arch, ops
        #: the attention backend allocates the pages; the MLA ops read them in its layout
        self.attention = attention
        self.layout = attention.layout
        #: this rank's heads; with tp > 1 the o and down projections give partial sums, all-reduced over tp_group
        self.num_heads = num_heads or arch.num_heads
        self.tp_group, self.tp_rank, self.tp_size = tp_group, tp_rank, tp_size
        #: deterministic serving: the tp sum in rank order (``plinth.api.all_reduce_sum``)
        self.fixed_order = fixed_order
        #: with ep > 1 the routed experts' tokens go through this plugin (w13 / w2 hold this rank's experts)
        self.a2a = a2a
        self.cos_sin, self.scale = cos_sin, scale
        self.embed, self.norm, self.lm_head = embed, norm, lm_head
        self.layers = list(layers)
        # a backend's own MLA ops when its table has them, the reference otherwise (looked up once)
        self.mla_prefill = getattr(ops, "mla_prefill", None) or mla.mla_prefill
        self.mla_decode = getattr(ops, "mla_decode", None) or mla.mla_decode

    def kv_cache_specs(self) -> list[MLALatentSpec]:
        """Every layer caches one latent and one rope key per token."""
        spec = MLALatentSpec(self.arch.kv_lora_rank, self.arch.qk_rope_head_dim)
        return [spec] * len(self.layers)

    def self_attention(self, layer: DeepseekLayer, x: torch.Tensor, positions: torch.Tensor, kv_cache: Any, meta: AttentionMetadata) -> torch.Tensor:
        ops, arch, eps = self.ops, self.arch, self.arch.rms_norm_eps
        num_tokens = x.shape[0]
        if layer.q_proj is not None:
            q = ops.linear(x, layer.q_proj)
        else:
            q = ops.linear(ops.rms_norm(ops.linear(x, layer.q_a), layer.q_a_norm, eps), layer.q_b)
        q = q.view(num_tokens, self.num_heads, arch.qk_nope_head_dim + arch.qk_rope_head_dim)
        q_nope, q_pe = q.split((arch.qk_nope_head_dim, arch.qk_rope_head_dim), dim=-1)
        latent, k_pe = ops.linear(x, layer.kv_a).split((arch.kv_lora_rank, arch.qk_rope_head_dim), dim=-1)
        latent = ops.rms_norm(latent.contiguous(), layer.kv_a_norm, eps)
        # DeepSeek's rope pairs are interleaved (GPT-J style): is_neox=False
        q_pe, k_pe = ops.rotary(q_pe.contiguous(), k_pe.reshape(num_tokens, 1, -1), positions, self.cos_sin, False)
        attend = self.mla_decode if meta.is_decode_only else self.mla_prefill
        pages = mla.latent_pages(self.layout, kv_cache)
        out = attend(q_nope, q_pe, latent, k_pe.reshape(num_tokens, -1), pages, meta, w_uk=layer.w_uk, w_uv=layer.w_uv, scale=self.scale)
        return ops.linear(out.reshape(num_tokens, -1), layer.o_proj)

    def mlp(self, layer: DeepseekLayer, x: torch.Tensor, decode: bool) -> torch.Tensor:
        ops = self.ops
        if layer.router is None:
            return ops.linear(ops.silu_and_mul(ops.linear(x, layer.gate_up)), layer.down)
        weights, ids = layer.router(x)
        y = routed_experts(ops, x, layer.w13, layer.w2, weights, ids, a2a=self.a2a, decode=decode,
                           tp_rank=self.tp_rank, tp_size=self.tp_size)
        if layer.shared_gate_up is not None:
            y = y + ops.linear(ops.silu_and_mul(ops.linear(x, layer.shared_gate_up)), layer.shared_down)
        return y

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[Any], meta: AttentionMetadata) -> torch.Tensor:
        rms_norm, eps = self.ops.rms_norm, self.arch.rms_norm_eps
        hidden = torch.nn.functional.embedding(input_ids, self.embed)
        residual = None
        decode = meta.is_decode_only if meta.moe_decode is None else meta.moe_decode  # agreed over the expert group
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if residual is None:
                residual = hidden
                x = rms_norm(hidden, layer.input_norm, eps)
            else:
                x, residual = rms_norm(hidden, layer.input_norm, eps, residual)
            hidden = self.all_reduce(self.self_attention(layer, x, positions, kv_cache, meta.for_layer(i)))
            x, residual = rms_norm(hidden, layer.post_norm, eps, residual)
            hidden = self.all_reduce(self.mlp(layer, x, decode))
        if residual is None:
            return rms_norm(hidden, self.norm, eps)
        hidden, _ = rms_norm(hidden, self.norm, eps, residual)
        return hidden

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(x, self.tp_group, fixed_order=self.fixed_order)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.lm_head).float()

    def weights(self) -> list[Any]:
        out = [self.embed, self.norm, self.lm_head, self.cos_sin]
        for layer in self.layers:
            out.extend(getattr(layer, name) for name in DeepseekLayer.__slots__ if name != "router")
            if layer.router is not None:
                out.extend(w for w in (layer.router.weight, layer.router.bias) if w is not None)
        return [w for w in out if w is not None]

    def weight_bytes(self, *, per_token: bool = False) -> int:
        """Bytes the weights take (each object once); ``per_token``: without
        the input embedding and the rotary table, which a decode step reads a
        row of."""
        return decoder_weight_bytes(self.weights(), tables=[self.cos_sin], embed=self.embed, lm_head=self.lm_head, per_token=per_token)
