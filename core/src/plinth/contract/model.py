"""The model category: loaders that build architectures, and what they exchange
with the engine (the model's config, where it lives, how to build it)."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

from plinth.contract.backend import BASE_OPS, OpTable
from plinth.contract.base import PluginDescriptor, PluginImpl

if TYPE_CHECKING:
    import torch

    from plinth.contract.a2a import AllToAll
    from plinth.contract.attention import AttentionBackend



@dataclass(frozen=True)
class ModelDescriptor(PluginDescriptor):
    """Model architectures. impl -> a ``ModelLoader`` subclass.

    architectures:      Hugging Face names from config.json (``LlamaForCausalLM``).
    gguf_architectures: values of the GGUF key ``general.architecture``.
    named_models:       (name, ``module:function``) pairs: a model given by
                        that name (``platform serve gemma3-270m``) is the
                        local path the function returns (imported only then).
    Two plugins claiming one architecture: the higher ``priority`` builds it.
    """

    category: ClassVar[str] = "model"
    architectures: tuple[str, ...] = ()
    gguf_architectures: tuple[str, ...] = ()
    named_models: tuple[tuple[str, str], ...] = ()


@dataclass
class ModelConfig:
    """What the engine needs to know about a model, whatever its architecture."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    v_head_dim: int | None = None  # when V differs from K (MLA); 0: V shares K's cache
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str = "bfloat16"  # the checkpoint's dtype
    num_experts: int = 0
    #: the widest sliding window any layer attends with (None: every layer
    #: attends to all positions), as the loader reads the family's config
    sliding_window: int | None = None
    #: attention scores soft-capped at this value (None: not capped)
    attn_logit_softcap: float | None = None
    raw: Mapping[str, Any] = field(default_factory=dict[str, Any], repr=False)


@dataclass
class ModelSource:
    """A model the core has located: a Hugging Face folder or a GGUF file."""

    path: str  # the folder, or the .gguf file
    format: str  # "hf" | "gguf"
    architecture: str
    hf_config: Mapping[str, Any] | None = None  # config.json, for format "hf"


@dataclass
class LoadContext:
    """Where and how to build the model."""

    device: "torch.device"
    dtype: "torch.dtype"
    ops: "OpTable"  # the resolved compute ops (attributes named as in OP_NAMES)
    #: the resolved attention backend: layers call its ``forward`` (or its
    #: ``qkv_fusion()``) with their KV pages and ``meta.for_layer(i)``; a
    #: model that reads the pages itself (MLA) reads them in its ``layout``
    attention: "AttentionBackend[Any]"
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: Any = None
    a2a: "AllToAll | None" = None
    progress: bool = True
    #: weights stored quantized (GGUF blocks) are dequantized at load to
    #: ``dtype`` even where the backend runs their format (``--dequantize``)
    dequantize: bool = False
    #: deterministic serving (``--deterministic``): ``tp_all_reduce`` sums in
    #: one order whatever the batch (the ops are batch-invariant already)
    deterministic: bool = False

    def tp_all_reduce(self, x: "torch.Tensor") -> "torch.Tensor":
        """Sum a row-parallel projection's partial result over the tp group,
        in place (nothing at tp = 1): what every tp model calls, so that
        deterministic mode's fixed order (``plinth.collectives``) holds."""
        from plinth.collectives import all_reduce_sum

        return all_reduce_sum(x, self.tp_group if self.tp_size > 1 else None, fixed_order=self.deterministic)


class CausalLM:
    """What a loader builds (a torch.nn.Module subclassing this protocol).

    forward(input_ids [T], positions [T], kv_caches: list per layer of
    (k_pages, v_pages) or None, meta: AttentionMetadata) -> hidden [T, hidden_size];
        layer i attends with ``LoadContext.attention`` over its pages and
        ``meta.for_layer(i)`` (its KV-cache group's pages and plan)
    kv_cache_specs() -> list per layer of ``plinth.api.KVCacheSpec`` or None:
        what each layer caches on this rank (its own K/V heads, a window, a
        latent of a plugin's own spec, or nothing); layers with equal specs
        share pages, and the pool's bytes come from these specs alone
    compute_logits(hidden [N, hidden_size]) -> logits [N, vocab] in float32
    weight_bytes(*, per_token=False) -> int: bytes its weights take on the
        device, each shared tensor counted once (weights may be packed objects,
        not parameters), which sizes the KV pool; per_token=True: the bytes
        one decode step reads (not the input embedding table), for the
        benchmarks' roofline and FLOP counts
    """


class ModelLoader(PluginImpl):
    """Builds the architectures its descriptor names."""

    @abc.abstractmethod
    def load_config(self, source: ModelSource) -> ModelConfig:
        raise NotImplementedError

    @abc.abstractmethod
    def load_tokenizer(self, source: ModelSource) -> "Any":
        """A ``plinth.api.Tokenizer``."""
        raise NotImplementedError

    @abc.abstractmethod
    def load_model(self, source: ModelSource, config: ModelConfig, ctx: LoadContext) -> "Any":
        """A ``torch.nn.Module`` with the ``CausalLM`` methods, weights loaded."""
        raise NotImplementedError

    def required_ops(self, config: ModelConfig) -> Sequence[str]:
        """The ops this model calls. Checked at start-up, before any weight
        loads: an op no selected backend provides fails naming the op and
        the backends tried. May name ops outside ``OP_SIGNATURES``. (Paged
        attention is the attention backend's, which every backend has.)"""
        return BASE_OPS + (("fused_moe",) if config.num_experts else ())
