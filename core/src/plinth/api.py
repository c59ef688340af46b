"""The stable names a plugin may import. Plugins import from here (and from
``plinth.hookspecs``), never from core internals; anything not listed here may
change without notice."""

from plinth.errors import ConfigError, PlinthError, PluginError
from plinth.hookspecs import (
    BASE_OPS,
    OP_NAMES,
    OP_SIGNATURES,
    PLUGIN_API_VERSION,
    A2ADescriptor,
    Accelerator,
    AcceleratorDescriptor,
    AcceleratorInfo,
    AllToAll,
    AttentionMetadata,
    Backend,
    BackendDescriptor,
    CausalLM,
    DispatchedTokens,
    DraftRunner,
    KVConnector,
    KVConnectorDescriptor,
    KVLayout,
    LoadContext,
    ModelConfig,
    ModelDescriptor,
    ModelLoader,
    ModelSource,
    ProposeItem,
    Proposer,
    ProposerContext,
    ProposerDescriptor,
    QuantizedWeight,
    ReasoningParse,
    ReasoningParser,
    ReasoningParserDescriptor,
    SelectionContext,
    ToolCallItem,
    ToolParse,
    ToolParser,
    ToolParserDescriptor,
    hookimpl,
)
from plinth.parsing import INVALID, JsonCallView, held_back, is_json_object, json_value_end, read_json_arguments, read_json_call, skip_ws
from plinth.tokenizer import Tokenizer
from plinth.weights import (
    GGUFFile,
    dequantize_gguf,
    iter_safetensors,
    load_hf_config,
    safetensors_files,
)



def load_accelerator(name: str = "auto", options: dict | None = None) -> Accelerator:
    """The accelerator ``--device NAME`` would choose, instantiated: for tools
    that run outside an engine (a kernel prebuild, a plugin's own tests)."""
    from plinth.plugins import PluginRegistry

    ctx = SelectionContext(options=dict(options or {}))
    return PluginRegistry.discover().select("accelerator", name, ctx).load()()


__all__ = [
    "load_accelerator",
    "BASE_OPS",
    "OP_NAMES",
    "OP_SIGNATURES",
    "PLUGIN_API_VERSION",
    "A2ADescriptor",
    "Accelerator",
    "AcceleratorDescriptor",
    "AcceleratorInfo",
    "AllToAll",
    "AttentionMetadata",
    "Backend",
    "BackendDescriptor",
    "CausalLM",
    "ConfigError",
    "DispatchedTokens",
    "DraftRunner",
    "GGUFFile",
    "KVConnector",
    "KVConnectorDescriptor",
    "KVLayout",
    "LoadContext",
    "ModelConfig",
    "ModelDescriptor",
    "ModelLoader",
    "ModelSource",
    "PlinthError",
    "PluginError",
    "ProposeItem",
    "Proposer",
    "ProposerContext",
    "ProposerDescriptor",
    "QuantizedWeight",
    "ReasoningParse",
    "ReasoningParser",
    "ReasoningParserDescriptor",
    "SelectionContext",
    "ToolCallItem",
    "ToolParse",
    "ToolParser",
    "ToolParserDescriptor",
    "Tokenizer",
    "dequantize_gguf",
    "INVALID",
    "JsonCallView",
    "held_back",
    "hookimpl",
    "is_json_object",
    "json_value_end",
    "read_json_arguments",
    "read_json_call",
    "skip_ws",
    "iter_safetensors",
    "load_hf_config",
    "safetensors_files",
]
