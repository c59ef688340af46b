"""The backend category (``--backend``): a table of compute ops, their typed
signatures, and what the ops exchange (quantized weights); a step's attention
metadata, which the backend's attention backend (``plinth.contract.attention``)
turns into its plan."""

from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Protocol, Sequence

from plinth.contract.base import PluginDescriptor, PluginImpl, SelectionContext

if TYPE_CHECKING:
    import torch

    from plinth.contract.attention import AttentionBackend, AttentionPlan



@dataclass(frozen=True)
class BackendDescriptor(PluginDescriptor):
    """A table of compute ops (``--backend``). impl -> a ``Backend`` subclass.

    reference: this backend implements every op in ``OP_NAMES`` and an
    attention backend on any torch device; what another backend leaves out
    or declines is taken from it.
    """

    category: ClassVar[str] = "backend"
    reference: bool = False


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
        ...


class PackLinearOp(Protocol):
    def __call__(self, weight: "torch.Tensor | QuantizedWeight") -> Any:
        """Once per weight at load time: an [out, in] tensor (or a
        ``QuantizedWeight``) into what this backend's ``linear`` takes (a
        pre-blocked layout, say); the reference returns it as is. Models
        store the result and only ever hand it to ``linear``."""
        ...


class LinearOp(Protocol):
    def __call__(self, x: "torch.Tensor", weight: Any, bias: "torch.Tensor | None" = None) -> "torch.Tensor":
        """x @ weight.T (+ bias); weight is what ``pack_linear`` returned."""
        ...


class SiluAndMulOp(Protocol):
    def __call__(self, x: "torch.Tensor") -> "torch.Tensor":
        """silu(x[..., :d]) * x[..., d:] for a fused gate/up projection."""
        ...


class RotaryOp(Protocol):
    def __call__(self, q: "torch.Tensor", k: "torch.Tensor", positions: "torch.Tensor", cos_sin: "torch.Tensor", is_neox: bool) -> "tuple[torch.Tensor, torch.Tensor]":
        """(q, k) rotated; cos_sin is the model's [max_pos, rotary_dim] table
        (cos half, then sin half). ``positions`` is the step's own tensor (a
        new one each step, shared by every layer): an op may keep what it
        gathers for it until another tensor comes."""
        ...


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
        ...


#: the ops the core knows, with their signatures; a backend may add others
OP_SIGNATURES: dict[str, type] = {
    "rms_norm": RmsNormOp,
    "pack_linear": PackLinearOp,
    "linear": LinearOp,
    "silu_and_mul": SiluAndMulOp,
    "rotary": RotaryOp,
    "fused_moe": FusedMoEOp,
}
OP_NAMES: tuple[str, ...] = tuple(OP_SIGNATURES)
#: ops that only work together (a weight layout one packs and the other
#: reads): start-up takes each group from one backend, all or none. A new
#: pair (an adapter's pack and apply, a quantized format's) is added here
#: with its signatures; a backend's own pairs go in ``Backend.op_groups``
OP_GROUPS: tuple[tuple[str, ...], ...] = (("pack_linear", "linear"),)
#: the ops every decoder the core runs calls; ``ModelLoader.required_ops``
#: adds what an architecture needs (attention is the attention backend's)
BASE_OPS: tuple[str, ...] = ("rms_norm", "pack_linear", "linear", "silu_and_mul", "rotary")
#: names the op table had before plugin API 2.0 that now belong to the
#: attention backend (``plinth.contract.attention``): a backend returning one
#: from ``ops()`` is refused with a pointer to it
ATTENTION_OP_NAMES: tuple[str, ...] = ("allocate_kv_cache", "prepare_attention", "attention", "copy_pages", "qkv_attention")


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend declares about its ops, read by model loaders as
    ``ops.capabilities`` (not ops themselves: nothing calls them).

    fp8:          the path ``linear`` takes for ``fp8_e4m3`` weights:
                  "w8a8" (FP8 tensor cores) or "weight_only" (dequantized
                  inside the GEMM); "" when it keeps no FP8 weights (the
                  loader dequantizes them at load)
    fp8_why:      why that path, for the start-up log
    gguf_formats: GGUF types (``Q4_0``, ``Q4_K``, ...) whose blocks
                  ``pack_linear`` keeps; others are dequantized at load
    gguf_path:    how ``linear`` runs them, for the start-up log
    deterministic_default: whether deterministic serving is on when the
                  user leaves ``--deterministic`` unset: the backend's own
                  measurement says its batch-invariant ops cost under 5%
                  on the serving benchmark on this kind of machine and dtype
    deterministic_why: that measurement or the reason it is off, for the
                  start-up log and `platform plugins`
    dropped_paths: kernel paths the hardware claims that the backend's own
                  start-up probe refused, each with why and what runs
                  instead ("amx: probe died with SIGILL in linear_amx;
                  using avx512-bf16 (vdpbf16ps)"), for the start-up log and
                  `platform plugins`
    """

    fp8: str = ""
    fp8_why: str = ""
    gguf_formats: tuple[str, ...] = ()
    gguf_path: str = ""
    deterministic_default: bool = False
    deterministic_why: str = ""
    dropped_paths: tuple[str, ...] = ()


_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)


def op_signature_problems(name: str, fn: object) -> list[str]:
    """Why ``fn`` cannot serve as op ``name`` (empty: it can): callable, and
    for an op of ``OP_SIGNATURES`` callable every way a model may call it,
    as a type checker matches a callable against a Protocol (positional
    parameters by position and name, keyword-only ones by name, defaults
    where the signature has them, nothing else required). A backend's own
    ops are checked for being callable only."""
    if not callable(fn):
        return [f"op {name} is a {type(fn).__name__}, not a callable"]
    proto = OP_SIGNATURES.get(name)
    if proto is None:
        return []
    try:
        got = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return []
    want = list(inspect.signature(proto.__call__).parameters.values())[1:]
    params = list(got.parameters.values())
    var_pos = any(p.kind is _P.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind is _P.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in _POSITIONAL]
    problems: list[str] = []
    covered: set[str] = set()
    want_positional = [w for w in want if w.kind in _POSITIONAL]
    for i, w in enumerate(want_positional):
        p = positional[i] if i < len(positional) else None
        if p is None:
            if not var_pos:
                problems.append(f"takes no positional parameter {i + 1} ({w.name})")
            continue
        covered.add(p.name)
        if w.kind is _P.POSITIONAL_OR_KEYWORD and p.name != w.name and not var_kw:
            problems.append(f"names parameter {i + 1} {p.name!r}, not {w.name!r} (callers may pass it by name)")
        if w.default is not _P.empty and p.default is _P.empty:
            problems.append(f"requires {p.name}, which callers may omit")
    for w in (w for w in want if w.kind is _P.KEYWORD_ONLY):
        p = got.parameters.get(w.name)
        if p is None or p.kind not in (_P.KEYWORD_ONLY, _P.POSITIONAL_OR_KEYWORD):
            if not var_kw:
                problems.append(f"takes no keyword {w.name}")
            continue
        covered.add(p.name)
        if w.default is not _P.empty and p.default is _P.empty:
            problems.append(f"requires {p.name}, which callers may omit")
    for p in params:
        if p.name not in covered and p.default is _P.empty and p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
            problems.append(f"requires {p.name}, which callers never pass")
    if not problems:
        return []
    shown = inspect.Signature([p.replace(annotation=_P.empty) for p in params])
    wanted = inspect.Signature([w.replace(annotation=_P.empty) for w in want])
    return [f"op {name}{shown} does not match {proto.__name__}{wanted}: {'; '.join(problems)}"]


class OpTable:
    """The resolved table of compute ops the model calls: each op a plain
    attribute, set once at start-up (no lookup per call), each op of
    ``OP_SIGNATURES`` checked against its signature when the table is built.
    A backend's own ops are attributes too (``getattr(ops, "my_op", None)``);
    ``capabilities`` is what the backend declares about its ops."""

    rms_norm: RmsNormOp
    pack_linear: PackLinearOp
    linear: LinearOp
    silu_and_mul: SiluAndMulOp
    rotary: RotaryOp
    #: optional: None where no backend brings it
    fused_moe: FusedMoEOp | None = None
    capabilities: BackendCapabilities

    def __init__(self, ops: Mapping[str, Callable[..., Any]], capabilities: BackendCapabilities | None = None) -> None:
        problems = [p for name, fn in ops.items() for p in op_signature_problems(name, fn)]
        reserved = [name for name in ops if name.startswith("_") or name in _RESERVED]
        problems += [f"op name {name!r} is reserved" for name in reserved]
        problems += [attention_op_moved(name) for name in ops if name in ATTENTION_OP_NAMES]
        if problems:
            raise TypeError("; ".join(problems))
        for name, fn in ops.items():
            setattr(self, name, fn)
        self.capabilities = capabilities or BackendCapabilities()

    def names(self) -> list[str]:
        """The ops this table holds."""
        return [name for name, fn in vars(self).items() if name != "capabilities" and fn is not None]


_RESERVED = frozenset({"capabilities", "names"})


def attention_op_moved(name: str) -> str:
    return (
        f"op {name} is no compute op since plugin API 2.0: attention and the KV layout are the backend's "
        "AttentionBackend (Backend.attention_backend, plinth.api.AttentionBackend; docs/plugins.md, changelog)"
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

    A model loader hands a backend only the formats it says it runs, as its
    ``BackendCapabilities`` declare them (``fp8``, ``gguf_formats``; the
    loader logs the path and dequantizes what is not offered).
    """

    format: str
    qweight: "torch.Tensor"
    scale: "torch.Tensor"
    shape: tuple[int, int]
    block_size: tuple[int, int] | None = None


class Backend(PluginImpl):
    """A table of compute ops. Instantiated once per process after selection
    (for ``ops()``); what it declares for a context (``check``,
    ``unsupported_ops``, ``capabilities``) are classmethods."""

    #: groups of this backend's own ops that only work together (as ``OP_GROUPS``)
    op_groups: ClassVar[tuple[tuple[str, ...], ...]] = ()

    def __init__(self, ctx: SelectionContext, reference: Mapping[str, Callable[..., Any]] | None = None) -> None:
        self.ctx = ctx
        #: the reference backend's ops (None in the reference itself): call
        #: them for the cases this backend does not handle
        self.reference = reference or {}

    @classmethod
    def unsupported_ops(cls, ctx: SelectionContext) -> Mapping[str, str]:
        """The one way to decline an op: ops this backend has but cannot run
        for ``ctx``, each with why (``{"linear": "bf16 GEMMs need
        avx512bw+vl+dq"}``). ``ops()`` must leave them out (start-up refuses
        a table that returns a declined op) and the reference serves them;
        start-up logs this and ``platform plugins`` shows it. Whole-backend
        problems go in ``check``; an op the backend never has is simply not
        in ``ops()``."""
        return {}

    @abc.abstractmethod
    def ops(self) -> Mapping[str, Callable[..., Any]]:
        """The ops this backend provides for ``self.ctx``: any of
        ``OP_SIGNATURES``, each matching its signature (checked at start-up;
        the reference backend supplies the rest), plus any op of its own
        (the table is open)."""
        raise NotImplementedError

    @classmethod
    def validate(cls, ctx: SelectionContext) -> list[str]:
        """``check``, then (when it passes: the attention module may import
        what check found missing) why its attention backend declines ``ctx``."""
        reasons = list(cls.check(ctx))
        if reasons:
            return reasons
        attention = cls.attention_backend(ctx)
        return attention.problems(ctx) if attention is not None else []

    @classmethod
    def attention_backend(cls, ctx: SelectionContext) -> "type[AttentionBackend[Any]] | None":
        """Its paged attention and KV layout (``plinth.api.AttentionBackend``)
        for ``ctx``; None: the reference backend's. Its ``problems(ctx)`` are
        this backend's own (``validate``): an explicit ``--backend`` fails with
        them, ``auto`` takes the next candidate. Its module must be cheap to
        import (no vendor library before the class is built). The reference
        backend must return one."""
        return None

    @classmethod
    def capabilities(cls, ctx: SelectionContext) -> BackendCapabilities:
        """What this backend's ops can do beyond their signatures (the FP8
        path ``linear`` takes, which quantized formats ``pack_linear``
        keeps) for ``ctx``: decided from the context alone, like
        ``unsupported_ops``, so start-up and ``platform plugins`` read the
        same answer without building any op."""
        return BackendCapabilities()


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
    #: what the attention backend's ``build_plan`` made of this step (the
    #: engine builds it once per step and KV-cache group; every layer reads it)
    plan: "AttentionPlan | None" = None
    #: the decode flag MoE layers hand the a2a plugin; set by the engine when
    #: ranks with different batches must agree (None: ``is_decode_only``)
    moe_decode: bool | None = None
    #: with more than one KV-cache group (``plinth.api.KVCacheSpec``): each
    #: group's own metadata (its block tables and slot mapping, the rest
    #: shared), and the group of each layer; empty: one group, this one
    groups: "list[AttentionMetadata]" = field(default_factory=lambda: list["AttentionMetadata"]())
    layer_groups: Sequence[int] = ()

    def for_layer(self, layer: int) -> "AttentionMetadata":
        """The metadata layer ``layer`` attends with (its group's pages)."""
        return self.groups[self.layer_groups[layer]] if self.groups else self

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
