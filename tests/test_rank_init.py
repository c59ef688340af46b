"""A rank's start-up on real processes over gloo (world 2, ep 2):
``RankJoin.join`` binds the process group to the device the accelerator
names (``init_process_group(device_id=...)``), and the expert group runs a
collective before the a2a plugin is built, so a library that reuses the
group's communicator (DeepEP V2 reads ``_comm_ptr()``: 0 on a group that
has run nothing) finds one; the fake ``deep_ep``
(plugins/a2a/deepep/tests/fake) refuses a group without one, as upstream's
``ElasticBuffer`` fails on a null communicator. The a2a here is the deepep
plugin, V2's ``ElasticBuffer``.

gloo takes no ``device_id`` (it wants an accelerator with an index), so the
test's accelerator names the CPU and ``init_process_group`` is wrapped to
record what it was given and pass on the rest."""

from __future__ import annotations

import pathlib
import sys

import pytest
from plinth.testing import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAKE = str(ROOT / "plugins/a2a/deepep/tests/fake")
sys.path.insert(0, str(ROOT / "plugins/a2a/deepep/tests"))
import fake_nccl  # noqa: E402  (a scripted host: NCCL 2.30.4 mapped for real, an RDMA device, IBGDA)


class _BoundAccelerator:
    """What RankJoin asks of an accelerator: its collective library and the device a rank's group is bound to."""

    dist_backend = "gloo"

    def process_group_device(self, local_rank: int):
        import torch

        return torch.device("cpu", local_rank)


def join_then_build_a2a(rank: int, world: int, port: int) -> list[tuple[str, str]]:
    """One rank: join the world as start-up does, build the deepep a2a (V2)
    as start-up does; what ran, in order, on which group."""
    import deep_ep
    import torch
    import torch.distributed as dist
    from plinth.api import ModelConfig, PlannedLayout, SelectionContext
    from plinth.engine import startup
    from plinth.engine.config import EngineConfig
    from plinth.engine.launch import RankJoin, make_store
    from plinth.plugins import PluginRegistry

    dist.destroy_process_group()  # run_ranks' own group: the rank forms its world as the engine does
    seen: list[tuple[str, object]] = []
    from plinth_plugin_deepep.a2a import DeepEPAllToAll

    real_init, real_all_reduce = dist.init_process_group, dist.all_reduce
    real_buffer, real_a2a = deep_ep.ElasticBuffer.__init__, DeepEPAllToAll.__init__

    def init_process_group(*args, device_id=None, **kwargs):
        seen.append(("init_process_group", device_id))
        return real_init(*args, **kwargs)  # gloo refuses a CPU device_id: the record is what counts

    def all_reduce(tensor, *args, group=None, **kwargs):
        seen.append(("all_reduce", group))
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    def elastic_buffer(self, group, *args, **kwargs):
        seen.append(("ElasticBuffer", group))
        real_buffer(self, group, *args, **kwargs)

    def a2a_plugin(self, ctx, *, group, **kwargs):
        seen.append(("a2a plugin", group))
        real_a2a(self, ctx, group=group, **kwargs)

    dist.init_process_group, dist.all_reduce = init_process_group, all_reduce
    deep_ep.ElasticBuffer.__init__, DeepEPAllToAll.__init__ = elastic_buffer, a2a_plugin
    try:
        config = EngineConfig.from_kwargs(ep=2, a2a="deepep", plugin_options={"deepep_generation": "v2"})
        join = RankJoin(config, rank, rank, make_store(config, rank == 0, port), alive=lambda: None)
        groups = join.join(_BoundAccelerator())
        model_cfg = ModelConfig(
            architecture="Moe", vocab_size=64, hidden_size=128, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=128,
            max_model_len=64, num_experts=4, raw={"num_experts_per_tok": 2},
        )  # fmt: skip
        plan = PlannedLayout(world=2, dp=2, ep=2, device_type="cpu", hidden_size=128, num_experts=4, top_k=2, max_tokens_per_step=16, max_num_seqs=4)
        startup.planned_layout = lambda config, registry: plan  # what the launcher judged: no model on disk here
        ctx = SelectionContext(options=dict(config.plugin_options), tp=1, ep=2)
        startup.build_a2a(config, PluginRegistry.discover(), ctx, groups, model_cfg, torch.device("cpu"), first=False)
        names = {id(groups.ep_group): "ep", id(groups.tp_group): "tp", id(groups.dp_group): "dp"}
        return [(what, str(arg) if what == "init_process_group" else names.get(id(arg), "other")) for what, arg in seen]
    finally:
        dist.init_process_group, dist.all_reduce = real_init, real_all_reduce
        deep_ep.ElasticBuffer.__init__, DeepEPAllToAll.__init__ = real_buffer, real_a2a


def test_the_group_is_bound_and_the_expert_group_warmed_before_the_a2a_reuses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from plinth.testing.distributed import free_port

    monkeypatch.syspath_prepend(FAKE)  # the spawned ranks take this process's path
    fake_nccl.use(monkeypatch, fake_nccl.scripted_host())  # and its environment (LD_PRELOAD: the scripted NCCL)
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    for seen in run_ranks("test_rank_init:join_then_build_a2a", 2, free_port(), timeout=120):
        assert seen[0][0] == "init_process_group" and seen[0][1].startswith("cpu"), seen  # bound to the accelerator's device
        assert ("a2a plugin", "ep") in seen and ("ElasticBuffer", "ep") in seen, seen
        # start-up warms the group before any a2a plugin exists (whatever the plugin does itself)
        built = seen.index(("a2a plugin", "ep"))
        assert ("all_reduce", "ep") in seen[:built], f"the expert group ran no collective before the a2a plugin was built: {seen}"
