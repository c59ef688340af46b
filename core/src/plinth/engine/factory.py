"""Which engine a configuration gets: ``LLMEngine`` in this process, or,
with more than one rank, ``DistributedEngine`` over worker ranks. Both come
out of ``startup.start_process``, the one start-up path."""

from __future__ import annotations

import logging
from typing import Any

from plinth.engine.config import EngineConfig
from plinth.engine.engine import LLMEngine
from plinth.engine.interfaces import EngineCore
from plinth.engine.kv_cache_manager import KVCacheManager
from plinth.engine.kv_events import build_recorder
from plinth.engine.kv_transfer import build_kv_transfer, connector_options
from plinth.engine.model_runner import ModelRunner
from plinth.engine.scheduler import Scheduler
from plinth.engine.startup import build_spec_decoder, check_a2a, hash_seed, start_process
from plinth.engine.step_plan import plan_step
from plinth.plugins import PluginRegistry

log = logging.getLogger("plinth.startup")


def is_distributed(config: EngineConfig) -> bool:
    return config.tp * (config.dp or 1) > 1 or config.ep > config.tp


def build_engine(config: EngineConfig, registry: PluginRegistry | None = None) -> EngineCore:
    registry = registry or PluginRegistry.discover()
    config = check_a2a(config, registry)  # names the a2a plugin the ranks build
    if is_distributed(config):
        # only a multi-rank engine imports torch.distributed's side of plinth
        from plinth.engine.distributed import build_distributed_engine

        return build_distributed_engine(config, registry)
    return build_local_engine(config, registry)


def build_local_engine(config: EngineConfig, registry: PluginRegistry) -> LLMEngine:
    started = start_process(config, registry)
    runner = ModelRunner(
        started.model, started.attention, started.model_cfg, device=started.device, dtype=started.dtype,
        num_pages=started.plan.pages, page_size=config.page_size, enable_caching=config.enable_prefix_caching,
    )  # fmt: skip
    model_id = hash_seed(started.source, started.model_cfg)
    kv = KVCacheManager(runner.kv_groups, hash_seed=model_id, copy_pages=runner.copy_pages)
    # the step's token budget: given, or timed on this model here (before a
    # KV connector is attached: the probes' pages are never saved anywhere)
    step_plan = plan_step(config, runner=runner, kv=kv, max_model_len=started.max_model_len)
    log.info("%s", step_plan.log_line())
    # after the probes: their pages are no one's prefix
    kv.pool.events = build_recorder(config.kv_events_config, block_size=config.page_size)
    connector_name, connector_opts = connector_options(config.kv_connector, config.kv_connector_config)
    if connector_name:
        kv.connector = build_kv_transfer(registry, connector_name, connector_opts, started.ctx, runner, model_id=f"{model_id:016x}")
        if kv.pool.events is not None:  # the store's tiers report with their medium
            kv.connector.attach_events(kv.pool.events)
    scheduler = Scheduler(kv, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=step_plan.max_num_batched_tokens)
    spec: Any = None
    if config.speculative_method:
        draft = dict(
            registry=registry, ctx=started.ctx, ops=started.ops, attention=started.attention, backend=started.backend_name,
            num_pages=started.num_pages, page_size=config.page_size,
        )  # fmt: skip
        spec = build_spec_decoder(config, registry, started.ctx, started.model_cfg, started.tokenizer, draft)
        runner.keep_hidden = spec.wants_hidden
    components = started.components(config, step_plan)
    log.info("engine ready: %s", components.describe())
    return LLMEngine(
        runner=runner, tokenizer=started.tokenizer, model_config=started.model_cfg, scheduler=scheduler,
        max_model_len=started.max_model_len, components=components, spec=spec,
    )  # fmt: skip
