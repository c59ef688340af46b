"""What every model loader reads the same way from a checkpoint: its config
(config.json, or a GGUF file's metadata made into one), its tokenizer (once
per path) and its special tokens (config.json, generation_config.json, the
tokenizer). A model plugin subclasses ``CheckpointLoader`` and writes only
its model's part: the sizes it reads from the config, and the weights."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, ClassVar

from plinth.contract import ModelConfig, ModelLoader, ModelSource
from plinth.errors import ConfigError
from plinth.tokenizer import Tokenizer
from plinth.weights import GGUFFile, load_hf_config

log = logging.getLogger("plinth.checkpoint")


def _token_ids(value: Any) -> list[int]:
    """A config's token id field (one id, a list, or None) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class CheckpointLoader(ModelLoader):
    """A ``ModelLoader`` with the config, tokenizer and special-token reading
    done: a subclass implements ``load_model``, builds its ``ModelConfig``
    with ``model_config`` and, if it reads GGUF files, sets ``gguf_config``."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, Tokenizer] = {}

    #: config.json's fields from a GGUF file's metadata, for a loader that
    #: reads GGUF files (``gguf_config = staticmethod(hf_config_from_gguf)``);
    #: None: GGUF files are refused
    gguf_config: ClassVar[Callable[[GGUFFile], dict[str, Any]] | None] = None

    def hf_config(self, source: ModelSource) -> dict[str, Any]:
        """The checkpoint's config.json as a dict (a GGUF file's through ``gguf_config``)."""
        if source.format == "gguf":
            read = type(self).gguf_config  # a plain function: not bound to the loader
            if read is None:
                raise ConfigError(f"the {self.name or type(self).__name__} model plugin loads Hugging Face folders of safetensors, not GGUF")
            return read(GGUFFile(source.path))
        return dict(source.hf_config or load_hf_config(source.path))

    def load_tokenizer(self, source: ModelSource) -> Tokenizer:
        """The GGUF file's tokenizer, or the folder's; read once per path."""
        tokenizer = self._tokenizers.get(source.path)
        if tokenizer is None:
            tokenizer = Tokenizer.from_gguf(source.path) if source.format == "gguf" else Tokenizer.from_hf_dir(source.path)
            tokenizer = self._tokenizers[source.path] = self.adapt_tokenizer(tokenizer, source)
        return tokenizer

    def adapt_tokenizer(self, tokenizer: Tokenizer, source: ModelSource) -> Tokenizer:
        """A model's fix to the tokenizer it was shipped with (a chat
        template a base checkpoint lacks); called once per path."""
        return tokenizer

    def special_tokens(self, source: ModelSource, cfg: dict[str, Any]) -> tuple[tuple[int, ...], int | None]:
        """(EOS ids, BOS id): config.json's, generation_config.json's and the
        tokenizer's (its chat format's end-of-turn token too), in that order,
        each id once. A checkpoint without a tokenizer gives a warning."""
        eos = _token_ids(cfg.get("eos_token_id"))
        bos = cfg.get("bos_token_id")
        gen_path = os.path.join(source.path, "generation_config.json")
        if source.format == "hf" and os.path.exists(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
            eos += _token_ids(gen.get("eos_token_id"))
            bos = bos if bos is not None else gen.get("bos_token_id")
        try:
            tokenizer = self.load_tokenizer(source)
            eos += tokenizer.eos_token_ids
            bos = bos if bos is not None else tokenizer.bos_token_id
        except ConfigError as exc:
            log.warning("no tokenizer for %s: %s", source.path, exc)
        return tuple(dict.fromkeys(eos)), None if bos is None else int(bos)

    def model_config(self, source: ModelSource, cfg: dict[str, Any], **sizes: Any) -> ModelConfig:
        """A ``ModelConfig`` of the model's ``sizes`` (architecture, vocab,
        heads, ...) with the special tokens, the checkpoint's dtype and the
        raw config filled in."""
        eos, bos = self.special_tokens(source, cfg)
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").removeprefix("torch.")
        return ModelConfig(eos_token_ids=eos, bos_token_id=bos, dtype=dtype, raw=cfg, **sizes)
