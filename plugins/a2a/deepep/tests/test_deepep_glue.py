"""The plugin's glue against the faithful fake ``deep_ep`` (tests/fake: every
upstream assert, the data moved over gloo) on 2 real processes, on a
scripted host (tests/fake_nccl.py: NCCL 2.30.4 mapped for real, an RDMA
device, IBGDA): one legacy Buffer for both modes with
``clean_low_latency_buffer`` between a normal and a low-latency step, buffer
sizes from the hints made by ``reserve_buffers``, both layouts, the normal
kernels for decode where the host has no IBGDA, V2 sized for the step token
budget (a 600-token prefill) with decode steps dispatched without a host
sync, no cached dispatch, and the fake's own asserts where upstream would
assert (its import-time NCCL checks, a null communicator, GIN)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from plinth.api import PlannedLayout, SelectionContext
from plinth.testing import run_ranks
from plinth.testing.a2a import _expected, _experts

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
import fake_nccl  # noqa: E402

#: put on sys.path only in the rank processes: this process must not find a deep_ep
FAKE = str(HERE / "fake")
HIDDEN = 2048  # a hidden size the low-latency kernels are built for (launch.cuh SWITCH_HIDDEN)


def plan(world: int, **kw) -> PlannedLayout:
    base = dict(world=world, dp=world, ep=world, local_world=world, device_type="cuda", capability="sm_90", hidden_size=HIDDEN,
                num_experts=8, top_k=2, max_tokens_per_step=600, max_num_seqs=16)  # fmt: skip
    return PlannedLayout(**{**base, **kw})


def glue_rank(rank: int, world: int, generation: str) -> dict:
    sys.path.insert(0, FAKE)
    import deep_ep
    from plinth_plugin_deepep.a2a import DeepEPAllToAll

    assert deep_ep.__file__.startswith(FAKE)
    experts, per = 8, 8 // world
    ctx = SelectionContext(ep=world, options={"deepep_generation": generation}, layout=plan(world))
    a2a = DeepEPAllToAll(ctx, group=dist.group.WORLD, num_experts=experts, hidden_size=HIDDEN)
    reserved = a2a.reserve_buffers()
    g = torch.Generator().manual_seed(rank)
    errors, layouts = [], []
    # a 600-token prefill (the step budget), a mixed step, decode steps, a prefill, decode again
    for tokens, decode in [(600 - 7 * rank, False), (0 if rank else 5, False), (3, True), (16, True), (9, False), (2, True)]:
        x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
        ids = torch.rand(tokens, experts, generator=g).topk(2, -1).indices
        weights = torch.rand(tokens, 2, generator=g).softmax(-1)
        got, handle = a2a.dispatch(x, ids, weights, decode=decode)
        layouts.append(got.layout)
        scaled = decode
        y = a2a.combine(_experts(got, rank * per, scaled), handle)
        want = _expected(x, weights, ids, scaled)
        errors.append(float((y.float() - want).abs().max()) / (1 + float(want.abs().max())) if tokens else 0.0)
        assert y.dtype == x.dtype and y.shape == x.shape
    refused = {}
    over = torch.randn(601, HIDDEN).to(torch.bfloat16)
    try:
        a2a.dispatch(over, torch.zeros(601, 2, dtype=torch.long), torch.ones(601, 2) / 2, decode=False)
    except Exception as exc:  # PluginError on v2 (said before upstream's assert); legacy normal kernels take any count
        refused["over_budget"] = str(exc)
    return {"errors": errors, "layouts": layouts, "calls": list(deep_ep.CALLS), "reserved": reserved, "refused": refused}


@pytest.mark.slow  # the fake moves a 600-token prefill token by token
@pytest.mark.parametrize("generation", ["legacy", "legacy-no-ibgda", "v2"])
def test_round_trips_through_the_fake(generation, monkeypatch):
    fake_nccl.use(monkeypatch, fake_nccl.scripted_host(ibgda=generation != "legacy-no-ibgda"))
    out = run_ranks(glue_rank, 2, generation.removesuffix("-no-ibgda"), timeout=240)
    for rank, o in enumerate(out):
        assert max(o["errors"]) < 0.02, (rank, o["errors"])  # bf16 on the wire
        names = [name for name, _ in o["calls"]]
        if generation == "legacy":
            assert o["layouts"] == ["flat", "flat", "padded", "padded", "flat", "padded"]
            buffers = [kw for name, kw in o["calls"] if name == "Buffer"]
            assert len(buffers) == 1 and buffers[0]["low_latency_mode"] and buffers[0]["num_qps_per_rank"] == 4  # one Buffer, NVSHMEM once
        elif generation == "legacy-no-ibgda":  # legacy.py:561-563: no low-latency kernels without IBGDA
            assert o["layouts"] == ["flat"] * 6
            buffers = [kw for name, kw in o["calls"] if name == "Buffer"]
            assert len(buffers) == 1 and not buffers[0]["low_latency_mode"]
            assert "low_latency_dispatch" not in names
        else:
            assert o["layouts"] == ["flat"] * 6
            assert [kw for name, kw in o["calls"] if name == "ElasticBuffer"] == [dict(num_max_tokens_per_rank=600, hidden=HIDDEN, num_topk=2)]
            dispatches = [kw for name, kw in o["calls"] if name == "elastic_dispatch"]
            assert not any(kw["cached"] for kw in dispatches)
            # decode steps: no host sync, bounded by max_num_seqs; prefill and mixed steps sync (elastic.py:961)
            assert [(kw["cpu_sync"], kw["num_max"]) for kw in dispatches] == [
                (True, 600), (True, 600), (False, 16), (False, 16), (True, 600), (False, 16)]  # fmt: skip
            assert "more than the 600 (the step token budget)" in o["refused"]["over_budget"]
        assert o["reserved"] > 0
        if generation == "legacy":
            # cleaned once after each run of normal kernels that precedes a low-latency step
            assert names.count("clean_low_latency_buffer") == 2
            assert [kw["num_max"] for name, kw in o["calls"] if name == "low_latency_dispatch"] == [16, 16, 16]


def cached_rank(rank: int, world: int) -> dict:
    """Upstream's own rules the plugin must respect, as the fake enforces them."""
    sys.path.insert(0, FAKE)
    import deep_ep

    dist.barrier()  # the group's communicator exists after a collective (comm.py:61-64)
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=4, hidden=256, num_topk=2)
    x = torch.randn(3, 256).to(torch.bfloat16)
    ids = torch.tensor([[0, 5], [1, 2], [7, 6]])
    _, _, _, handle, _ = buf.dispatch(x, topk_idx=ids, topk_weights=torch.ones(3, 2) / 2, num_experts=8)
    out = {}
    try:  # a cached dispatch without num_experts / num_sms (what the plugin used to do)
        buf.dispatch(x, handle=handle)
    except TypeError as exc:
        out["bare_cached"] = str(exc)
    buf.dispatch(x, handle=handle, num_experts=8, num_sms=handle.num_sms)  # what upstream needs
    try:
        buf.dispatch(torch.randn(5, 256).to(torch.bfloat16), topk_idx=torch.zeros(5, 2, dtype=torch.long), num_experts=8)
    except AssertionError as exc:
        out["over_max"] = repr(exc)
    legacy = deep_ep.Buffer(dist.group.WORLD, 0, 1 << 20, low_latency_mode=True, num_qps_per_rank=4)
    try:
        deep_ep.Buffer(dist.group.WORLD, 0, 1 << 20, low_latency_mode=True, num_qps_per_rank=4)
    except RuntimeError as exc:
        out["second_nvshmem"] = str(exc)
    try:
        legacy.low_latency_dispatch(torch.randn(2, 256).to(torch.bfloat16), torch.zeros(2, 2, dtype=torch.long), 16, 8, use_fp8=False)
    except AssertionError:
        out["ll_hidden"] = True
    return out


def test_the_fake_asserts_what_upstream_asserts(monkeypatch):
    fake_nccl.use(monkeypatch, fake_nccl.scripted_host())
    for o in run_ranks(cached_rank, 2, timeout=120):
        assert "unsupported operand" in o["bare_cached"]  # get_theoretical_num_sms(None, k): None % 1
        assert "AssertionError" in o["over_max"]  # elastic/buffer.hpp:756
        assert "second time" in o["second_nvshmem"]
        assert o["ll_hidden"]  # hidden 256 is not in SWITCH_HIDDEN


def _import_fake(env: dict, code: str = "") -> subprocess.CompletedProcess:
    program = f"import sys; sys.path.insert(0, {FAKE!r}); import deep_ep\n{code}"
    return subprocess.run([sys.executable, "-c", program], env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


def test_the_fake_imports_as_upstream_does():
    """deep_ep/__init__.py:46-68 and the extension's load, in fresh
    interpreters: one NCCL, byte-equal to the linked one, >= 2.30.4."""
    good, old = fake_nccl.scripted_host(), fake_nccl.scripted_host(version=(2, 28, 9))
    assert _import_fake(good).returncode == 0
    two = _import_fake({**good, "LD_PRELOAD": f"{good['LD_PRELOAD']} {old['LD_PRELOAD']}"})
    assert "Duplicate NCCL runtime found" in two.stderr
    other = _import_fake({**good, "EP_NCCL_ROOT_DIR": old["EP_NCCL_ROOT_DIR"]})
    assert "Invalid NCCL versions" in other.stderr
    assert _import_fake({**good, "EP_NCCL_ROOT_DIR": old["EP_NCCL_ROOT_DIR"], "EP_SUPPRESS_NCCL_CHECK": "1"}).returncode == 0
    assert "undefined symbol: ncclDevCommCreate" in _import_fake(old).stderr
    assert _import_fake({**good, "LD_PRELOAD": ""}).returncode != 0  # no NCCL loaded: filecmp of None (upstream's TypeError)


def null_comm_rank(rank: int, world: int, disable_gin: bool) -> dict:
    sys.path.insert(0, FAKE)
    if disable_gin:
        os.environ["EP_DISABLE_GIN"] = "1"
    import deep_ep

    out = {}
    try:  # no collective yet on this group: _comm_ptr() is 0 (comm.py:61-64)
        deep_ep.ElasticBuffer(dist.new_group([0, 1]), num_max_tokens_per_rank=4, hidden=256, num_topk=2)
    except RuntimeError as exc:
        out["null"] = str(exc)
    dist.barrier()
    try:
        deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=4, hidden=256, num_topk=2)
        out["made"] = True
    except AssertionError as exc:  # nccl.cu:86-90
        out["gin"] = str(exc)
    return out


@pytest.mark.parametrize("disable_gin", [False, True])
def test_the_fake_s_elastic_buffer_needs_a_communicator_and_gin(monkeypatch, disable_gin):
    fake_nccl.use(monkeypatch, fake_nccl.scripted_host(rdma=False))
    monkeypatch.delenv("EP_DISABLE_GIN", raising=False)
    for o in run_ranks(null_comm_rank, 2, disable_gin, timeout=120):
        assert "communicator is null" in o["null"]
        if disable_gin:
            assert o.get("made") and "gin" not in o
        else:
            assert "NCCL GIN is unavailable" in o["gin"]
