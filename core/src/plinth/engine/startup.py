"""Start-up: choose the plugins once, load the model, size the KV pool,
settle the step's token budget; what comes out is frozen
(``plinth.api.ResolvedConfig``).

``start_process`` is the one path of one process and of every rank (a rank
passes its ``JoinWorld``, ``launch.RankJoin``, for what differs: the
process group, shared cores, the waits for every rank, the pool every rank
agrees on). ``factory.build_engine`` builds an engine from what it returns.

Everything resolved here becomes plain objects (an accelerator instance, an
op table of callables, a model module, a model runner); the engine's steps
never consult the plugin registry again. Each plugin is judged and built in
a frozen ``SelectionContext`` holding what is settled by then: a backend in
the deterministic mode it would run in (``choose_backend``), so nothing is
decided twice or written back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from plinth.api import (
    ATTENTION_OP_NAMES,
    OP_GROUPS,
    OP_NAMES,
    AttentionBackend,
    BackendDescriptor,
    LoadContext,
    ModelConfig,
    ModelSource,
    OpTable,
    PlannedLayout,
    ResolvedConfig,
    SelectionContext,
    op_signature_problems,
)
from plinth.contract.backend import attention_op_moved
from plinth.engine.config import AUTO, DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from plinth.engine.kv_cache_manager import KVCacheManager
from plinth.engine.model_runner import ModelRunner, kv_cache_specs, spec_groups
from plinth.engine.model_source import locate_model
from plinth.engine.parallel import ParallelGroups, warm_up_group
from plinth.engine.step_plan import CANDIDATE_TOKENS, StepPlan, plan_step
from plinth.errors import ConfigError, PluginError
from plinth.plugins import PluginEntry, PluginRegistry

log = logging.getLogger("plinth.startup")


@dataclass
class Components:
    """What start-up chose, for logs, /version and `platform plugins`."""

    resolved: ResolvedConfig
    accelerator: Any
    model_loader_name: str
    source: ModelSource
    model_config: ModelConfig
    device: torch.device
    ops: Any
    op_sources: dict[str, str] = field(default_factory=dict)
    #: the step's token budget and the measurements it came from (``plinth.engine.step_plan``)
    step_plan: StepPlan | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.resolved.dtype

    def describe(self) -> dict[str, Any]:
        info = self.accelerator.info()
        r = self.resolved
        return {
            "device": r.accelerator,
            # which machine a figure came from: benchmarks record these
            "device_name": info.device_name,
            "isa": list(info.isa),
            "backend": r.backend,
            "model_loader": self.model_loader_name,
            "model": self.source.path,
            "architecture": self.source.architecture,
            "dtype": str(r.dtype).removeprefix("torch."),
            "ops": dict(self.op_sources),
            "num_pages": max(r.num_pages),
            "page_size": r.page_size,
            "max_num_seqs": r.max_num_seqs,
            "deterministic": r.deterministic,  # benchmarks record which mode a figure came from
            **({"step_plan": self.step_plan.describe()} if self.step_plan is not None else {}),
        }


def resolve_deterministic(asked: bool | None, backend: PluginEntry, ctx: SelectionContext) -> tuple[bool, str]:
    """Deterministic mode for this run on ``backend`` and why: what the user
    asked, or (unset) the backend's word for this machine and dtype
    (``BackendCapabilities.deterministic_default``)."""
    if asked is not None:
        return asked, "--deterministic" if asked else "--no-deterministic"
    caps = backend.load().capabilities(dataclasses.replace(ctx, deterministic=False))
    why = caps.deterministic_why or ("its cost here is not measured under 5%" if not caps.deterministic_default else "")
    return caps.deterministic_default, f"unset, so backend {backend.name}'s default: {why}"


@dataclass(frozen=True)
class BackendChoice:
    """The backend and the deterministic mode it runs in, with why."""

    entry: PluginEntry
    deterministic: bool
    why: str


def choose_backend(registry: PluginRegistry, name: str, asked: bool | None, ctx: SelectionContext, prefer: Any = ()) -> BackendChoice:
    """The backend ``name`` (or ``auto``), each candidate judged in the
    deterministic mode it would run in: ``asked``, or unset its own default
    (the mode is settled with the backend, never written back)."""

    def judged(entry: PluginEntry) -> SelectionContext:
        try:
            mode, _ = resolve_deterministic(asked, entry, ctx)
        except Exception:  # noqa: BLE001 - it cannot load: evaluate() says why
            mode = bool(asked)
        return dataclasses.replace(ctx, deterministic=mode)

    entry = registry.select("backend", name, ctx, prefer=prefer, judge=judged)
    mode, why = resolve_deterministic(asked, entry, ctx)
    return BackendChoice(entry, mode, why)


def resolve_ops(registry: PluginRegistry, chosen: PluginEntry, ctx: SelectionContext) -> tuple[OpTable, dict[str, str]]:
    """The op table: the chosen backend's ops over the reference backend's,
    each checked against its signature (a mismatch fails naming the backend)."""
    references = [e for e in registry.entries["backend"] if getattr(e.descriptor, "reference", False) and not e.evaluate(ctx)]
    table: dict[str, Any] = {}
    sources: dict[str, str] = {}
    reference_ops: dict[str, Any] = {}
    if references and references[0] is not chosen:
        reference_ops = dict(references[0].load()(ctx).ops())
        _check_op_signatures(references[0], reference_ops)
        table.update(reference_ops)
        sources.update({name: references[0].name for name in reference_ops})
    backend_cls = chosen.load()
    declined = backend_cls.unsupported_ops(ctx)
    for op, why in declined.items():  # per-op limits, e.g. an instruction set
        log.info("backend %s: %s from %s: %s", chosen.name, op, sources.get(op, "nowhere"), why)
    backend = backend_cls(ctx, reference_ops)
    ops = dict(backend.ops())
    _check_op_signatures(chosen, ops)
    both = sorted(set(ops) & set(declined))
    if both:  # declining is unsupported_ops alone: an op is either declined or provided
        raise PluginError(f"backend {chosen.label()} declines {', '.join(both)} in unsupported_ops() yet returns it from ops()")
    extra = set(ops) - set(OP_NAMES)
    if extra:  # the op table is open: a backend may bring ops the core does not list
        log.info("backend %s brings ops of its own: %s", chosen.name, ", ".join(sorted(extra)))
    for group in OP_GROUPS + tuple(backend_cls.op_groups):
        given = [op for op in group if op in ops]
        if given and len(given) != len(group):
            raise PluginError(f"backend {chosen.label()} must provide {', '.join(group)} together")
    table.update(ops)
    sources.update({name: chosen.name for name in ops})
    missing = [op for op in OP_NAMES if op not in table]
    if missing:
        log.info("ops with no implementation (models needing them will fail to load): %s", ", ".join(missing))
    return OpTable(table, backend_cls.capabilities(ctx)), sources


def _check_op_signatures(entry: PluginEntry, ops: dict[str, Any]) -> None:
    problems = [p for name, fn in ops.items() for p in op_signature_problems(name, fn)]
    problems += [attention_op_moved(name) for name in ops if name in ATTENTION_OP_NAMES]
    if problems:
        raise PluginError(f"backend {entry.label()}: " + "; ".join(problems))


def resolve_attention(registry: PluginRegistry, chosen: PluginEntry, ctx: SelectionContext, ops: OpTable) -> tuple[AttentionBackend[Any], str]:
    """The attention backend and the name of the backend it came from: the
    chosen backend's (``Backend.attention_backend``; its ``problems`` were
    part of choosing it), else the reference's, built with the op table and
    the reference's attention backend (what a backend that shares the
    reference's pages hands the cases its kernels do not cover; their
    declared layouts must agree)."""
    references = [e for e in registry.entries["backend"] if getattr(e.descriptor, "reference", False) and not e.evaluate(ctx)]
    reference_entry = references[0] if references else None
    reference_cls = reference_entry.load().attention_backend(ctx) if reference_entry is not None else None
    reference = reference_cls(ctx, ops) if reference_cls is not None else None
    cls = chosen.load().attention_backend(ctx)
    if cls is None or cls is reference_cls:
        if reference is None or reference_entry is None:
            raise PluginError(f"backend {chosen.label()} brings no attention backend and no reference backend is available for this run")
        return reference, reference_entry.name
    if cls.shares_reference_pages and (reference_cls is None or reference_cls.layout != cls.layout):
        got = "no reference attention backend" if reference_cls is None else f"the reference's pages are {reference_cls.layout.dims}"
        raise PluginError(f"backend {chosen.label()}'s attention hands cases to the reference over its own pages {cls.layout.dims}, but {got}")
    return cls(ctx, ops, reference), chosen.name


def check_required_ops(needed: Any, ops: Any, tried: list[str], architecture: str) -> None:
    """Fail, naming each missing op and the backends tried, when the model
    needs an op the resolved table lacks (before any weight loads)."""
    missing = [op for op in dict.fromkeys(needed) if getattr(ops, op, None) is None]
    if missing:
        raise PluginError(
            f"{architecture} needs op{'s' if len(missing) > 1 else ''} {', '.join(missing)}, which no selected backend provides "
            f"(tried: {', '.join(dict.fromkeys(tried))})"
        )


def resolve_dtype(name: str, accelerator: Any) -> torch.dtype:
    supported = accelerator.supported_dtypes()
    if name in ("auto", None):
        return accelerator.default_dtype()
    dtype = getattr(torch, {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16"}.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r}")
    if dtype not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise ConfigError(f"dtype {name} is not supported on this device (supported: {names})")
    return dtype


def choose_model_loader(registry: PluginRegistry, source: ModelSource, ctx: SelectionContext) -> PluginEntry:
    key = "gguf_architectures" if source.format == "gguf" else "architectures"
    matches = [e for e in registry.entries["model"] if source.architecture in getattr(e.descriptor, key)]
    if not matches:
        known = "; ".join(f"{e.name}: {', '.join(getattr(e.descriptor, key))}" for e in registry.entries["model"])
        raise PluginError(
            f"no installed model plugin builds architecture {source.architecture!r} ({source.format}). "
            + (f"Installed: {known}" if known else "No model plugins are installed.")
        )
    # the highest priority builds it; a tie goes to the first name, so the choice never depends on install order
    ranked = sorted(matches, key=lambda e: (-e.descriptor.priority, e.name))
    best = ranked[0]
    if len(ranked) > 1:
        log.info(
            "model: %s %r is claimed by %s: using %s (highest priority%s)",
            source.format, source.architecture,
            ", ".join(f"{e.label()} priority {e.descriptor.priority}" for e in ranked), best.name,
            ", then name" if ranked[1].descriptor.priority == best.descriptor.priority else "",
        )
    return registry.select("model", best.name, ctx)


def hash_seed(source: ModelSource, cfg: ModelConfig) -> int:
    """Salt for prefix-cache page hashes: pages of different models never match."""
    import os

    ident = f"{cfg.architecture}|{cfg.num_layers}|{cfg.hidden_size}|{cfg.vocab_size}|{os.path.basename(source.path)}"
    return int.from_bytes(hashlib.blake2b(ident.encode(), digest_size=8).digest(), "little")


def needs_memory_budget(config: EngineConfig) -> bool:
    """Whether the KV pool is sized from the device's memory (so a profiling forward is worth running)."""
    return not config.cache.num_pages and config.cache.kv_cache_memory is None


def profiling_tokens(config: EngineConfig, max_model_len: int) -> int:
    """Tokens of the profiling forward: the step token budget (the default
    one where it is measured later), within the model's length."""
    budget = config.scheduler.max_num_batched_tokens
    tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS if budget == AUTO else int(budget)
    return max(1, min(tokens, max_model_len))


def profile_activation_peak(
    accelerator: Any, model: Any, attention: AttentionBackend[Any], model_cfg: ModelConfig, *, device: Any, dtype: torch.dtype,
    page_size: int, tokens: int, device_index: int = 0, decode_seqs: int = 0,
) -> int:
    """The activation peak of one forward of ``tokens`` prompt tokens, as
    vLLM's ``determine_available_memory`` profiles it: run once, before the
    KV pool exists, in a scratch pool just big enough (its pages count in
    the peak: a little over, never under). With ``decode_seqs``, a
    decode-only step of that many sequences too (an MoE layer's decode path
    through an a2a plugin, the "padded" layout, holds other buffers than a
    prefill's). Every rank of a multi-rank run calls it together (the
    forward's collectives)."""
    from plinth.engine.kv_cache_manager import KVCacheManager
    from plinth.engine.step_plan import decode_forward, prefill_forward

    pages = -(-tokens // page_size) + 1 + decode_seqs
    runner = ModelRunner(model, attention, model_cfg, device=device, dtype=dtype, num_pages=pages, page_size=page_size, enable_caching=False)
    kv = KVCacheManager(runner.kv_groups, hash_seed=0, copy_pages=runner.copy_pages)
    prefill, decode = prefill_forward(runner, kv), decode_forward(runner, kv)

    def forwards() -> None:
        prefill(tokens)
        if decode_seqs:
            decode(decode_seqs)

    return int(accelerator.measure_peak(forwards, device_index))  # the scratch pool goes with this frame


def draft_weight_bytes(config: EngineConfig) -> int:
    """A draft model's weights, which load after the KV pool is sized: its
    checkpoint's size on disk (safetensors or GGUF), 0 without one."""
    path = config.speculative.speculative_model
    if not path:
        return 0
    import os

    from plinth.weights import safetensors_files

    try:
        files = [path] if os.path.isfile(path) else [str(f) for f in safetensors_files(path)]
        return sum(os.path.getsize(f) for f in files)
    except (ConfigError, OSError):
        return 0  # the draft fails to load later, with its own reason


@dataclass
class KVPoolPlan:
    """The KV pool of one process: usable pages of each KV-cache group."""

    pages: list[int]
    page_bytes: list[int]  # one page of each group, over its layers
    budget: int | None  # bytes, or None when --num-pages gave the size

    @property
    def num_pages(self) -> int:
        """Pages of the largest group (a one-group model's pool)."""
        return max(self.pages)

    @property
    def total_bytes(self) -> int:
        return sum(n * b for n, b in zip(self.pages, self.page_bytes))


def kv_pool_pages(
    config: EngineConfig, accelerator: Any, model: Any, dtype: torch.dtype, *, max_model_len: int, device_index: int = 0,
    activation_peak: int = 0, reserved: int = 0,
) -> KVPoolPlan:
    """The pages of each KV-cache group, from the specs the model gives its
    layers: ``--num-pages`` (or what the memory budget holds) for groups that
    keep every token, never more than every sequence at full length could
    use; a group that forgets (a sliding window) gets only what its window,
    each step's new tokens and the sequences it holds at once can use. The
    budget is asked after the weights loaded: they count once (``weights``),
    not again through ``free``; the profiled activation peak and
    ``reserved`` (a2a buffers, a draft model) are left out too."""
    cache, sched = config.cache, config.scheduler
    ps = cache.page_size
    groups = spec_groups(kv_cache_specs(model))
    if not groups:
        raise ConfigError("the model caches nothing in any layer: no KV pool to size")
    page_bytes = [spec.page_bytes(ps, dtype) * len(layers) for spec, layers in groups]
    max_useful = -(-sched.max_num_seqs * max_model_len // ps) + 1
    step_tokens = sched.max_num_batched_tokens if sched.max_num_batched_tokens != AUTO else max(CANDIDATE_TOKENS)
    caps = []
    for spec, _ in groups:
        far = 1 << 40
        reach = min(max_model_len, far - spec.first_needed(far))  # tokens one sequence's next query may read
        caps.append(min(max_useful, sched.max_num_seqs * (-(-reach // ps) + 1) + -(-int(step_tokens) // ps)))

    def pages(n: int) -> list[int]:
        return [min(n, cap) for cap in caps]

    if cache.num_pages:
        return KVPoolPlan(pages(cache.num_pages), page_bytes, None)
    if cache.kv_cache_memory is not None:
        budget = int(cache.kv_cache_memory * (1 << 30))
    else:
        free, total = accelerator.memory(device_index)
        budget = accelerator.kv_cache_budget(
            free=free, total=total, weights=model.weight_bytes(), activation_peak=activation_peak, reserved=reserved,
            utilization=cache.gpu_memory_utilization,
        )  # fmt: skip
        log.info(
            "KV budget: %.2f GiB = min(%.2f x %.2f GiB total - %.2f weights - %.2f activation peak - %.2f buffers, %.2f free - peak)",
            budget / 2**30, cache.gpu_memory_utilization, total / 2**30, model.weight_bytes() / 2**30,
            activation_peak / 2**30, reserved / 2**30, free / 2**30,
        )  # fmt: skip
    lo, hi = 0, max(caps)  # the largest group's pages that the budget holds, the others following
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(n * b for n, b in zip(pages(mid), page_bytes)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return KVPoolPlan(pages(lo), page_bytes, budget)


def planned_layout(config: EngineConfig, registry: PluginRegistry) -> PlannedLayout:
    """What the launcher knows before any rank exists: the process layout,
    the accelerator's device kind, the model's MoE shape (read from its
    config, no weights) and the step token budget of a multi-rank run."""
    from plinth.engine.parallel import ParallelLayout

    p = config.parallel
    layout = ParallelLayout.resolve(p.tp, p.dp, p.ep)
    options = dict(config.plugin_options)
    info = registry.select("accelerator", config.compute.device, SelectionContext(options=options)).load()().info()
    model: dict[str, Any] = {}
    try:  # a model that cannot be located fails later, with its own reason; the plan judges what is known
        source = locate_model(config.load.model, registry)
        cfg = choose_model_loader(registry, source, SelectionContext(options=options)).load()().load_config(source)
        model = dict(hidden_size=cfg.hidden_size, num_experts=cfg.num_experts, top_k=int(cfg.raw.get("num_experts_per_tok", 0) or 0))
    except (ConfigError, PluginError, OSError) as exc:
        log.debug("planned layout without the model's shape: %s", exc)
    step = plan_step(config, max_model_len=0, distributed=True)  # the budget every multi-rank run takes
    return PlannedLayout(
        world=layout.world, tp=layout.tp, dp=layout.dp, ep=layout.ep, nnodes=p.nnodes,
        local_world=max(1, layout.world // max(1, p.nnodes)), device_type=info.device_type,
        capability=info.capability or "", dtype=config.compute.dtype, max_tokens_per_step=step.max_num_batched_tokens,
        max_num_seqs=config.scheduler.max_num_seqs, **model,
    )  # fmt: skip


class JoinWorld(Protocol):
    """A rank's part in start-up (``plinth.engine.launch.RankJoin``):
    what differs from one process, asked for at its place in ``start_process``."""

    rank: int
    local_rank: int

    def share_cores(self, options: dict[str, Any]) -> dict[str, Any]:
        """The options with the thread count of ranks sharing a node's cores (before ``init_process``)."""
        ...

    def join(self, accelerator: Any) -> ParallelGroups:
        """Rendezvous, the process group, the TP/DP/EP groups."""
        ...

    def ready(self, stage: str) -> None:
        """Wait, with start-up's long timeout, until every rank reached
        ``stage``: ranks start at their own pace, and the collectives that
        follow (the expert group's, the profiling forward's) time out after
        ``--dist-timeout``."""

    def agree_num_pages(self, pages: list[int]) -> list[int]:
        """Per KV-cache group, the fewest pages any rank can hold."""
        ...


@dataclass
class Started:
    """What start-up built in this process (one process, or one rank)."""

    registry: PluginRegistry
    #: the context plugins were built in, with ``resolved`` (KV connectors and proposers are built with it)
    ctx: SelectionContext
    resolved: ResolvedConfig
    accelerator: Any
    loader_name: str
    source: ModelSource
    model_cfg: ModelConfig
    tokenizer: Any  # None on every rank but 0
    model: Any
    ops: Any
    attention: AttentionBackend[Any]
    op_sources: dict[str, str]
    device: torch.device
    #: the model runner over this process's KV pool (ranks: one scratch page more per group, for dummy forwards)
    runner: ModelRunner
    step_plan: StepPlan
    groups: ParallelGroups | None = None

    @property
    def components(self) -> Components:
        return Components(
            resolved=self.resolved, accelerator=self.accelerator, model_loader_name=self.loader_name, source=self.source,
            model_config=self.model_cfg, device=self.device, ops=self.ops, op_sources=self.op_sources,
            step_plan=self.step_plan,
        )  # fmt: skip


def a2a_unused(config: EngineConfig, layout: PlannedLayout) -> str:
    """Why this run moves no MoE token between ranks ("" when it does): the
    a2a plugin is then neither built nor needed."""
    if config.parallel.ep == 1:
        return "ep=1: every rank holds every expert, no token moves between ranks"
    if layout.hidden_size and not layout.num_experts:
        return "the model has no routed experts (a dense model)"
    return ""


def check_a2a(config: EngineConfig, registry: PluginRegistry) -> EngineConfig:
    """With ep > 1 on an MoE model, the a2a plugin judged against the planned
    layout in the launcher, before anything loads or any rank starts (a named
    one fails with every candidate's reasons); the config returned names the
    one chosen, which every rank builds (``build_a2a``). An a2a named by
    ``--a2a`` that this run will not use is reported, with why, and with
    what its check() says (it may not run here either)."""
    p = config.parallel
    if p.ep == 1 and p.a2a == AUTO:
        return config
    layout = planned_layout(config, registry)
    ctx = SelectionContext(
        tp=p.tp, ep=p.ep, options=dict(config.plugin_options), layout=layout, deterministic=bool(config.compute.deterministic),
    )  # fmt: skip
    unused = a2a_unused(config, layout)
    if unused:
        if p.a2a != AUTO:
            entry = registry.get("a2a", p.a2a)
            reasons = entry.evaluate(ctx)
            log.warning(
                "a2a %s (named by --a2a) is not used: %s%s", entry.label(), unused,
                f" (nor could it run here: {'; '.join(reasons)})" if reasons else "",
            )  # fmt: skip
        return config
    entry = registry.select("a2a", p.a2a, ctx)
    log.info("a2a: %s for %s", entry.label(), ctx.layout)
    return dataclasses.replace(config, parallel=dataclasses.replace(p, a2a=entry.name))


def build_a2a(
    config: EngineConfig, registry: PluginRegistry, ctx: SelectionContext, groups: ParallelGroups, model_cfg: ModelConfig,
    device: torch.device, first: bool,
) -> tuple[Any, int]:
    """This rank's a2a plugin and the device bytes of its buffers, made now
    (every rank together), before the weights load and the KV pool is
    sized. The launcher judged the planned layout and named the plugin
    (``check_a2a``); a node started alone with ``--a2a auto`` judges the
    same plan here. The expert group has run a collective first
    (``warm_up_group``): a plugin that reuses its communicator finds one."""
    ctx = dataclasses.replace(ctx, layout=planned_layout(config, registry))
    name = config.parallel.a2a
    entry = registry.get("a2a", name) if name != AUTO else registry.select("a2a", AUTO, ctx)
    warm_up_group(groups.ep_group, device)
    a2a = entry.load()(ctx, group=groups.ep_group, num_experts=model_cfg.num_experts, hidden_size=model_cfg.hidden_size)
    try:
        reserved = int(a2a.reserve_buffers())
    except Exception as exc:
        raise PluginError(f"a2a {entry.label()} could not set up its buffers: {type(exc).__name__}: {exc}") from exc
    if first:
        log.info("a2a: %s over %d ranks, %.1f MiB of buffers per rank", entry.label(), ctx.layout.ep, reserved / 2**20)
    return a2a, reserved


@dataclass(frozen=True)
class Chosen:
    """The plugins of this process, chosen once, and what they settled."""

    accelerator_name: str
    accelerator: Any
    options: dict[str, Any]
    groups: ParallelGroups | None
    device: torch.device
    dtype: torch.dtype
    source: ModelSource
    loader_name: str
    loader: Any
    model_cfg: ModelConfig
    max_model_len: int
    backend: BackendChoice
    #: the context plugins are judged and built in: the dtype, the model, the deterministic mode settled
    ctx: SelectionContext
    ops: Any
    attention: AttentionBackend[Any]
    op_sources: dict[str, str]


def choose_plugins(config: EngineConfig, registry: PluginRegistry, world: JoinWorld | None, first: bool) -> Chosen:
    """The accelerator (and, ranks: the process group), the model plugin,
    the backend in its deterministic mode, and the op table."""
    local_rank = world.local_rank if world is not None else 0
    options = dict(config.plugin_options)
    acc_entry = registry.select("accelerator", config.compute.device, SelectionContext(options=options))
    accelerator = acc_entry.load()()
    if world is not None:
        options = world.share_cores(options)
    accelerator.init_process(local_rank=local_rank, options=options)
    groups = world.join(accelerator) if world is not None else None
    # unseeded requests draw from torch's default generator: --seed makes a
    # server's run reproducible, as vLLM's --seed does
    torch.manual_seed(config.compute.seed)
    dtype = resolve_dtype(config.compute.dtype, accelerator)

    source = locate_model(config.load.model, registry)
    p = config.parallel
    ctx = SelectionContext(accelerator=accelerator, dtype=dtype, options=options, tp=p.tp, ep=p.ep, page_size=config.cache.page_size)
    loader_entry = choose_model_loader(registry, source, ctx)
    loader = loader_entry.load()()
    model_cfg = loader.load_config(source)
    given = config.load.max_model_len
    max_model_len = min(given or model_cfg.max_model_len, model_cfg.max_model_len)
    if first and given and given > model_cfg.max_model_len:
        log.warning("max_model_len %d is beyond the model's %d: using %d", given, model_cfg.max_model_len, max_model_len)

    ctx = dataclasses.replace(ctx, model=model_cfg)
    backend = choose_backend(registry, config.compute.backend, config.compute.deterministic, ctx, accelerator.info().preferred_backends)
    ctx = dataclasses.replace(ctx, deterministic=backend.deterministic)
    ops, op_sources = resolve_ops(registry, backend.entry, ctx)
    attention, op_sources["attention"] = resolve_attention(registry, backend.entry, ctx, ops)
    if first:  # what the mode holds this run to (the backends log each op they decline for it)
        log.info(
            "deterministic mode: %s (%s; %s)", "on" if backend.deterministic else "off", backend.why,
            "batch-invariant ops: tokens and logits do not depend on batch, chunking, page size, prefix cache, speculation"
            if backend.deterministic else "a request's tokens may depend on what runs beside it; --deterministic fixes them",
        )  # fmt: skip
    tried = [backend.entry.name] + [n for n in reference_backends(registry) if n != backend.entry.name]
    check_required_ops(loader.required_ops(model_cfg), ops, tried, model_cfg.architecture)
    return Chosen(
        accelerator_name=acc_entry.name, accelerator=accelerator, options=options, groups=groups, device=accelerator.device(local_rank),
        dtype=dtype, source=source, loader_name=loader_entry.name, loader=loader, model_cfg=model_cfg, max_model_len=max_model_len,
        backend=backend, ctx=ctx, ops=ops, attention=attention, op_sources=op_sources,
    )  # fmt: skip


def load_weights(config: EngineConfig, registry: PluginRegistry, c: Chosen, world: JoinWorld | None, first: bool) -> tuple[Any, Any, int]:
    """This process's model (its shard: ranks build the a2a plugin first),
    the a2a plugin (None where no token moves between ranks) and the device
    bytes its buffers took."""
    parallel: dict[str, Any] = {}
    a2a: Any = None
    a2a_bytes = 0
    if c.groups is not None:
        if c.groups.layout.ep > 1 and c.model_cfg.num_experts:  # a dense model moves no token (check_a2a said so)
            assert world is not None
            world.ready("plugins chosen")  # the expert group's first collective follows
            a2a, a2a_bytes = build_a2a(config, registry, c.ctx, c.groups, c.model_cfg, c.device, first)
        g = c.groups
        parallel = dict(
            tp_rank=g.tp_rank, tp_size=g.layout.tp, tp_group=g.tp_group, ep_rank=g.ep_rank, ep_size=g.layout.ep, ep_group=g.ep_group, a2a=a2a,
        )  # fmt: skip
    load_ctx = LoadContext(
        device=c.device, dtype=c.dtype, ops=c.ops, attention=c.attention, progress=config.load.load_progress and first,
        dequantize=config.load.dequantize, deterministic=c.backend.deterministic, **parallel,
    )  # fmt: skip
    return c.loader.load_model(c.source, c.model_cfg, load_ctx), a2a, a2a_bytes


def start_process(config: EngineConfig, registry: PluginRegistry, world: JoinWorld | None = None) -> Started:
    """The one start-up path of one process and of every rank: the plugins
    (chosen once), the process group (``world``: ranks only), the model (its
    shard), the KV pool's size, the model runner over it, the step's token
    budget; all of it settled in the ``ResolvedConfig`` it returns."""
    first = world is None or world.rank == 0
    c = choose_plugins(config, registry, world, first)
    model, a2a, a2a_bytes = load_weights(config, registry, c, world, first)
    tokenizer = c.loader.load_tokenizer(c.source) if first else None
    if world is not None:  # ranks load at their own pace: the profiling forward's collectives have a short timeout
        world.ready("weights loaded")
    dtype, local_rank = c.dtype, world.local_rank if world is not None else 0
    plan = size_kv_pool(config, c.accelerator, model, c.attention, c.model_cfg, device=c.device, dtype=dtype, local_rank=local_rank,
                        max_model_len=c.max_model_len, reserved=a2a_bytes + draft_weight_bytes(config), a2a=a2a is not None)  # fmt: skip
    if world is not None:
        plan = KVPoolPlan(world.agree_num_pages(plan.pages), plan.page_bytes, plan.budget)
    if min(plan.pages) < 1:
        where = "" if world is None else " on some rank"
        raise ConfigError(f"no memory left for the KV cache{where} (budget {plan.budget} bytes, one page takes {sum(plan.page_bytes)})")
    page_size = config.cache.page_size
    if first:
        log.info(
            "KV cache: %s pages x %d tokens (%.2f GiB, %s)",
            "+".join(map(str, plan.pages)), page_size, plan.total_bytes / (1 << 30), str(dtype).removeprefix("torch."),
        )  # fmt: skip
    scratch = 0 if world is None else 1  # a rank's dummy forwards write into one page of each group past the pool
    runner = ModelRunner(
        model, c.attention, c.model_cfg, device=c.device, dtype=dtype, num_pages=[n + scratch for n in plan.pages], page_size=page_size,
        enable_caching=config.cache.enable_prefix_caching,
    )  # fmt: skip
    # the step's token budget: given, or timed on this model here (ranks take the default: each probe would need every rank)
    probe_kv = None if world is not None else KVCacheManager(runner.kv_groups, copy_pages=runner.copy_pages)
    step_plan = plan_step(config, runner=runner, kv=probe_kv, max_model_len=c.max_model_len, distributed=world is not None)
    if first:
        log.info("%s", step_plan.log_line())
    layout, p = c.groups.layout if c.groups is not None else None, config.parallel
    resolved = ResolvedConfig(
        accelerator=c.accelerator_name, backend=c.backend.entry.name, dtype=dtype, deterministic=c.backend.deterministic,
        page_size=page_size, num_pages=tuple(plan.pages), max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=step_plan.max_num_batched_tokens, max_model_len=c.max_model_len,
        a2a=(a2a.name or p.a2a) if a2a is not None else None, tp=layout.tp if layout else 1, dp=layout.dp if layout else 1, ep=layout.ep if layout else 1,
    )  # fmt: skip
    return Started(
        registry=registry, ctx=dataclasses.replace(c.ctx, resolved=resolved), resolved=resolved, accelerator=c.accelerator,
        loader_name=c.loader_name, source=c.source, model_cfg=c.model_cfg, tokenizer=tokenizer, model=model, ops=c.ops,
        attention=c.attention, op_sources=c.op_sources, device=c.device, runner=runner, step_plan=step_plan, groups=c.groups,
    )  # fmt: skip


def size_kv_pool(
    config: EngineConfig, accelerator: Any, model: Any, attention: AttentionBackend[Any], model_cfg: ModelConfig, *, device: torch.device,
    dtype: torch.dtype, local_rank: int, max_model_len: int, reserved: int, a2a: bool,
) -> KVPoolPlan:
    """This process's KV pool: from the memory left once the weights
    loaded and one forward's activation peak was profiled (every rank of a
    multi-rank run profiles together: the forward's collectives; with an a2a
    plugin a decode step too, whose MoE path holds other buffers)."""
    peak = 0
    if needs_memory_budget(config):
        peak = profile_activation_peak(
            accelerator, model, attention, model_cfg, device=device, dtype=dtype, page_size=config.cache.page_size,
            tokens=profiling_tokens(config, max_model_len), device_index=local_rank,
            decode_seqs=config.scheduler.max_num_seqs if a2a else 0,
        )  # fmt: skip
    return kv_pool_pages(
        config, accelerator, model, dtype, max_model_len=max_model_len, device_index=local_rank, activation_peak=peak, reserved=reserved
    )


# ---- speculative decoding -----------------------------------------------------------------


def load_tokenizer(model: str, registry: PluginRegistry | None = None, ctx: SelectionContext | None = None) -> Any:
    """The tokenizer (and chat template) a server of ``model`` uses, from its
    model plugin, without loading weights (`platform router`, draft models)."""
    registry = registry if registry is not None else PluginRegistry.discover()
    source = locate_model(model, registry)
    return choose_model_loader(registry, source, ctx if ctx is not None else SelectionContext()).load()().load_tokenizer(source)


def build_draft_runner(path: str, *, registry: PluginRegistry, ctx: SelectionContext, ops: Any, attention: AttentionBackend[Any], backend: str, num_pages: int, page_size: int) -> Any:
    """A draft model for a proposer, built as the target is (its model
    plugin, the target's op table and dtype) with its own page pool of the
    target's size in tokens, KV-cache manager and model runner."""
    from plinth.engine.speculative import DraftModelRunner

    if ctx.accelerator is None or ctx.dtype is None:
        raise PluginError(f"the draft model {path} loads after the target: start-up sets the accelerator and dtype first")
    device, dtype = ctx.accelerator.device(0), ctx.dtype
    try:
        source = locate_model(path)
        loader = choose_model_loader(registry, source, ctx).load()()
        cfg = loader.load_config(source)
        tried = [backend] + [n for n in reference_backends(registry) if n != backend]
        check_required_ops(loader.required_ops(cfg), ops, tried, cfg.architecture)
        model = loader.load_model(source, cfg, LoadContext(device=device, dtype=dtype, ops=ops, attention=attention, progress=False))
        runner = ModelRunner(
            model, attention, cfg, device=device, dtype=dtype, num_pages=num_pages, page_size=page_size,
            enable_caching=False,
        )
    except PluginError as exc:
        raise PluginError(f"the draft model {path} cannot load: {exc}") from exc
    except Exception as exc:
        raise PluginError(f"the draft model {path} cannot load: {type(exc).__name__}: {exc}") from exc
    log.info("draft model %s: %s, %d layers, %d pages x %d tokens", path, cfg.architecture, cfg.num_layers, num_pages, page_size)
    return DraftModelRunner(runner, cfg.vocab_size)


def reference_backends(registry: PluginRegistry) -> list[str]:
    """Backends that implement every op (what an op a backend lacks falls back to)."""
    return [e.name for e in registry.entries["backend"] if isinstance(e.descriptor, BackendDescriptor) and e.descriptor.reference]


def build_spec_decoder(config: EngineConfig, registry: PluginRegistry, ctx: SelectionContext, model_cfg: ModelConfig, tokenizer: Any, draft: dict[str, Any]) -> Any:
    """The proposer named by ``--speculative-method``, validated with a
    ``ProposerContext`` (a named plugin fails with every candidate's reasons)."""
    from plinth.api import ProposerContext
    from plinth.engine.speculative import SpecDecoder, StepCostModel

    spec = config.speculative
    k = spec.k
    pctx = ProposerContext(
        num_speculative_tokens=k,
        speculative_model=spec.speculative_model,
        model=model_cfg,
        tokenizer=tokenizer,
        load_tokenizer=lambda path: load_tokenizer(path, registry, ctx),
        build_draft_runner=lambda path: build_draft_runner(path, **draft),
    )
    sctx = dataclasses.replace(ctx, speculative=pctx)
    entry = registry.select("proposer", spec.speculative_method, sctx)
    proposer = entry.load()(sctx)
    log.info("speculative decoding: %s, k = %d", entry.label(), k)
    return SpecDecoder(proposer, k, vocab_size=model_cfg.vocab_size, method=entry.name, cost_model=StepCostModel())
