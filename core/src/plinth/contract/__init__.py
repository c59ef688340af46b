"""The plinth plugin contract, a module per plugin category.

A plugin is a distribution that declares one entry point in the group
``plinth.plugins``; the entry point names a module (cheap to import: it must
not import torch, vendor SDKs or kernels) holding ``@hookimpl`` functions
(the hooks are in ``plinth.hookspecs``). Each registration hook returns small
named descriptors; a descriptor names its implementation lazily as
``"module:attr"``, which the core imports only when that plugin is chosen (or
when ``platform plugins`` asks it whether it is available). The
implementation classes a descriptor may point at are the base classes here:
subclass them.

=================  ===================================================
module             category: descriptor, base class, what they exchange
=================  ===================================================
``base``           every category: ``PluginDescriptor``, ``PluginImpl``,
                   ``SelectionContext``, ``ResolvedConfig``,
                   ``PLUGIN_API_VERSION``
``accelerator``    ``--device``: ``Accelerator``, ``AcceleratorInfo``
``backend``        ``--backend``: ``Backend``, the op signatures,
                   ``QuantizedWeight``, ``AttentionMetadata``
``attention``      a backend's paged attention: ``AttentionBackend``,
                   ``AttentionPlan``, ``KVCacheLayout``, ``PageSizes``
``model``          model loaders: ``ModelLoader``, ``ModelConfig``,
                   ``ModelSource``, ``LoadContext``, ``CausalLM``
``kv_cache``       what a model's layers cache
``a2a``            ``--a2a``: ``AllToAll``, ``DispatchedTokens``
``kv_connector``   ``--kv-connector``: ``KVConnector``, ``KVLayout``
``proposer``       ``--speculative-method``: ``Proposer``, ``ProposeItem``,
                   ``ProposerContext``, ``DraftRunner``
``parsers``        ``--tool-call-parser``, ``--reasoning-parser``
=================  ===================================================

Plugins import these names from ``plinth.api``. The core states
``PLUGIN_API_VERSION``; a descriptor states the range it supports in ``api``
(a PEP 440 specifier). Outside that range the plugin is shown as
incompatible and cannot be chosen.
"""

from __future__ import annotations

from plinth.contract.a2a import A2ADescriptor, AllToAll, DispatchedTokens, PlannedLayout, expert_ranges
from plinth.contract.accelerator import Accelerator, AcceleratorDescriptor, AcceleratorInfo
from plinth.contract.attention import (
    HEADS_FIRST,
    PAGE_DIMS,
    PAGES_FIRST,
    AttentionBackend,
    AttentionPlan,
    KVCacheLayout,
    PageSizes,
    QKVAttention,
)
from plinth.contract.backend import (
    ATTENTION_OP_NAMES,
    BASE_OPS,
    OP_GROUPS,
    OP_NAMES,
    OP_SIGNATURES,
    AttentionMetadata,
    Backend,
    BackendCapabilities,
    BackendDescriptor,
    FusedMoEOp,
    LinearOp,
    OpTable,
    PackLinearOp,
    QuantizedWeight,
    RmsNormOp,
    RotaryOp,
    SiluAndMulOp,
    op_signature_problems,
)
from plinth.contract.base import (
    DEFAULT_API_RANGE,
    PLUGIN_API_VERSION,
    PluginDescriptor,
    PluginImpl,
    ResolvedConfig,
    SelectionContext,
    descriptor_fields,
    missing_methods,
)
from plinth.contract.kv_cache import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from plinth.contract.kv_connector import KVConnector, KVConnectorDescriptor, KVLayout
from plinth.contract.model import CausalLM, LoadContext, ModelConfig, ModelDescriptor, ModelLoader, ModelSource
from plinth.contract.parsers import (
    ReasoningParse,
    ReasoningParser,
    ReasoningParserDescriptor,
    ToolCallItem,
    ToolParse,
    ToolParser,
    ToolParserDescriptor,
)
from plinth.contract.proposer import DraftRunner, ProposeItem, Proposer, ProposerContext, ProposerDescriptor

#: category -> the descriptor type its registration hook returns
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

#: category -> the base class its implementations subclass
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

__all__ = [
    "ATTENTION_OP_NAMES",
    "BASE_OPS",
    "DEFAULT_API_RANGE",
    "DESCRIPTOR_TYPES",
    "HEADS_FIRST",
    "OP_GROUPS",
    "PAGE_DIMS",
    "PAGES_FIRST",
    "IMPL_BASES",
    "OP_NAMES",
    "OP_SIGNATURES",
    "PLUGIN_API_VERSION",
    "A2ADescriptor",
    "Accelerator",
    "AcceleratorDescriptor",
    "AcceleratorInfo",
    "AllToAll",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionPlan",
    "Backend",
    "BackendCapabilities",
    "BackendDescriptor",
    "CausalLM",
    "DispatchedTokens",
    "PlannedLayout",
    "expert_ranges",
    "DraftRunner",
    "FusedMoEOp",
    "FullAttentionSpec",
    "KVCacheSpec",
    "KVConnector",
    "KVCacheLayout",
    "KVConnectorDescriptor",
    "KVLayout",
    "LinearOp",
    "LoadContext",
    "OpTable",
    "ModelConfig",
    "ModelDescriptor",
    "ModelLoader",
    "ModelSource",
    "PackLinearOp",
    "PageSizes",
    "PluginDescriptor",
    "PluginImpl",
    "ProposeItem",
    "Proposer",
    "ProposerContext",
    "ProposerDescriptor",
    "QKVAttention",
    "QuantizedWeight",
    "ReasoningParse",
    "ReasoningParser",
    "ReasoningParserDescriptor",
    "RmsNormOp",
    "RotaryOp",
    "ResolvedConfig",
    "SelectionContext",
    "SlidingWindowSpec",
    "SiluAndMulOp",
    "ToolCallItem",
    "ToolParse",
    "ToolParser",
    "ToolParserDescriptor",
    "descriptor_fields",
    "missing_methods",
    "op_signature_problems",
]
