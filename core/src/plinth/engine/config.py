"""Engine settings, each declared once.

Every setting lives in one section dataclass below, with its default, its
help text and how the command line spells it (``setting(...)``). The
``platform serve`` / ``generate`` flags (``plinth.cli.add_config_arguments``),
``LLM(**kw)`` (``EngineConfig.from_kwargs``, whose signature is generated) and
the sections of ``EngineConfig`` are all made from these declarations, as
vLLM's ``EngineArgs`` makes its flags from its config classes
(``vllm/engine/arg_utils.py: get_kwargs``). A setting's name is the same
everywhere: the keyword argument, the flag (dashes for underscores) and the
field. ``core/tests/test_config.py`` fails when a default is written a
second time anywhere in the engine or its command line.

What start-up makes of these (the accelerator and backend it chose, the
dtype, whether deterministic mode is on, the step's token budget, the a2a
plugin, the page size) is ``plinth.api.ResolvedConfig``: frozen, and what
plugins and the engine read.

This module imports nothing heavy: the command line builds its parser from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable, Iterator, Mapping

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
#: proposals per sequence and step when a speculative method is named
#: without ``num_speculative_tokens``
DEFAULT_NUM_SPECULATIVE_TOKENS = 4


def setting(
    default: Any = MISSING,
    *,
    help: str,
    default_factory: Callable[[], Any] | Any = MISSING,
    unset: str | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    category: str | None = None,
    json: bool = False,
    cli: bool = True,
    commands: tuple[str, ...] | None = None,
    negatable: bool = True,
) -> Any:
    """One setting: its default and help, and its flag.

    unset:    what the default (None, "auto") means, for the help text
    flag:     the flag when it is not ``--`` and the name with dashes
    parse:    argparse's ``type`` (a ConfigError becomes a usage error)
    category: a plugin category: its choices are the installed plugins' names
    json:     given on the command line as a JSON object
    cli:      False: no flag (given otherwise, or only through ``LLM``)
    commands: the commands that take the flag (default: every engine command)
    negatable: a bool flag gets ``--no-...`` too (BooleanOptionalAction)
    """
    metadata = dict(
        help=help, unset=unset, flag=flag, metavar=metavar, parse=parse, category=category, json=json, cli=cli,
        commands=commands, negatable=negatable,
    )  # fmt: skip
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


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


def _set(obj: Any, name: str, value: Any) -> None:
    """Normalise a field of a frozen section in its ``__post_init__``."""
    object.__setattr__(obj, name, value)


# ---- the sections --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadConfig:
    """The model and how its weights load."""

    model: str | None = setting(
        None, cli=False, unset="the bundled SmolLM2-135M-Instruct",
        help="a Hugging Face model folder, a .gguf file or a model plugin's named model",
    )  # fmt: skip
    dequantize: bool = setting(
        False, negatable=False,
        help="dequantize quantized weights (GGUF blocks) at load to --dtype, even where the backend runs them quantized",
    )  # fmt: skip
    max_model_len: int | None = setting(None, unset="the model's", help="context length")
    load_progress: bool = setting(True, cli=False, help="show a progress bar while the weights load")


@dataclass(frozen=True)
class ComputeConfig:
    """Where and how the model computes: the accelerator, the backend's ops,
    the dtype, deterministic mode, the default seed."""

    device: str = setting(AUTO, category="accelerator", unset="the best available", help="accelerator plugin")
    backend: str = setting(AUTO, category="backend", unset="the accelerator's preference, then priority", help="backend plugin")
    dtype: str = setting(AUTO, unset="the accelerator's default", help="bfloat16 | float32 | float16")
    #: deterministic serving: batch-invariant ops, so a request's tokens and
    #: logits do not depend on its batch, chunking, page size, prefix-cache
    #: hits or speculation (docs/serving.md). None: the chosen backend's word
    #: (``BackendCapabilities.deterministic_default``: on where its measured
    #: cost on the serving benchmark is under 5% on this kind of machine)
    deterministic: bool | None = setting(
        None,
        unset="on where the chosen backend measured the mode within 5% of its default ops on this kind of machine "
        "(the start-up log says which and why)",
        help="batch-invariant ops: a request's tokens and logits do not depend on its batch, chunking, page size, "
        "prefix-cache hits or speculation (docs/serving.md; `platform plugins` shows what each backend declines)",
    )
    seed: int = setting(0, help="seed of torch's default generator: the sampling of requests that give no seed of their own")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    page_size: int = setting(16, help="tokens per KV page (any value >= 1)")
    num_pages: int | None = setting(None, unset="from --kv-cache-memory or the device's memory", help="KV pages in the pool")
    kv_cache_memory: float | None = setting(
        None, metavar="GiB", unset="the accelerator's budget (--gpu-memory-utilization)", help="memory for the KV pool"
    )
    #: the share of a device's memory this run may hold in all (weights,
    #: activations, buffers, KV pool), as vLLM's --gpu-memory-utilization
    gpu_memory_utilization: float = setting(
        0.9, metavar="FRACTION",
        help="share of a device's memory the run may hold in all: weights, the profiled activation peak, "
        "a2a buffers and the KV pool (as vLLM)",
    )  # fmt: skip
    enable_prefix_caching: bool = setting(True, help="reuse KV pages of shared prefixes")

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ConfigError(f"num_pages must be >= 1, got {self.num_pages}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    """What a step holds, and what may wait."""

    max_num_seqs: int = setting(64, help="most sequences running at once")
    #: token budget of one step: an integer, or "auto" (measured at start-up:
    #: ``plinth.engine.step_plan``; ``ResolvedConfig.max_num_batched_tokens`` is the one chosen)
    max_num_batched_tokens: int | str = setting(
        AUTO, parse=parse_token_budget, metavar="N|auto",
        unset="auto: chosen at start-up from timed prefill steps of the model; the choice and its measurements are logged",
        help="token budget of one step",
    )  # fmt: skip
    max_waiting_requests: int = setting(
        4096, metavar="N", commands=("serve",), help="requests allowed to wait; beyond, 503 + Retry-After"
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1")
        if self.max_waiting_requests < 1:
            raise ConfigError("--max-waiting-requests must be >= 1")
        _set(self, "max_num_batched_tokens", parse_token_budget(self.max_num_batched_tokens))


@dataclass(frozen=True)
class ParallelConfig:
    """The process layout (plinth.engine.parallel) and its launch."""

    tp: int = setting(1, help="tensor-parallel size")
    ep: int = setting(1, help="expert-parallel size: 1, or the world tp x dp")
    a2a: str = setting(AUTO, category="a2a", unset="the best that can run the planned layout", help="a2a plugin (with --ep > 1)")
    #: data-parallel size (None: ep / tp when ep > tp, else 1); world = tp x dp
    dp: int | None = setting(None, unset="ep / tp when ep > tp, else 1", help="data-parallel size")
    #: multi-node launch (torchrun's flags): rank 0's node runs the engine, the others workers only
    nnodes: int = setting(1, help="nodes of the world")
    node_rank: int = setting(0, help="this node's index; nodes other than 0 run workers only")
    master_addr: str | None = setting(None, unset="127.0.0.1", help="rank 0's address")
    master_port: int | None = setting(None, unset="a free one, on one node", help="rank 0's rendezvous port")
    dist_timeout: float = setting(
        10.0, metavar="S", help="seconds a collective may wait for a rank before the engine fails (a dead or hung rank)"
    )

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1 or (self.dp is not None and self.dp < 1):
            raise ConfigError("tp, dp and ep must be >= 1")
        if self.dist_timeout <= 0:
            raise ConfigError("dist_timeout must be > 0")

    @property
    def world(self) -> int:
        """Ranks of the world (tp x dp, with dp as ``ParallelLayout`` resolves it)."""
        dp = self.dp if self.dp is not None else (self.ep // self.tp if self.ep > self.tp else 1)
        return self.tp * max(1, dp)

    @property
    def distributed(self) -> bool:
        """More than one rank."""
        return self.world > 1 or self.ep > self.tp


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding."""

    #: a proposer plugin's name (None, "auto" or "none": off)
    speculative_method: str | None = setting(None, category="proposer", unset="off", help="speculative proposer plugin")
    num_speculative_tokens: int | None = setting(
        None, metavar="K", unset=f"{DEFAULT_NUM_SPECULATIVE_TOKENS} when a method is named",
        help="most tokens proposed per sequence and step",
    )  # fmt: skip
    speculative_model: str | None = setting(None, metavar="PATH", help="the draft model (--speculative-method draft)")

    def __post_init__(self) -> None:
        if self.speculative_method in (AUTO, "none", ""):
            _set(self, "speculative_method", None)  # speculation is off unless a method is named
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")

    @property
    def k(self) -> int:
        """Tokens proposed per sequence and step: 0 when speculation is off."""
        if not self.speculative_method:
            return 0
        return self.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector: where prompt KV is saved and loaded beyond this pool."""

    kv_connector: str | None = setting(None, category="kv_connector", unset="none", help="KV connector plugin")
    kv_connector_config: Mapping[str, Any] | None = setting(None, json=True, metavar="JSON", help="options for the KV connector")


@dataclass(frozen=True)
class ObservabilityConfig:
    """What the engine publishes about itself."""

    #: KV-cache events in vLLM's format (``plinth.engine.kv_events``)
    kv_events_config: Mapping[str, Any] | None = setting(
        None, json=True, metavar="JSON",
        help='publish KV-cache events as vLLM does (for llm-d and `platform router`): \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}\'; '
        '"array_like": true for the positional layout of vLLM before 0.32 and llm-d\'s indexer',
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.kv_events_config is not None:
            from plinth.engine.kv_events import KVEventsConfig

            KVEventsConfig.from_mapping(self.kv_events_config)  # unknown fields fail here, before the model loads


#: the sections of ``EngineConfig``, in the order the help lists them
SECTIONS: dict[str, type] = {
    "load": LoadConfig,
    "compute": ComputeConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "speculative": SpeculativeConfig,
    "kv_transfer": KVTransferConfig,
    "observability": ObservabilityConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of an engine, by section. Built from flat keyword
    arguments (``LLM(page_size=32)``, the flags) by ``from_kwargs``."""

    load: LoadConfig = field(default_factory=LoadConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    #: options for plugins (the flags they add, ``plinth_add_cli_arguments``), by name
    plugin_options: Mapping[str, Any] = field(default_factory=dict[str, Any])

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """The config of flat settings (``page_size=32, tp=2``); a name that
        is no setting is a TypeError, as a wrong keyword argument is."""
        by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        options = kwargs.pop("plugin_options", None)
        owner = setting_sections()
        unknown = sorted(set(kwargs) - set(owner))
        if unknown:
            import difflib

            hints = [f"{n} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(n, owner, 1)) else n for n in unknown]
            raise TypeError(f"unknown engine setting{'s' if len(unknown) > 1 else ''}: {', '.join(hints)}")
        for name, value in kwargs.items():
            by_section[owner[name]][name] = value
        sections = {name: SECTIONS[name](**values) for name, values in by_section.items()}
        return cls(**sections, plugin_options=dict(options or {}))

    def replace(self, **kwargs: Any) -> "EngineConfig":
        """This config with some flat settings changed."""
        return EngineConfig.from_kwargs(**{**self.settings(), **kwargs}, plugin_options=self.plugin_options)

    def settings(self) -> dict[str, Any]:
        """The flat settings (what ``from_kwargs`` takes back)."""
        return {f.name: getattr(getattr(self, section), f.name) for section, f in iter_settings()}


def iter_settings() -> Iterator[tuple[str, dataclasses.Field[Any]]]:
    """(section name, field) of every setting, in declaration order."""
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield section, f


def setting_sections() -> dict[str, str]:
    """setting name -> the name of the section that declares it."""
    owner: dict[str, str] = {}
    for section, f in iter_settings():
        if f.name in owner:  # the flat names must stay unique: they are the kwargs and the flags
            raise TypeError(f"setting {f.name} is declared in both {owner[f.name]} and {section}")
        owner[f.name] = section
    return owner


def default_of(f: dataclasses.Field[Any]) -> Any:
    """A setting's default value."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise TypeError(f"setting {f.name} has no default")


def setting_defaults() -> dict[str, Any]:
    """setting name -> its default."""
    return {f.name: default_of(f) for _, f in iter_settings()}
