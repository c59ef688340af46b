"""What every plugin category shares: the plugin API version, the descriptor
every registration hook returns a subclass of, the context an implementation
is validated and built with, and the base of every implementation class."""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

if TYPE_CHECKING:  # the contract itself stays cheap to import
    import torch

    from plinth.contract.a2a import PlannedLayout
    from plinth.contract.accelerator import Accelerator
    from plinth.contract.model import ModelConfig
    from plinth.contract.proposer import ProposerContext

#: 2.2: ``ResolvedConfig``, a frozen ``SelectionContext``, ``process_group_device``;
#: 2.1: parsers state sample outputs (``examples``); 2.0: attention and the KV
#: layout left the op table for ``AttentionBackend`` (docs/plugins.md,
#: "Changelog of the plugin API")
PLUGIN_API_VERSION = "2.2"
#: the range a descriptor supports when it states none: this major version
DEFAULT_API_RANGE = ">=2.0,<3"



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
    api: str = DEFAULT_API_RANGE
    description: str = ""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "_").replace(".", "_").isidentifier():
            raise ValueError(f"plugin name {self.name!r} must be a simple identifier")
        if ":" not in self.impl:
            raise ValueError(f"{self.name}: impl {self.impl!r} must be 'module:attr'")


@dataclass(frozen=True)
class ResolvedConfig:
    """What start-up settled for this run, frozen: the engine and plugins
    read these, never the settings as given (``--backend auto``, an unset
    ``--deterministic``, ``--max-num-batched-tokens auto``). Every rank
    resolves the same values. Plugins built once start-up is done (KV
    connectors, proposers) find it in ``SelectionContext.resolved``; those
    built during start-up get the same values in their context as each is
    settled (``dtype``, ``deterministic``, ``layout``)."""

    accelerator: str  # the accelerator plugin's name
    backend: str  # the backend plugin whose ops run (the reference fills what it lacks)
    dtype: "torch.dtype"
    #: batch-invariant ops (``--deterministic``, or unset: the backend's ``deterministic_default``)
    deterministic: bool
    page_size: int  # tokens per KV page
    #: pages of each KV-cache group (ranks: the fewest any rank holds)
    num_pages: tuple[int, ...]
    max_num_seqs: int
    #: the step's token budget: as given, or measured at start-up (``plinth.engine.step_plan``)
    max_num_batched_tokens: int
    max_model_len: int
    #: the a2a plugin's name with ep > 1, else None
    a2a: str | None = None
    tp: int = 1
    dp: int = 1
    ep: int = 1


@dataclass(frozen=True)
class SelectionContext:
    """Everything known when a plugin is validated or built.

    Frozen: start-up makes a new context (``dataclasses.replace``) as it
    settles each thing: accelerators are checked with an empty context,
    backends with the accelerator, dtype, model config and the deterministic
    mode they would run in, a2a plugins with the planned layout. options
    holds the parsed CLI/API options (plugin-specific ones included).
    """

    accelerator: "Accelerator | None" = None
    dtype: "torch.dtype | None" = None
    model: "ModelConfig | None" = None
    tp: int = 1
    ep: int = 1
    options: Mapping[str, Any] = field(default_factory=dict[str, Any])
    #: proposers only: what the engine offers them (None in `platform plugins`)
    speculative: "ProposerContext | None" = None
    #: a2a plugins: the planned parallel layout (None in `platform plugins`)
    layout: "PlannedLayout | None" = None
    #: deterministic serving (``--deterministic``): every op a backend returns
    #: must be batch-invariant, each row's result fixed by that row's own data
    #: (never by how many rows share the call, how a prompt was chunked, the
    #: page size or a prefix-cache hit); an op the backend cannot run so it
    #: declines through ``Backend.unsupported_ops`` and the reference serves it
    deterministic: bool = False
    #: tokens per KV page (``--page-size``): attention backends judge it
    #: (``AttentionBackend.page_sizes``); None in `platform plugins`
    page_size: int | None = None
    #: what start-up settled, once it is done (KV connectors and proposers are built with it)
    resolved: ResolvedConfig | None = None


class PluginImpl(abc.ABC):  # noqa: B024 (the category bases below it declare the abstract methods)
    """Base of every implementation class. The category bases are ABCs: a
    method marked abstract there is required, and a class that lacks one
    fails when the core loads it (``missing_methods`` names them), not at its
    first call."""

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

    @classmethod
    def validate(cls, ctx: SelectionContext) -> list[str]:
        """What the core asks before choosing it: ``check`` and what its
        category adds (a backend: its attention backend's ``problems``).
        Override ``check``, not this."""
        return list(cls.check(ctx))


def missing_methods(cls: type) -> list[str]:
    """The abstract methods ``cls`` leaves unimplemented (empty: complete)."""
    return sorted(getattr(cls, "__abstractmethods__", ()))


def descriptor_fields(d: PluginDescriptor) -> dict[str, Any]:
    """A descriptor as a plain dict (for ``platform plugins --json``)."""
    out = dataclasses.asdict(d)
    out["category"] = d.category
    return out
