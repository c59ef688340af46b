"""The Gemma 3 text decoder, computing through the backend's ops.

Per layer: rms_norm, one fused q/k/v linear (one each where a GGUF file
mixes their block types), per-head q/k rms norms, rotary
with the layer's own table (local base for sliding-window layers, global
base for the rest), paged attention (the window passed to the op, the
pages those of the layer's KV group: ``kv_cache_specs``), the
output linear, then the post-attention norm and the residual add fused with
the pre-MLP norm; one fused gate/up linear, GeGLU with gelu-tanh, the down
linear, the post-MLP norm fused with the residual add and the next layer's
input norm. Gemma's norms multiply by (1 + weight): the loader stores
1 + weight (GGUF files store it so already), so the plain ``rms_norm`` op
applies. Embeddings are scaled by sqrt(hidden) in the compute dtype, as
transformers does; the head is tied to the embedding unless the checkpoint
has one; final logit soft-capping applies where the config sets it (the
attention one does not, as in transformers: see ``GemmaArch``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from plinth.api import (
    AttentionBackend,
    AttentionMetadata,
    FullAttentionSpec,
    KVCacheSpec,
    LayerWeights,
    SlidingWindowSpec,
    decoder_weight_bytes,
)

from plinth_plugin_gemma.arch import GemmaArch


def _parts(linear: Any, x: torch.Tensor, weight: Any, sizes: tuple[int, ...] | None) -> Sequence[torch.Tensor]:
    """A fused linear's outputs split by ``sizes`` (None: two halves), or,
    for a tuple of weights the loader could not fuse (GGUF parts of
    different types), each one's own output."""
    if isinstance(weight, tuple):
        return [linear(x, w) for w in weight]
    y = linear(x, weight)
    return y.chunk(2, dim=-1) if sizes is None else y.split(sizes, dim=-1)


class GemmaLayer(LayerWeights):
    """One decoder layer's weights (no compute of its own)."""

    __slots__ = (
        "input_norm", "qkv", "q_norm", "k_norm", "o_proj", "post_attn_norm",
        "pre_mlp_norm", "gate_up", "down", "post_mlp_norm", "sliding_window", "cos_sin",
    )


class Gemma3ForCausalLM(torch.nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, H];
    compute_logits(hidden [N, H]) -> float32 logits [N, vocab]."""

    def __init__(self, arch: GemmaArch, ops: Any, attention: AttentionBackend[Any], *, embed: torch.Tensor, norm: torch.Tensor, lm_head: Any, layers: Sequence[GemmaLayer], tables: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.arch = arch
        self.ops = ops
        self.attention = attention
        self.layers = list(layers)
        self.embed = embed
        self.norm = norm
        self.lm_head = lm_head
        #: the rotary tables the layers share (global, local), for weight_bytes
        self.tables = list(tables)
        # transformers multiplies by sqrt(hidden) rounded to the embedding's dtype
        self.embed_scale = torch.tensor(arch.hidden_size**0.5, dtype=embed.dtype, device=embed.device)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[Any], meta: AttentionMetadata) -> torch.Tensor:
        ops = self.ops
        rms_norm, linear, rotary, attention = ops.rms_norm, ops.linear, ops.rotary, self.attention.forward
        arch = self.arch
        eps, scale, head_dim = arch.rms_norm_eps, arch.scale, arch.head_dim
        num_tokens = input_ids.shape[0]
        q_size, kv_size = self.q_size, self.kv_size

        hidden = F.embedding(input_ids, self.embed) * self.embed_scale
        x = rms_norm(hidden, self.layers[0].input_norm, eps) if self.layers else hidden
        residual = hidden
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            q, k, v = _parts(linear, x, layer.qkv, (q_size, kv_size, kv_size))
            q = rms_norm(q.reshape(num_tokens, self.num_heads, head_dim), layer.q_norm, eps)
            k = rms_norm(k.reshape(num_tokens, self.num_kv_heads, head_dim), layer.k_norm, eps)
            q, k = rotary(q, k, positions, layer.cos_sin, True)
            out = attention(  # with the pages of the layer's KV group (sliding and global layers differ)
                q, k, v.reshape(num_tokens, self.num_kv_heads, head_dim), kv_cache, meta.for_layer(i),
                scale=scale, sliding_window=layer.sliding_window,
            )
            attn = rms_norm(linear(out.reshape(num_tokens, q_size), layer.o_proj), layer.post_attn_norm, eps)
            x, residual = rms_norm(attn, layer.pre_mlp_norm, eps, residual)
            gate, up = _parts(linear, x, layer.gate_up, None)
            mlp = rms_norm(linear(F.gelu(gate, approximate="tanh") * up, layer.down), layer.post_mlp_norm, eps)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x, residual = rms_norm(mlp, next_norm, eps, residual)
        return x if self.layers else rms_norm(hidden, self.norm, eps)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Per layer: K/V for every token (global layers), or for the last
        ``window`` (sliding layers: their own KV group, whose pages behind
        the window go back to the pool)."""
        heads, d = self.num_kv_heads, self.arch.head_dim
        return [
            SlidingWindowSpec(heads, d, window=layer.sliding_window) if layer.sliding_window else FullAttentionSpec(heads, d)
            for layer in self.layers
        ]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(hidden, self.lm_head).float()
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def weights(self) -> list[Any]:
        """Every weight object (tensors, or what pack_linear made of them)."""
        out = [self.embed, self.norm, self.lm_head, *self.tables]
        for layer in self.layers:
            for name in GemmaLayer.__slots__:
                if name not in ("sliding_window", "cos_sin"):
                    w = getattr(layer, name)
                    out.extend(w if isinstance(w, tuple) else (w,))
        return [w for w in out if w is not None]

    def weight_bytes(self, *, per_token: bool = False) -> int:
        """Bytes the weights take on the device, each object once. With
        ``per_token``, what one decode step reads: not the rotary tables nor
        an untied embedding (one row), but a tied head's whole matrix."""
        return decoder_weight_bytes(self.weights(), tables=self.tables, embed=self.embed, lm_head=self.lm_head, per_token=per_token)
