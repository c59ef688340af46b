"""The plinth plugin contract, whole, in one file.

A plugin is a distribution that declares one entry point in the group
``plinth.plugins``; the entry point names a module (cheap to import: it must
not import torch, vendor SDKs or kernels) holding ``@hookimpl`` functions.

Every hook is called by keyword (pluggy), and an implementation declares only
the arguments it uses, so a new hook argument never breaks an old plugin.

There are five registration hooks, one per category. Each returns small named
descriptors; a descriptor names its implementation lazily as ``"module:attr"``,
which the core imports only when that plugin is chosen (or when
``platform plugins`` asks it whether it is available). The implementation
classes a descriptor may point at are the base classes at the end of this
file: subclass them.

The core states ``PLUGIN_API_VERSION``; a descriptor states the range it
supports in ``api`` (a PEP 440 specifier). Outside that range the plugin is
shown as incompatible and cannot be chosen.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

import pluggy

if TYPE_CHECKING:  # the contract itself stays cheap to import
    import torch

PROJECT = "plinth"
ENTRY_POINT_GROUP = "plinth.plugins"
PLUGIN_API_VERSION = "1.0"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# --------------------------------------------------------------------------
# Descriptors: what a registration hook returns
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class PluginDescriptor:
    """One named implementation in one category.

    name:        the name users choose it by (``--device npu``); unique per
                 category across every installed distribution.
    impl:        ``"package.module:ClassName"``, imported only when needed.
    priority:    ``auto`` takes the highest-priority candidate that validates.
    api:         the plugin API versions this plugin supports (PEP 440).
    version:     this implementation's version; empty means the version of
                 the distribution that registered it.
    description: one line for ``platform plugins``.
    """

    category: ClassVar[str] = ""
    name: str
    impl: str
    priority: int = 0
    version: str = ""
    api: str = ">=1.0,<2"
    description: str = ""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "_").replace(".", "_").isidentifier():
            raise ValueError(f"plugin name {self.name!r} must be a simple identifier")
        if ":" not in self.impl:
            raise ValueError(f"{self.name}: impl {self.impl!r} must be 'module:attr'")


@dataclass(frozen=True)
class AcceleratorDescriptor(PluginDescriptor):
    """A device platform (``--device``). impl -> an ``Accelerator`` subclass."""

    category: ClassVar[str] = "accelerator"


@dataclass(frozen=True)
class BackendDescriptor(PluginDescriptor):
    """A table of compute ops (``--backend``). impl -> a ``Backend`` subclass.

    reference: this backend implements every op in ``OP_NAMES`` on any torch
    device; ops another backend leaves out are taken from it.
    """

    category: ClassVar[str] = "backend"
    reference: bool = False


@dataclass(frozen=True)
class ModelDescriptor(PluginDescriptor):
    """Model architectures. impl -> a ``ModelLoader`` subclass.

    architectures:      Hugging Face names from config.json (``LlamaForCausalLM``).
    gguf_architectures: values of the GGUF key ``general.architecture``.
    """

    category: ClassVar[str] = "model"
    architectures: tuple[str, ...] = ()
    gguf_architectures: tuple[str, ...] = ()


@dataclass(frozen=True)
class A2ADescriptor(PluginDescriptor):
    """MoE all-to-all (``--a2a``). impl -> an ``AllToAll`` subclass."""

    category: ClassVar[str] = "a2a"


@dataclass(frozen=True)
class KVConnectorDescriptor(PluginDescriptor):
    """An external KV-cache store (``--kv-connector``). impl -> a ``KVConnector`` subclass."""

    category: ClassVar[str] = "kv_connector"


DESCRIPTOR_TYPES: dict[str, type[PluginDescriptor]] = {
    d.category: d
    for d in (AcceleratorDescriptor, BackendDescriptor, ModelDescriptor, A2ADescriptor, KVConnectorDescriptor)
}

# --------------------------------------------------------------------------
# Hook specifications
# --------------------------------------------------------------------------


class PlinthHookSpec:
    """The hooks. Registration hooks run once per process, at startup, in the
    order plugins were discovered; they must be fast and side-effect free."""

    @hookspec
    def plinth_register_accelerators(self) -> Sequence[AcceleratorDescriptor]:
        """Return the accelerator platforms this plugin provides.

        Called at startup in every process (API server and each worker rank),
        and by ``platform plugins``. Return ``[]`` for none.
        """

    @hookspec
    def plinth_register_backends(self) -> Sequence[BackendDescriptor]:
        """Return the op backends (attention, GEMM, norms, ...) this plugin provides.

        Called at startup in every process. Return ``[]`` for none.
        """

    @hookspec
    def plinth_register_model_loaders(self) -> Sequence[ModelDescriptor]:
        """Return the model loaders this plugin provides, with the
        architectures each builds. Called at startup in every process."""

    @hookspec
    def plinth_register_a2a(self) -> Sequence[A2ADescriptor]:
        """Return the MoE all-to-all implementations this plugin provides.
        Called at startup in every process."""

    @hookspec
    def plinth_register_kv_connectors(self) -> Sequence[KVConnectorDescriptor]:
        """Return the KV-cache connectors this plugin provides.
        Called at startup in every process."""

    @hookspec
    def plinth_add_cli_arguments(self, parser: Any) -> None:
        """Add plugin-specific options to ``platform serve`` / ``generate``.

        Called once in the CLI process, before arguments are parsed, with an
        ``argparse`` argument group named after the plugins. Option values
        reach the implementation through ``SelectionContext.options``. Prefix
        option names with the plugin name (``--cpu-threads``).
        """


REGISTRATION_HOOKS: dict[str, str] = {
    "accelerator": "plinth_register_accelerators",
    "backend": "plinth_register_backends",
    "model": "plinth_register_model_loaders",
    "a2a": "plinth_register_a2a",
    "kv_connector": "plinth_register_kv_connectors",
}

# --------------------------------------------------------------------------
# What the core hands an implementation when it validates and builds it
# --------------------------------------------------------------------------


@dataclass
class SelectionContext:
    """Everything known when a plugin is validated or built.

    Fields are filled as startup proceeds: accelerators are checked with an
    empty context, backends with the accelerator, dtype and model config.
    options holds the parsed CLI/API options (plugin-specific ones included).
    """

    accelerator: "Accelerator | None" = None
    dtype: "torch.dtype | None" = None
    model: "ModelConfig | None" = None
    tp: int = 1
    ep: int = 1
    options: Mapping[str, Any] = field(default_factory=dict)


class PluginImpl:
    """Base of every implementation class."""

    #: set by the core from the descriptor when the class is chosen
    name: ClassVar[str] = ""

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        """Reasons this implementation cannot serve ``ctx``; empty means it can.

        Must be cheap and must not import a vendor library: probe with
        ``importlib.util.find_spec`` and say what is missing
        (``"torch_npu is not installed"``). Called by ``platform plugins``
        with an empty context, and at startup with a filled one.
        """
        return []


# ---- accelerator ----------------------------------------------------------


@dataclass
class AcceleratorInfo:
    """What ``platform plugins`` and the engine learn about a device platform."""

    device_type: str  # torch device type: "cpu", "cuda", "npu", "xla", "xpu", ...
    dist_backend: str  # torch.distributed backend: "gloo", "nccl", "hccl", ...
    device_count: int
    device_name: str = ""
    capability: str = ""  # e.g. "sm_90"
    fp8: str = "none"  # "native" | "weight_only" | "none"
    memory_total: int = 0  # bytes, device 0
    dtypes: tuple[str, ...] = ()  # e.g. ("bfloat16", "float32")
    default_dtype: str = "bfloat16"
    preferred_backends: tuple[str, ...] = ()


class Accelerator(PluginImpl):
    """A device platform. Instantiated once per process after it is chosen."""

    device_type: ClassVar[str] = ""
    dist_backend: ClassVar[str] = "gloo"

    def info(self) -> AcceleratorInfo:
        raise NotImplementedError

    def device(self, index: int = 0) -> "torch.device":
        import torch

        return torch.device(self.device_type, index)

    def init_process(self, *, local_rank: int, options: Mapping[str, Any]) -> None:
        """Called once in each process before the model loads (bind the
        device, set thread counts)."""

    def synchronize(self) -> None:
        """Wait for queued device work (used by benchmarks and timing)."""

    def memory(self, index: int = 0) -> tuple[int, int]:
        """(free, total) bytes of device ``index``; sizes the KV page pool."""
        raise NotImplementedError

    def kv_cache_budget(self, *, free: int, total: int, weights: int) -> int:
        """Bytes the KV page pool takes by default (``--kv-cache-memory`` and
        ``--num-pages`` override). A device that holds nothing else takes most
        of what is free; a host shares its memory and takes less."""
        return int(0.9 * free) - weights

    def supported_dtypes(self) -> "list[torch.dtype]":
        import torch

        return [getattr(torch, name) for name in self.info().dtypes]

    def default_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.info().default_dtype)


# ---- backend ----------------------------------------------------------------

#: The ops a backend may provide. The model calls them through ``Ops``; a
#: backend that leaves one out gets the reference backend's. Signatures
#: (tensors are torch.Tensor on the chosen device):
#:
#:   rms_norm(x, weight, eps, residual=None)
#:       -> y, or (y, x + residual) when residual is given (the fused add)
#:   pack_linear(weight) -> packed: once per weight at load time, turn a
#:       [out, in] tensor (or a ``QuantizedWeight``) into what this backend's
#:       linear takes (a pre-blocked layout, say); the reference returns it as is.
#:       Models store the result and only ever hand it to ``linear``.
#:   linear(x, weight, bias=None) -> x @ weight.T (+ bias); weight is what
#:       pack_linear returned
#:   silu_and_mul(x) -> silu(x[..., :d]) * x[..., d:]
#:   rotary(q, k, positions, cos_sin, is_neox) -> (q, k); cos_sin is the
#:       model's [max_pos, rotary_dim] table (cos half, then sin half)
#:   allocate_kv_cache(num_pages, page_size, num_kv_heads, head_dim,
#:       v_head_dim, dtype, device) -> (k_pages, v_pages): one layer's paged
#:       K/V storage, zeroed, in this backend's own layout (v_pages is None
#:       when v_head_dim is 0: V shares K's pages, as in MLA). Only this
#:       backend's attention and copy_pages look inside; the engine only
#:       counts pages.
#:   prepare_attention(meta) -> None: once per step, before the layers; may
#:       stash per-step state in ``meta.backend_state``
#:   attention(q, k, v, kv_cache, meta, *, scale, sliding_window=None,
#:       logit_cap=None) -> out [T, Hq, Dv]; writes k, v [T, Hkv, D] into
#:       kv_cache = (k_pages, v_pages) at meta.slot_mapping (slot = page *
#:       page_size + offset), then attends causally over each sequence's pages
#:   copy_pages(kv_caches, src, dst) -> None: copy whole pages src[i] ->
#:       dst[i] (int64 CPU tensors) in every layer (fork, n>1)
#:   fused_moe(x, w13, w2, topk_weights, topk_ids) -> y (experts of this rank)
OP_NAMES: tuple[str, ...] = (
    "rms_norm",
    "pack_linear",
    "linear",
    "silu_and_mul",
    "rotary",
    "allocate_kv_cache",
    "prepare_attention",
    "attention",
    "copy_pages",
    "fused_moe",
)


@dataclass
class QuantizedWeight:
    """A weight stored in a quantized format, handed to ``linear``.

    format: "fp8_e4m3" (per-channel or block scales), "int8", ...
    A backend that cannot run a format says so in ``check``.
    """

    format: str
    qweight: "torch.Tensor"
    scale: "torch.Tensor"
    shape: tuple[int, int]
    block_size: tuple[int, int] | None = None


class Backend(PluginImpl):
    """A table of compute ops. Instantiated once per process after selection."""

    def __init__(self, ctx: SelectionContext, reference: Mapping[str, Callable[..., Any]] | None = None) -> None:
        self.ctx = ctx
        #: the reference backend's ops (None in the reference itself): call
        #: them for the cases this backend does not handle
        self.reference = reference or {}

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        """The ops this backend provides for ``self.ctx``: a subset of
        ``OP_NAMES``; the reference backend supplies the rest."""
        raise NotImplementedError


@dataclass
class AttentionMetadata:
    """One forward step's flat token batch, as the attention op sees it.

    The tokens of all sequences are concatenated (prefill chunks and decode
    tokens alike); sequence i owns tokens query_start_loc[i]:query_start_loc[i+1].
    """

    positions: "torch.Tensor"  # [T] int64, position of each token in its sequence
    slot_mapping: "torch.Tensor"  # [T] int64, page * page_size + offset for its K/V
    query_start_loc: "torch.Tensor"  # [B + 1] int32
    seq_lens: "torch.Tensor"  # [B] int32, context length including this step's tokens
    block_tables: "torch.Tensor"  # [B, max_pages] int32, padded with 0
    page_size: int
    max_query_len: int
    max_seq_len: int
    # host-side copies so reference code never waits on the device
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    #: per-step state a backend computes once in prepare_attention
    backend_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


# ---- model ------------------------------------------------------------------


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
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)


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
    ops: "Any"  # the resolved op table (attributes named as in OP_NAMES)
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: Any = None
    a2a: "AllToAll | None" = None
    progress: bool = True


class CausalLM:
    """What a loader builds (a torch.nn.Module subclassing this protocol).

    forward(input_ids [T], positions [T], kv_caches: list per layer of
    (k_pages, v_pages), meta: AttentionMetadata) -> hidden [T, hidden_size]
    compute_logits(hidden [N, hidden_size]) -> logits [N, vocab] in float32
    weight_bytes(*, per_token=False) -> int: bytes its weights take on the
        device, each shared tensor counted once (weights may be packed objects,
        not parameters), which sizes the KV pool; per_token=True: the bytes
        one decode step reads (not the input embedding table), for the
        benchmarks' roofline and FLOP counts
    """


class ModelLoader(PluginImpl):
    """Builds the architectures its descriptor names."""

    def load_config(self, source: ModelSource) -> ModelConfig:
        raise NotImplementedError

    def load_tokenizer(self, source: ModelSource) -> "Any":
        """A ``plinth.api.Tokenizer``."""
        raise NotImplementedError

    def load_model(self, source: ModelSource, config: ModelConfig, ctx: LoadContext) -> "Any":
        """A ``torch.nn.Module`` with the ``CausalLM`` methods, weights loaded."""
        raise NotImplementedError


# ---- MoE all-to-all -----------------------------------------------------------


class AllToAll(PluginImpl):
    """Moves MoE tokens to the ranks owning their experts and back.

    dispatch returns the tokens this rank's experts must process with a layout
    the plugin chooses, described by ``layout``: "flat" (tokens with their
    local expert ids and weights, as DeepEP's normal mode) or "padded"
    (``[local_experts, max_tokens, hidden]`` with counts, as its low-latency
    mode). combine takes the expert outputs in that same layout.
    """

    def __init__(self, ctx: SelectionContext, *, group: Any, num_experts: int, hidden_size: int) -> None:
        self.ctx = ctx
        self.group = group
        self.num_experts = num_experts
        self.hidden_size = hidden_size

    def dispatch(self, hidden: "torch.Tensor", topk_ids: "torch.Tensor", topk_weights: "torch.Tensor", *, decode: bool) -> tuple[Any, Any]:
        """-> (DispatchedTokens, handle)"""
        raise NotImplementedError

    def combine(self, expert_out: Any, handle: Any) -> "torch.Tensor":
        """-> hidden [num_tokens, hidden_size], the weighted sum over top-k."""
        raise NotImplementedError


# ---- KV connector -------------------------------------------------------------


class KVConnector(PluginImpl):
    """An external KV-page store shared across engine instances.

    Scheduler side (rank 0): ``lookup`` says how many leading prompt tokens the
    store holds (in whole pages). Worker side (every rank): ``load`` fills
    pages, ``save`` stores them. Any failure must return / raise quickly: the
    engine then recomputes; it never waits on a broken store.
    """

    def __init__(self, ctx: SelectionContext, *, config: Mapping[str, Any]) -> None:
        self.ctx = ctx
        self.config = dict(config)

    def lookup(self, page_hashes: Sequence[int]) -> int:
        """How many of these consecutive page hashes are stored (a prefix)."""
        raise NotImplementedError

    def load(self, page_hashes: Sequence[int], pages: Sequence[int], kv_caches: Any) -> bool:
        """Fill ``pages`` with the stored KV of ``page_hashes``; False on failure."""
        raise NotImplementedError

    def save(self, page_hashes: Sequence[int], pages: Sequence[int], kv_caches: Any) -> None:
        """Store these pages' KV under their hashes (best effort)."""
        raise NotImplementedError

    def health(self) -> tuple[bool, str]:
        return True, "ok"

    def close(self) -> None:
        pass


IMPL_BASES: dict[str, type[PluginImpl]] = {
    "accelerator": Accelerator,
    "backend": Backend,
    "model": ModelLoader,
    "a2a": AllToAll,
    "kv_connector": KVConnector,
}


def descriptor_fields(d: PluginDescriptor) -> dict[str, Any]:
    """A descriptor as a plain dict (for ``platform plugins --json``)."""
    out = dataclasses.asdict(d)
    out["category"] = d.category
    return out
