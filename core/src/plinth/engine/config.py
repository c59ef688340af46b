"""Engine options (the keyword arguments of ``LLM`` and the flags of
``platform serve`` / ``generate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from plinth.errors import ConfigError

#: ``max_num_batched_tokens="auto"``: chosen at start-up from timed forwards
#: of the loaded model (``plinth.engine.step_plan``)
AUTO = "auto"
#: Token budget of one step where it is not measured (more than one rank).
#: A step's prefill chunk delays every running stream's next token and every
#: waiting request's first one; 512 tokens keep a step around half a second
#: on two CPU cores, and GEMMs with 512 rows already run at full speed, so
#: bigger budgets buy little throughput.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
#: deterministic serving (``--deterministic``): batch-invariant ops, so a
#: request's tokens and logits do not depend on its batch, chunking, page
#: size, prefix-cache hits or speculation (docs/serving.md). The one place
#: its default lives: None, the chosen backend's word
#: (``BackendCapabilities.deterministic_default``: on where its measured
#: cost on the serving benchmark is under 5% on this kind of machine).
DEFAULT_DETERMINISTIC: bool | None = None


@dataclass
class EngineConfig:
    model: str | None = None  # a HF folder or .gguf file; None: the default model
    device: str = "auto"
    backend: str = "auto"
    dtype: str = "auto"
    #: quantized weights (GGUF blocks) dequantized at load to ``dtype``, even
    #: where the backend runs their format (default: kept quantized there)
    dequantize: bool = False
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory: float | None = None  # GiB; default: the accelerator's budget
    #: the share of a device's memory this run may hold in all (weights,
    #: activations, buffers, KV pool), as vLLM's --gpu-memory-utilization
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    #: token budget of one step: an integer, or "auto" (measured at start-up:
    #: ``plinth.engine.step_plan``; the engine's ``step_plan`` says what was chosen)
    max_num_batched_tokens: int | str = AUTO
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    tp: int = 1
    ep: int = 1
    a2a: str = "auto"
    #: data-parallel size (None: ep / tp when ep > tp, else 1); world = tp x dp
    dp: int | None = None
    #: multi-node launch (torchrun's flags): rank 0's node runs the engine, the others workers only
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # default 127.0.0.1
    master_port: int | None = None  # default: a free port (one node)
    #: seconds a collective may wait for a rank before the engine fails (dead or hung rank)
    dist_timeout: float = 10.0
    kv_connector: str | None = None
    kv_connector_config: Mapping[str, Any] | None = None
    #: KV-cache events in vLLM's format (``--kv-events-config``: ``plinth.engine.kv_events``)
    kv_events_config: Mapping[str, Any] | None = None
    plugin_options: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    #: requests allowed to wait before new ones are refused (HTTP 503)
    max_waiting_requests: int = 4096
    load_progress: bool = True
    #: speculative decoding: a proposer plugin's name (None, "auto" or "none": off)
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None  # k; default 4 when a method is named
    speculative_model: str | None = None  # the draft model of the `draft` proposer
    #: batch-invariant ops in every backend (``SelectionContext.deterministic``)
    deterministic: bool | None = DEFAULT_DETERMINISTIC

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ConfigError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1")
        self.max_num_batched_tokens = parse_token_budget(self.max_num_batched_tokens)
        if self.tp < 1 or self.ep < 1 or (self.dp is not None and self.dp < 1):
            raise ConfigError("tp, dp and ep must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dist_timeout <= 0:
            raise ConfigError("dist_timeout must be > 0")
        if self.speculative_method in ("auto", "none", ""):
            self.speculative_method = None  # speculation is off unless a method is named
        if self.kv_events_config is not None:
            from plinth.engine.kv_events import KVEventsConfig

            KVEventsConfig.from_mapping(self.kv_events_config)  # unknown fields fail here, before the model loads
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")


def parse_token_budget(value: Any) -> int | str:
    """``max_num_batched_tokens`` as given: "auto" (any case, or None), else
    an integer >= 1 (a string of digits too, as the CLI passes it)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == AUTO):
        return AUTO
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"max_num_batched_tokens must be an integer >= 1 or 'auto', got {value!r}") from None
    if isinstance(value, float) and value != n or n < 1:
        raise ConfigError(f"max_num_batched_tokens must be an integer >= 1 or 'auto', got {value!r}")
    return n
