"""The plinth plugin hooks, alone (as pytest's ``hookspec.py``).

A plugin is a distribution that declares one entry point in the group
``plinth.plugins``; the entry point names a module (cheap to import: it must
not import torch, vendor SDKs or kernels) holding ``@hookimpl`` functions.

Every hook is called by keyword (pluggy), and an implementation declares only
the arguments it uses, so a new hook argument never breaks an old plugin.

There are eight registration hooks, one per category. Each returns small named
descriptors (``plinth.contract``, re-exported by ``plinth.api``) whose
implementation classes subclass the contract's base classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import pluggy

if TYPE_CHECKING:
    from plinth.contract import (
        A2ADescriptor,
        AcceleratorDescriptor,
        BackendDescriptor,
        KVConnectorDescriptor,
        ModelDescriptor,
        ProposerDescriptor,
        ReasoningParserDescriptor,
        ToolParserDescriptor,
    )

PROJECT = "plinth"
ENTRY_POINT_GROUP = "plinth.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class PlinthHookSpec:
    """The hooks. Registration hooks run once per process, at startup, in the
    order plugins were discovered; they must be fast and side-effect free."""

    @hookspec
    def plinth_register_accelerators(self) -> Sequence[AcceleratorDescriptor]:
        """Return the accelerator platforms this plugin provides.

        Called at startup in every process (API server and each worker rank),
        and by ``platform plugins``. Return ``[]`` for none.
        """
        ...

    @hookspec
    def plinth_register_backends(self) -> Sequence[BackendDescriptor]:
        """Return the op backends (attention, GEMM, norms, ...) this plugin provides.

        Called at startup in every process. Return ``[]`` for none.
        """
        ...

    @hookspec
    def plinth_register_model_loaders(self) -> Sequence[ModelDescriptor]:
        """Return the model loaders this plugin provides, with the
        architectures each builds. Called at startup in every process."""
        ...

    @hookspec
    def plinth_register_a2a(self) -> Sequence[A2ADescriptor]:
        """Return the MoE all-to-all implementations this plugin provides.
        Called at startup in every process."""
        ...

    @hookspec
    def plinth_register_kv_connectors(self) -> Sequence[KVConnectorDescriptor]:
        """Return the KV-cache connectors this plugin provides.
        Called at startup in every process."""
        ...

    @hookspec
    def plinth_register_tool_parsers(self) -> Sequence[ToolParserDescriptor]:
        """Return the tool-call parsers this plugin provides (model plugins
        register the formats their families write). Called at startup in the
        API server process, and by ``platform plugins``."""
        ...

    @hookspec
    def plinth_register_reasoning_parsers(self) -> Sequence[ReasoningParserDescriptor]:
        """Return the reasoning parsers (``<think>...</think>`` and the like)
        this plugin provides. Called at startup in the API server process."""
        ...

    @hookspec
    def plinth_register_proposers(self) -> Sequence[ProposerDescriptor]:
        """Return the speculative-decoding proposers this plugin provides.
        Called at startup in the engine process, and by ``platform plugins``."""
        ...

    @hookspec
    def plinth_add_cli_arguments(self, parser: Any) -> None:
        """Add plugin-specific options to ``platform serve`` / ``generate``.

        Called once in the CLI process, before arguments are parsed, with an
        ``argparse`` argument group named after the plugins. Option values
        reach the implementation through ``SelectionContext.options``. Prefix
        option names with the plugin name (``--cpu-threads``).
        """
        ...


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
