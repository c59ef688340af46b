"""The stable names a plugin may import. Plugins import from here (and from
``plinth.hookspecs``), never from core internals; anything not listed here may
change without notice."""

from plinth.errors import ConfigError, PlinthError, PluginError
from plinth.hookspecs import (
    OP_NAMES,
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
    KVConnector,
    KVConnectorDescriptor,
    LoadContext,
    ModelConfig,
    ModelDescriptor,
    ModelLoader,
    ModelSource,
    QuantizedWeight,
    SelectionContext,
    hookimpl,
)
from plinth.tokenizer import Tokenizer
from plinth.weights import (
    GGUFFile,
    dequantize_gguf,
    iter_safetensors,
    load_hf_config,
    safetensors_files,
)

__all__ = [
    "OP_NAMES",
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
    "GGUFFile",
    "KVConnector",
    "KVConnectorDescriptor",
    "LoadContext",
    "ModelConfig",
    "ModelDescriptor",
    "ModelLoader",
    "ModelSource",
    "PlinthError",
    "PluginError",
    "QuantizedWeight",
    "SelectionContext",
    "Tokenizer",
    "dequantize_gguf",
    "hookimpl",
    "iter_safetensors",
    "load_hf_config",
    "safetensors_files",
]
