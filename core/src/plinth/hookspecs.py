"""The plinth plugin contract, whole, in one file.

A plugin is a distribution that declares one entry point in the group
``plinth.plugins``; the entry point names a module (cheap to import: it must
not import torch, vendor SDKs or kernels) holding ``@hookimpl`` functions.

Every hook is called by keyword (pluggy), and an implementation declares only
the arguments it uses, so a new hook argument never breaks an old plugin.

There are eight registration hooks, one per category. Each returns small named
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
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Protocol, Sequence

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


@dataclass(frozen=True)
class ToolParserDescriptor(PluginDescriptor):
    """Reads tool calls out of a model's output (``--tool-call-parser``).
    impl -> a ``ToolParser`` subclass. Registered by the model plugin whose
    families write calls this way.

    template_markers: strings whose presence in a chat template means the
    model writes calls this way; with ``auto`` the server takes the
    highest-priority parser with a marker in the served model's template.
    """

    category: ClassVar[str] = "tool_parser"
    template_markers: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReasoningParserDescriptor(PluginDescriptor):
    """Splits a model's reasoning from its answer (``--reasoning-parser``).
    impl -> a ``ReasoningParser`` subclass; template_markers as for tool parsers."""

    category: ClassVar[str] = "reasoning_parser"
    template_markers: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProposerDescriptor(PluginDescriptor):
    """A speculative-decoding proposer (``--speculative-method``).
    impl -> a ``Proposer`` subclass. Never chosen by ``auto``: speculation is
    off unless a method is named."""

    category: ClassVar[str] = "proposer"


DESCRIPTOR_TYPES: dict[str, type[PluginDescriptor]] = {
    d.category: d
    for d in (
        AcceleratorDescriptor,
        BackendDescriptor,
        ModelDescriptor,
        A2ADescriptor,
        KVConnectorDescriptor,
        ToolParserDescriptor,
        ReasoningParserDescriptor,
        ProposerDescriptor,
    )
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
    def plinth_register_tool_parsers(self) -> Sequence[ToolParserDescriptor]:
        """Return the tool-call parsers this plugin provides (model plugins
        register the formats their families write). Called at startup in the
        API server process, and by ``platform plugins``."""

    @hookspec
    def plinth_register_reasoning_parsers(self) -> Sequence[ReasoningParserDescriptor]:
        """Return the reasoning parsers (``<think>...</think>`` and the like)
        this plugin provides. Called at startup in the API server process."""

    @hookspec
    def plinth_register_proposers(self) -> Sequence[ProposerDescriptor]:
        """Return the speculative-decoding proposers this plugin provides.
        Called at startup in the engine process, and by ``platform plugins``."""

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
    "tool_parser": "plinth_register_tool_parsers",
    "reasoning_parser": "plinth_register_reasoning_parsers",
    "proposer": "plinth_register_proposers",
}

# --------------------------------------------------------------------------
# What the core hands an implementation when it validates and builds it
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedLayout:
    """What start-up knows of a parallel run before any rank exists: the
    process layout, the device kind and the model's MoE shape. An a2a
    plugin's ``check`` judges this (the launcher asks before it spawns a
    rank); what only a live group can tell (buffer allocation, NVSHMEM) is
    the plugin's ``reserve_buffers`` in each rank, before weights load."""

    world: int = 1
    tp: int = 1
    dp: int = 1
    ep: int = 1
    nnodes: int = 1
    #: ranks (devices) per node
    local_world: int = 1
    #: the chosen accelerator's torch device type ("cuda", "cpu", ...)
    device_type: str = ""
    #: its compute capability as the accelerator reports it ("sm_90"), "" if none
    capability: str = ""
    dtype: str = ""
    hidden_size: int = 0
    num_experts: int = 0
    #: experts chosen per token
    top_k: int = 0
    #: the most tokens one rank runs in a step (the step token budget)
    max_tokens_per_step: int = 0
    #: the most sequences in a step (a decode-only step has at most this many tokens)
    max_num_seqs: int = 0


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
    #: proposers only: what the engine offers them (None in `platform plugins`)
    speculative: "ProposerContext | None" = None
    #: a2a plugins: the planned parallel layout (None in `platform plugins`)
    layout: "PlannedLayout | None" = None


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
    #: instruction-set extensions found (CPU: "avx2", "avx512_bf16", "amx_bf16",
    #: "sve", ...), possibly narrowed by the user; backends decide from these,
    #: never from the machine's name or their own probing
    isa: tuple[str, ...] = ()
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

    def kv_cache_budget(
        self, *, free: int, total: int, weights: int, activation_peak: int = 0, reserved: int = 0, utilization: float = 0.9
    ) -> int:
        """Bytes the KV page pool takes by default (``--kv-cache-memory`` and
        ``--num-pages`` override), asked after the weights loaded and the a2a
        buffers were allocated: ``free`` is measured then, so it already
        lacks them. A device that holds nothing else takes ``utilization``
        of its memory less what the run holds besides the pool (weights, the
        profiled activation peak, ``reserved``: a2a buffers, a draft model),
        and never more than is free (as vLLM's ``--gpu-memory-utilization``);
        a host shares its memory and takes less."""
        return min(int(utilization * total) - weights - activation_peak - reserved, free - activation_peak)

    def measure_peak(self, fn: "Callable[[], Any]", index: int = 0) -> int:
        """Run ``fn`` (the profiling forward) and return the most device bytes
        it held at once beyond what was held before. The default reads
        ``memory`` before and after: right for caching allocators, which keep
        what a forward took; a device with a peak counter overrides it."""
        before, _ = self.memory(index)
        fn()
        after, _ = self.memory(index)
        return max(0, before - after)

    def supported_dtypes(self) -> "list[torch.dtype]":
        import torch

        return [getattr(torch, name) for name in self.info().dtypes]

    def default_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.info().default_dtype)


# ---- backend ----------------------------------------------------------------

# The ops a backend may provide, one typed signature each (tensors are
# torch.Tensor on the chosen device). The model calls them through the op
# table start-up resolves (attributes named as the ops); a backend that leaves
# one out gets the reference backend's. The table is open: a backend may bring
# an op not listed here (its name is the contract between it and the models
# that call it), and a model loader names the ops it needs in
# ``ModelLoader.required_ops``: start-up fails, naming the op and the backends
# tried, when none of them provides one.


class RmsNormOp(Protocol):
    def __call__(self, x: "torch.Tensor", weight: "torch.Tensor | None", eps: float, residual: "torch.Tensor | None" = None) -> Any:
        """y = x / rms(x) * weight; with ``residual``: (y, x + residual), the
        norm taken of the sum (the fused residual add)."""


class PackLinearOp(Protocol):
    def __call__(self, weight: "torch.Tensor | QuantizedWeight") -> Any:
        """Once per weight at load time: an [out, in] tensor (or a
        ``QuantizedWeight``) into what this backend's ``linear`` takes (a
        pre-blocked layout, say); the reference returns it as is. Models
        store the result and only ever hand it to ``linear``."""


class LinearOp(Protocol):
    def __call__(self, x: "torch.Tensor", weight: Any, bias: "torch.Tensor | None" = None) -> "torch.Tensor":
        """x @ weight.T (+ bias); weight is what ``pack_linear`` returned."""


class SiluAndMulOp(Protocol):
    def __call__(self, x: "torch.Tensor") -> "torch.Tensor":
        """silu(x[..., :d]) * x[..., d:] for a fused gate/up projection."""


class RotaryOp(Protocol):
    def __call__(self, q: "torch.Tensor", k: "torch.Tensor", positions: "torch.Tensor", cos_sin: "torch.Tensor", is_neox: bool) -> "tuple[torch.Tensor, torch.Tensor]":
        """(q, k) rotated; cos_sin is the model's [max_pos, rotary_dim] table
        (cos half, then sin half)."""


class AllocateKVCacheOp(Protocol):
    def __call__(self, *, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, v_head_dim: int, dtype: "torch.dtype", device: "torch.device") -> "tuple[Any, Any]":
        """One layer's paged K/V storage, zeroed, in this backend's own layout
        (v_pages is None when v_head_dim is 0: V shares K's pages, as in MLA).
        Only this backend's attention and copy_pages look inside; the engine
        only counts pages."""


class PrepareAttentionOp(Protocol):
    def __call__(self, meta: "AttentionMetadata") -> None:
        """Once per step, before the layers; may stash per-step state in
        ``meta.backend_state``."""


class AttentionOp(Protocol):
    def __call__(self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", kv_cache: "tuple[Any, Any]", meta: "AttentionMetadata", *, scale: float, sliding_window: int | None = None, logit_cap: float | None = None) -> "torch.Tensor":
        """out [T, Hq, Dv]: writes k, v [T, Hkv, D] into kv_cache at
        meta.slot_mapping (slot = page * page_size + offset), then attends
        causally over each sequence's pages."""


class QKVAttentionOp(Protocol):
    def __call__(self, qkv: "torch.Tensor", positions: "torch.Tensor", cos_sin: "torch.Tensor", is_neox: bool, kv_cache: "tuple[Any, Any]", meta: "AttentionMetadata", *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None) -> "torch.Tensor":
        """Optional, a fusion: a layer's attention block from its fused
        projection qkv [T, (Hq + 2 Hkv) * D] (q heads, then k, then v):
        ``rotary`` on q and k, then ``attention``; returns [T, Hq * D]. The
        same numbers as those ops; a model calls it when the table has it and
        nothing comes between the projection and the rotation (per-head q/k
        norms), and composes the two ops otherwise."""


class CopyPagesOp(Protocol):
    def __call__(self, kv_caches: Sequence[Any], src: "torch.Tensor", dst: "torch.Tensor") -> None:
        """Copy whole pages src[i] -> dst[i] (int64 CPU tensors) in every
        layer (fork, n > 1)."""


class FusedMoEOp(Protocol):
    def __call__(self, x: "torch.Tensor", w13: "torch.Tensor", w2: "torch.Tensor", topk_weights: "torch.Tensor", topk_ids: "torch.Tensor") -> "torch.Tensor":
        """The experts of a mixture-of-experts MLP: x [T, H]; w13 [E, 2I, H]
        (each expert's gate rows, then its up rows); w2 [E, H, I];
        topk_weights, topk_ids [T, K]. Returns y [T, H] in x's dtype, y[t] =
        sum over k of topk_weights[t, k] * down_e(silu(gate_e(x[t])) *
        up_e(x[t])) with e = topk_ids[t, k]; ids outside [0, E) (experts of
        other ranks, padding) contribute nothing. Tokens are grouped by
        expert, one GEMM per expert that received tokens; an expert with no
        tokens costs nothing."""


#: the ops the core knows, with their signatures; a backend may add others
OP_SIGNATURES: dict[str, type] = {
    "rms_norm": RmsNormOp,
    "pack_linear": PackLinearOp,
    "linear": LinearOp,
    "silu_and_mul": SiluAndMulOp,
    "rotary": RotaryOp,
    "allocate_kv_cache": AllocateKVCacheOp,
    "prepare_attention": PrepareAttentionOp,
    "attention": AttentionOp,
    "copy_pages": CopyPagesOp,
    "qkv_attention": QKVAttentionOp,
    "fused_moe": FusedMoEOp,
}
OP_NAMES: tuple[str, ...] = tuple(OP_SIGNATURES)
#: optional fusions of other ops: a backend may bring them (with the ops
#: whose layout they read); the reference does not, and models compose the
#: separate ops where the table has none
FUSED_OPS: tuple[str, ...] = ("qkv_attention",)
#: the ops every decoder the core runs calls (the engine itself calls the
#: KV ones); ``ModelLoader.required_ops`` adds what an architecture needs
BASE_OPS: tuple[str, ...] = (
    "rms_norm", "pack_linear", "linear", "silu_and_mul", "rotary",
    "allocate_kv_cache", "prepare_attention", "attention", "copy_pages",
)


@dataclass
class QuantizedWeight:
    """A weight stored in a quantized format, handed to ``pack_linear``.

    format: "fp8_e4m3" (per-channel or block scales), "int8", ...; or
    "gguf_<type>" (``gguf_q4_0``, ``gguf_q4_1``, ``gguf_q8_0``, ``gguf_q4_k``,
    ``gguf_q5_k``, ``gguf_q6_k``, ...: the GGML type name, lower case): qweight
    is the GGUF file's rows of blocks as they are, uint8 [out, in / weights
    per block * bytes per block] (rows may be permuted or stacked, never cut
    inside a row), scale is empty (the scales live in the blocks), block_size
    is (1, weights per block).

    A model loader hands a backend only the formats it says it runs: FP8 when
    the op table has the op ``fp8_path() -> (path, why)``, GGUF types when it
    has ``gguf_formats() -> (type names, path)`` (ops a backend brings of its
    own; the loader logs the path and dequantizes what is not offered).
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

    @classmethod
    def unsupported_ops(cls, ctx: SelectionContext) -> Mapping[str, str]:
        """Ops this backend has but cannot run for ``ctx``, each with why
        (``{"linear": "bf16 GEMMs need avx512bw+vl+dq"}``). ``ops()`` leaves
        them out and the reference serves them; start-up logs this and
        ``platform plugins`` shows it. Whole-backend problems go in ``check``."""
        return {}

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        """The ops this backend provides for ``self.ctx``: any of
        ``OP_SIGNATURES`` (the reference backend supplies the rest), plus any
        op of its own (the table is open)."""
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
    #: the decode flag MoE layers hand the a2a plugin; set by the engine when
    #: ranks with different batches must agree (None: ``is_decode_only``)
    moe_decode: bool | None = None

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
    #: weights stored quantized (GGUF blocks) are dequantized at load to
    #: ``dtype`` even where the backend runs their format (``--dequantize``)
    dequantize: bool = False


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

    def required_ops(self, config: ModelConfig) -> Sequence[str]:
        """The ops this model calls. Checked at start-up, before any weight
        loads: an op no selected backend provides fails naming the op and
        the backends tried. May name ops outside ``OP_SIGNATURES``."""
        return BASE_OPS + (("fused_moe",) if config.num_experts else ())


# ---- MoE all-to-all -----------------------------------------------------------


@dataclass
class DispatchedTokens:
    """What ``AllToAll.dispatch`` hands this rank's experts, in one of the two
    layouts DeepEP's kernels produce (expert ids here are local:
    ``0 .. num_local_experts - 1``).

    layout "flat" (DeepEP's normal mode, prefill): x [N, H] are the tokens
        received, each once however many of this rank's experts it chose;
        topk_ids / topk_weights [N, K] its choices, local ids, -1 where the
        expert lives on another rank. The experts return y [N, H], the
        weighted sum over the token's local experts:
        ``ops.fused_moe(x, w13, w2, topk_weights, topk_ids)``.
    layout "padded" (DeepEP's low-latency mode, decode): x [E_local, M, H],
        expert e's tokens in rows 0 .. counts[e] - 1 of x[e] (the rest is
        padding); topk_ids / topk_weights None. The experts return y
        [E_local, M, H], each row its expert's output, unweighted (combine
        applies the weights); padding rows are ignored.
    counts [E_local]: tokens per local expert (int, on the device).
    """

    layout: str
    x: "torch.Tensor"
    counts: "torch.Tensor"
    topk_ids: "torch.Tensor | None" = None
    topk_weights: "torch.Tensor | None" = None


class AllToAll(PluginImpl):
    """Moves MoE tokens to the ranks owning their experts and back.

    Experts are split evenly and contiguously over the group: rank r owns
    global experts ``r * E / size .. (r + 1) * E / size - 1``. Every rank of
    the group calls dispatch and combine the same number of times, in the
    same order (a rank with no tokens passes empty tensors). ``check`` runs
    in the launcher before any rank exists, judging ``ctx.layout`` (a
    ``PlannedLayout``: world, tp/dp/ep, nodes, device, dtype, hidden size,
    experts, top-k, tokens per step); ``ctx.layout`` is None in
    ``platform plugins``, where a check answers what it can.
    """

    def __init__(self, ctx: SelectionContext, *, group: Any, num_experts: int, hidden_size: int) -> None:
        self.ctx = ctx
        self.group = group
        self.num_experts = num_experts
        self.hidden_size = hidden_size

    def dispatch(self, hidden: "torch.Tensor", topk_ids: "torch.Tensor", topk_weights: "torch.Tensor", *, decode: bool) -> "tuple[DispatchedTokens, Any]":
        """hidden [T, H], topk_ids [T, K] global expert ids, topk_weights
        [T, K] -> (the tokens this rank's experts must process, a handle for
        combine). ``decode``: the step is decode-only on every rank (a plugin
        may then choose its low-latency layout)."""
        raise NotImplementedError

    def combine(self, expert_out: "torch.Tensor", handle: Any) -> "torch.Tensor":
        """The experts' output in the layout dispatch gave -> hidden [T, H]
        for the tokens this rank dispatched, the weighted sum over top-k."""
        raise NotImplementedError

    def reserve_buffers(self) -> int:
        """Allocate the communication buffers now (collective: every rank of
        the group calls it together, at start-up before weights load) and
        return the device bytes they hold, which the KV budget leaves free.
        A failure here (NVSHMEM init, out of memory) is raised with its reason."""
        return 0


# ---- KV connector -------------------------------------------------------------


@dataclass(frozen=True)
class KVLayout:
    """What a KV connector stores, and whose it is.

    A stored value is one full page of one model's KV cache (every layer, K
    and V) in the backend's layout: ``value_bytes`` long (a header the core
    writes and checks, then ``page_bytes`` of payload). Keys are strings the
    core builds from ``fingerprint``, the tp rank and the page's chained hash,
    so equal keys mean equal prefixes of the same model in the same layout.

    model_id:    the model (architecture, sizes, checkpoint name)
    fingerprint: model_id plus the KV layout (page size, dtype, KV heads, head
                 dims, layers, the backend's page shape, tp rank and size);
                 a value written under another fingerprint is foreign: a miss
    """

    model_id: str
    fingerprint: str
    page_size: int
    page_bytes: int
    value_bytes: int
    dtype: str = ""
    num_kv_heads: int = 0
    tp_rank: int = 0
    tp_size: int = 1


class KVConnector(PluginImpl):
    """An external KV-page store shared across engine instances (vLLM's v1
    connector split: a scheduler side and a worker side).

    The plugin's methods are plain blocking calls; the core never makes them
    on the engine's step loop. It runs them on its own threads with a
    deadline and a circuit breaker (``kv_connector_config``: ``deadline_s``,
    ``breaker_failures``, ``breaker_reset_s``), so a slow or dead store costs
    a request at most the deadline, then recomputation. The core also writes
    and checks every value's header (key, layout fingerprint, length,
    checksum): a corrupt, truncated or foreign value is a miss, never loaded.
    What a failed or partial load means is the core's ``failure_policy``:
    ``recompute`` (those tokens are computed, counted and logged; health says
    degraded) or ``fail`` (the request ends with an error).

    Scheduler side (rank 0, at admission, for the prompt's pages the local
    prefix cache lacks):

    * ``lookup(keys) -> int``: how many leading keys the store holds.

    Worker side (every rank; pages are staged through CPU buffers the core
    owns, so a call that outlives its deadline never touches live pages):

    * ``load(keys, buffers) -> list[int]``: read the value of ``keys[i]`` into
      ``buffers[i]`` (a contiguous ``torch.uint8`` CPU tensor of
      ``layout.value_bytes``); per key the bytes read, or a number <= 0 for a
      miss or a failure. The core checks each value before it fills a page
      and uses the leading run of good ones.
    * ``save(keys, values) -> None``: store each value (uint8 CPU tensors,
      ``layout.value_bytes`` long) under its key; keys already stored may be
      skipped. Raise on failure.
    * ``register_buffer(tensor)``: once, the staging area all buffers and
      values are slices of (register it with a transfer engine that needs
      registered memory).

    Both sides: ``health() -> (ok, why)`` (called off the step loop, also as
    the circuit breaker's probe: it may try to reconnect), ``close()``.
    Raise an exception for any failure; never return wrong bytes.
    """

    def __init__(self, ctx: SelectionContext, *, config: Mapping[str, Any], layout: KVLayout) -> None:
        self.ctx = ctx
        self.config = dict(config)
        self.layout = layout

    # scheduler side
    def lookup(self, keys: Sequence[str]) -> int:
        """How many of these keys, from the first, the store holds."""
        raise NotImplementedError

    # worker side
    def load(self, keys: Sequence[str], buffers: Sequence["torch.Tensor"]) -> Sequence[int]:
        """Read each key's value into its buffer; bytes read per key (<= 0: missing or failed)."""
        raise NotImplementedError

    def save(self, keys: Sequence[str], values: Sequence["torch.Tensor"]) -> None:
        """Store each value under its key (best effort; raise on failure)."""
        raise NotImplementedError

    def register_buffer(self, buffer: "torch.Tensor") -> None:
        """The CPU staging area the calls that follow on this thread use (each
        load buffer and save value lies in it). Called once per worker thread
        and kept: again only with a bigger area, which replaces the old one."""

    def health(self) -> tuple[bool, str]:
        """(reachable, why not). May block; the core calls it off the step loop."""
        return True, "ok"

    def close(self) -> None:
        pass


# ---- tool-call and reasoning parsers -------------------------------------------


@dataclass
class ToolCallItem:
    """One tool call read out of the output.

    arguments: the JSON text of the arguments, as the model wrote it; in a
        streaming view, what has arrived of it so far.
    id: an id the model's format carries (Kimi K2's ``functions.get_weather:0``);
        None lets the server make one.
    """

    name: str
    arguments: str = "{}"
    complete: bool = True
    id: str | None = None


@dataclass
class ToolParse:
    """What a tool parser makes of the output: answer text and calls."""

    content: str
    calls: list[ToolCallItem] = field(default_factory=list)


class ToolParser(PluginImpl):
    """Reads a model family's tool-call format. One instance per request
    (``tools`` is the request's tool list, for formats that need it).

    ``parse`` is a pure function of the text so far, so the server streams
    by diffing successive views; a parser keeps no state between calls.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self.tools = list(tools)

    def parse(self, text: str, *, final: bool) -> ToolParse:
        """text: everything the model wrote so far (after its reasoning).

        final=True: the whole output. Every call returned is complete, with
        arguments that are a JSON object; a call that is malformed (bad
        JSON, no name, never closed) is left in ``content`` as written.
        Never raises on any text.

        final=False: a streaming view. ``content`` holds only text that is
        certainly answer text (a possible beginning of a call marker at the
        end is held back); a call appears once its name is complete, and
        its ``arguments`` only ever grow (each view's is a prefix of the
        next one's and of the final one).
        """
        raise NotImplementedError


@dataclass
class ReasoningParse:
    """Reasoning text and the answer after it."""

    reasoning: str
    content: str


class ReasoningParser(PluginImpl):
    """Splits reasoning (``<think>...</think>``) from the answer; stateless
    like ``ToolParser``. ``prompt`` is the rendered prompt, for templates
    that open the reasoning block in the prompt itself."""

    def __init__(self, prompt: str = "") -> None:
        self.prompt = prompt

    def parse(self, text: str, *, final: bool) -> ReasoningParse:
        """final=False: a streaming view (a possible beginning of a tag at
        the end is held back from both parts; both parts only grow)."""
        raise NotImplementedError


# ---- speculative-decoding proposers ---------------------------------------------


@dataclass
class ProposeItem:
    """One sequence asking for proposals in this step.

    key:       stable id of the sequence while it lives (``Proposer.free(key)``
               follows when it ends)
    token_ids: its tokens so far, prompt then output (read only)
    num_prompt_tokens: where the output starts in ``token_ids``
    k:         the most tokens to propose (the engine's adaptive budget for
               this sequence); proposing fewer, or none, is always fine
    hidden:    the target model's last hidden state for this sequence (the
               row that produced its newest token), given only to a proposer
               whose class sets ``wants_hidden`` (a model's own MTP or EAGLE
               heads); None otherwise
    """

    key: int
    token_ids: Sequence[int]
    num_prompt_tokens: int
    k: int
    hidden: "torch.Tensor | None" = None


class DraftRunner(Protocol):
    """A second, smaller model the core runs for a proposer: loaded by the
    same start-up code (its model plugin, the chosen backend's ops) with its
    own KV-cache manager, page pool and model runner."""

    vocab_size: int

    def forward(self, items: Sequence[tuple[int, Sequence[int]]]) -> "list[torch.Tensor | None]":
        """For each (key, token_ids): make the draft's cache of ``key`` hold
        ``token_ids`` (its cached prefix is kept as far as it agrees with
        ``token_ids``: rollback is by common prefix; only the rest is
        computed, all items in one forward) and return the logits [vocab]
        (float32, CPU) that follow the last token; None where the draft's
        page pool had no room (that key's cache is dropped)."""

    def free(self, key: int) -> None:
        """Drop the draft cache of a sequence that ended."""


@dataclass
class ProposerContext:
    """What the engine hands a proposer (``SelectionContext.speculative``).

    num_speculative_tokens: k, the most tokens proposed per sequence and step
    speculative_model:      ``--speculative-model`` (a folder or .gguf), if given
    model:                  the target model's config; tokenizer: its tokenizer
    load_tokenizer(path):   the tokenizer of another model (through its model plugin)
    build_draft_runner(path): a ``DraftRunner`` for another model; raises
                            ``PluginError`` when it cannot load
    """

    num_speculative_tokens: int
    speculative_model: str | None
    model: "ModelConfig"
    tokenizer: Any
    load_tokenizer: Callable[[str], Any]
    build_draft_runner: Callable[[str], DraftRunner]


class Proposer(PluginImpl):
    """Proposes the next tokens of sequences; the engine verifies them.

    The target model scores the k proposals of a sequence in one forward
    and keeps the longest prefix it would have produced itself (exactly for
    greedy requests, by rejection sampling for sampled ones), so a proposer
    only changes speed, never output. Proposals are treated as greedy picks
    (a point mass), which is what keeps the rejection rule exact: a proposer
    that samples must not be used with this contract.

    ``check(ctx)`` sees ``ctx.speculative`` (a ``ProposerContext``) at
    start-up and ``None`` in ``platform plugins``; reasons name what is wrong
    ("--speculative-model is required", "the tokenizers differ: ...").
    """

    #: ask the engine for the target's last hidden states (``ProposeItem.hidden``)
    wants_hidden: ClassVar[bool] = False

    def __init__(self, ctx: SelectionContext) -> None:
        self.ctx = ctx
        assert ctx.speculative is not None, "a proposer is built with a ProposerContext"
        self.spec: ProposerContext = ctx.speculative

    def propose(self, items: Sequence[ProposeItem]) -> list[list[int]]:
        """Per item, up to ``item.k`` token ids to follow ``item.token_ids``.
        Called once per engine step, before scheduling, on the engine thread."""
        raise NotImplementedError

    def free(self, key: int) -> None:
        """The sequence ``key`` ended (or was preempted): drop its state."""


IMPL_BASES: dict[str, type[PluginImpl]] = {
    "accelerator": Accelerator,
    "backend": Backend,
    "model": ModelLoader,
    "a2a": AllToAll,
    "kv_connector": KVConnector,
    "tool_parser": ToolParser,
    "reasoning_parser": ReasoningParser,
    "proposer": Proposer,
}


def descriptor_fields(d: PluginDescriptor) -> dict[str, Any]:
    """A descriptor as a plain dict (for ``platform plugins --json``)."""
    out = dataclasses.asdict(d)
    out["category"] = d.category
    return out
