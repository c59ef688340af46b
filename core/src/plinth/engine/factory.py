"""``build_engine``: the one way a configuration becomes an engine.

Start-up (``startup.start_process``, in this process or, with more than one
rank, in every rank: ``multiproc.launch_world``) gives the model, its runner
and the frozen ``ResolvedConfig``; each dp group then gets one ``LLMEngine``
over its ``Executor`` (``LocalExecutor``, or the group's
``MultiprocExecutor``), its KV-cache manager built here
(``build_kv_manager``) whatever the executor. More than one dp group goes
behind the dp front end (``data_parallel.DataParallelEngine``).
"""

from __future__ import annotations

import logging
from typing import Any

from plinth.engine.config import EngineConfig
from plinth.engine.engine import LLMEngine
from plinth.engine.executor import Executor, LocalExecutor
from plinth.engine.interfaces import EngineCore
from plinth.engine.kv_cache_manager import KVCacheManager
from plinth.engine.kv_events import build_recorder
from plinth.engine.kv_transfer import build_kv_transfer, connector_options
from plinth.engine.model_runner import kv_cache_groups
from plinth.engine.scheduler import Scheduler
from plinth.engine.startup import Started, build_spec_decoder, check_a2a, hash_seed, start_process
from plinth.plugins import PluginRegistry

log = logging.getLogger("plinth.startup")


def build_engine(config: EngineConfig, registry: PluginRegistry | None = None) -> EngineCore:
    registry = registry or PluginRegistry.discover()
    config = check_a2a(config, registry)  # names the a2a plugin the ranks build
    if not config.parallel.distributed:
        started = start_process(config, registry)
        engine = build_llm_engine(config, registry, started, LocalExecutor(started.runner))
        log.info("engine ready: %s", engine.describe())
        return engine
    # only a multi-rank engine imports torch.distributed's side of plinth
    from plinth.engine.multiproc import launch_world

    started, world = launch_world(config, registry)
    try:
        engines = [build_llm_engine(config, registry, started, world.executor(d), dp_rank=d) for d in range(world.layout.dp)]
    except BaseException:
        world.close()
        raise
    if len(engines) == 1:
        return engines[0]
    from plinth.engine.data_parallel import DataParallelEngine

    return DataParallelEngine(engines, world)


def build_kv_manager(config: EngineConfig, started: Started, executor: Executor, *, dp_rank: int = 0) -> KVCacheManager:
    """A scheduler's KV-cache manager: its own pages (the pool start-up
    sized: ranks agreed on it), its pages copied by its executor, KV events
    published for its dp group."""
    r = started.resolved
    kv = KVCacheManager(
        kv_cache_groups(started.model, list(r.num_pages), r.page_size, enable_caching=config.cache.enable_prefix_caching),
        hash_seed=hash_seed(started.source, started.model_cfg),
        copy_pages=executor.copy_pages,
    )  # fmt: skip
    kv.pool.events = build_recorder(config.observability.kv_events_config, block_size=r.page_size, dp_rank=dp_rank)
    return kv


def build_llm_engine(config: EngineConfig, registry: PluginRegistry, started: Started, executor: Executor, *, dp_rank: int = 0) -> LLMEngine:
    """One scheduler's engine over ``executor``: its KV-cache manager, KV
    connector and speculative decoder (the last two where this process holds
    the whole model: ``launch.check_supported`` refuses them with more than one rank)."""
    kv = build_kv_manager(config, started, executor, dp_rank=dp_rank)
    r = started.resolved
    connector_name, connector_opts = connector_options(config.kv_transfer.kv_connector, config.kv_transfer.kv_connector_config)
    if connector_name:
        model_id = f"{hash_seed(started.source, started.model_cfg):016x}"
        kv.connector = build_kv_transfer(registry, connector_name, connector_opts, started.ctx, started.runner, model_id=model_id)
        if kv.pool.events is not None:  # the store's tiers report with their medium
            kv.connector.attach_events(kv.pool.events)
    scheduler = Scheduler(kv, max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens)
    spec: Any = None
    if config.speculative.speculative_method:
        draft = dict(
            registry=registry, ctx=started.ctx, ops=started.ops, attention=started.attention, backend=r.backend, num_pages=max(r.num_pages), page_size=r.page_size,
        )  # fmt: skip
        spec = build_spec_decoder(config, registry, started.ctx, started.model_cfg, started.tokenizer, draft)
        started.runner.keep_hidden = spec.wants_hidden
    return LLMEngine(
        executor=executor, tokenizer=started.tokenizer, model_config=started.model_cfg, scheduler=scheduler,
        max_model_len=r.max_model_len, components=started.components, spec=spec,
    )  # fmt: skip
