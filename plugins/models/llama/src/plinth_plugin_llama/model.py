"""The dense Llama-family decoder, computing only through the backend's ops.

Per layer: rms_norm (fused with the residual add), one fused q/k/v linear,
optional per-head q/k norms (Qwen3), rotary, paged attention, the output
linear, rms_norm, one fused gate/up linear, silu_and_mul, the down linear.
Weights live as plain attributes in what ``ops.pack_linear`` returned, so a
backend may keep them in its own layout. MoE layers (Mixtral, Qwen2/3-MoE)
hold a ``MoEBlock`` in place of gate/up/down. With tensor parallelism the
weights are this rank's shard (see ``parallel``) and the layers all-reduce
after the row-parallel o and down projections.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from plinth.api import (
    AttentionBackend,
    AttentionMetadata,
    FullAttentionSpec,
    KVCacheSpec,
    LayerWeights,
    SlidingWindowSpec,
    decoder_weight_bytes,
)

from plinth_plugin_llama.arch import LlamaArch
from plinth_plugin_llama.parallel import Parallel


class LlamaLayer(LayerWeights):
    """One decoder layer's weights (no compute of its own)."""

    __slots__ = (
        "input_norm",
        "qkv",
        "qkv_bias",
        "q_norm",
        "k_norm",
        "o_proj",
        "o_bias",
        "post_norm",
        "gate_up",
        "gate_up_bias",
        "down",
        "down_bias",
        "moe",
        "sliding_window",
    )


class LlamaForCausalLM(torch.nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, H];
    compute_logits(hidden [N, H]) -> float32 logits [N, vocab]."""

    def __init__(self, arch: LlamaArch, ops: Any, attention: AttentionBackend[Any], *, cos_sin: torch.Tensor, embed: torch.Tensor, norm: torch.Tensor, lm_head: Any, layers: Sequence[LlamaLayer], par: Parallel | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.ops = ops
        self.attention = attention
        self.par = par = par or Parallel()
        #: this rank's heads (all of them with one rank)
        self.num_heads = len(par.heads(arch.num_heads))
        self.num_kv_heads = len(par.kv_heads(arch.num_kv_heads))
        self.vocab_start, self.vocab_rows = par.vocab(arch.vocab_size)
        self.layers = list(layers)
        self.embed = embed
        self.norm = norm
        self.lm_head = lm_head
        self.cos_sin = cos_sin
        self.eps = arch.rms_norm_eps
        self.scale = arch.head_dim**-0.5
        self.q_size = self.num_heads * arch.head_dim
        self.kv_size = self.num_kv_heads * arch.head_dim
        #: the attention backend's fused block, when it offers one (asked once)
        self.qkv_attention = attention.qkv_fusion()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[Any], meta: AttentionMetadata) -> torch.Tensor:
        ops = self.ops
        rms_norm, linear, rotary, silu_and_mul = ops.rms_norm, ops.linear, ops.rotary, ops.silu_and_mul
        attention = self.attention.forward
        eps, scale, cos_sin, qkv_attention = self.eps, self.scale, self.cos_sin, self.qkv_attention
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.arch.head_dim
        q_size, kv_size = self.q_size, self.kv_size
        num_tokens = input_ids.shape[0]
        tp = self.par.tp_size > 1
        all_reduce = self.par.all_reduce
        decode = meta.is_decode_only if meta.moe_decode is None else meta.moe_decode  # agreed over the expert group

        hidden = self.embedding(input_ids)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            layer_meta = meta.for_layer(i)  # its KV-cache group's pages (sliding and full layers differ)
            if residual is None:
                residual = hidden
                x = rms_norm(hidden, layer.input_norm, eps)
            else:
                x, residual = rms_norm(hidden, layer.input_norm, eps, residual)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            if qkv_attention is not None and layer.q_norm is None:
                out = qkv_attention(
                    qkv, positions, cos_sin, True, kv_cache, layer_meta, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, scale=scale, sliding_window=layer.sliding_window,
                )
            else:
                q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
                q = q.view(num_tokens, num_heads, head_dim)
                k = k.view(num_tokens, num_kv_heads, head_dim)
                v = v.view(num_tokens, num_kv_heads, head_dim)
                if layer.q_norm is not None:
                    q = rms_norm(q, layer.q_norm, eps)
                    k = rms_norm(k, layer.k_norm, eps)
                q, k = rotary(q, k, positions, cos_sin, True)
                out = attention(q, k, v, kv_cache, layer_meta, scale=scale, sliding_window=layer.sliding_window)
            hidden = linear(out.reshape(num_tokens, q_size), layer.o_proj, layer.o_bias)
            if tp:
                hidden = all_reduce(hidden)
            x, residual = rms_norm(hidden, layer.post_norm, eps, residual)
            if layer.moe is not None:
                hidden = layer.moe(x, decode)
            else:
                hidden = linear(silu_and_mul(linear(x, layer.gate_up, layer.gate_up_bias)), layer.down, layer.down_bias)
            if tp:
                hidden = all_reduce(hidden)
        if residual is None:  # no layers
            return rms_norm(hidden, self.norm, eps)
        hidden, _ = rms_norm(hidden, self.norm, eps, residual)
        return hidden

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Per layer: this rank's K/V heads, and its window where it has one."""
        d = self.arch.head_dim
        return [
            SlidingWindowSpec(self.num_kv_heads, d, window=layer.sliding_window)
            if layer.sliding_window
            else FullAttentionSpec(self.num_kv_heads, d)
            for layer in self.layers
        ]

    def embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.par.tp_size == 1:
            return torch.nn.functional.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_start  # vocabulary-parallel: look up this rank's slice, sum over ranks
        outside = (local < 0) | (local >= self.vocab_rows)
        hidden = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.embed)
        return self.par.all_reduce(hidden.masked_fill(outside.unsqueeze(-1), 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(hidden, self.lm_head).float()
        if self.par.tp_size == 1:
            return logits
        return self.par.gather_last(logits)[..., : self.arch.vocab_size]

    def weights(self) -> list[Any]:
        """Every weight object (tensors, or what pack_linear made of them)."""
        out = [self.embed, self.norm, self.lm_head, self.cos_sin]
        for layer in self.layers:
            out.extend(getattr(layer, name) for name in LlamaLayer.__slots__ if name not in ("sliding_window", "moe"))
            if layer.moe is not None:
                out.extend(layer.moe.weights())
        return [w for w in out if w is not None]

    def weight_bytes(self, *, per_token: bool = False) -> int:
        """Bytes the weights take on the device (each object counted once);
        the weights are plain attributes, not parameters, since a backend may
        repack linear weights into objects of its own. ``per_token``: only
        what one decode step reads (the input embedding gives one row, the
        rotary table a few; a tied output head still reads the whole matrix)."""
        return decoder_weight_bytes(self.weights(), tables=[self.cos_sin], embed=self.embed, lm_head=self.lm_head, per_token=per_token)
