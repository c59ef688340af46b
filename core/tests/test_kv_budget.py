"""The KV pool's memory budget with an accelerator whose memory report is
scripted: the weights count once (``free`` is read after they loaded), the
profiled activation peak and the a2a buffers are left out, and models at
10%, 50% and 80% of a device get positive budgets where the old
``0.9 * free - weights`` went negative."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from plinth.api import Accelerator, AcceleratorInfo, FullAttentionSpec
from plinth.engine.config import EngineConfig
from plinth.engine.startup import kv_pool_pages, profiling_tokens

GiB = 1 << 30
TOTAL = 80 * GiB
CONTEXT = GiB // 2  # what the runtime holds besides torch (CUDA context)


class ScriptedAccelerator(Accelerator):
    """A device of TOTAL bytes holding ``held`` bytes; ``memory`` reports
    what is free after them, ``measure_peak`` runs the forward and returns
    what the script says its peak was."""

    device_type = "scripted"
    dist_backend = "gloo"

    def __init__(self, held: int, peak: int = 0) -> None:
        self.held, self.peak, self.forwards = held, peak, 0

    def info(self) -> AcceleratorInfo:
        return AcceleratorInfo(device_type="scripted", dist_backend="gloo", device_count=1, memory_total=TOTAL)

    def memory(self, index: int = 0) -> tuple[int, int]:
        return TOTAL - self.held, TOTAL

    def measure_peak(self, fn, index: int = 0) -> int:
        fn()
        return self.peak


def model(weights: int) -> SimpleNamespace:
    """A Llama-8B-shaped model's KV description (32 layers, 8 KV heads of 128) with ``weights`` bytes."""
    return SimpleNamespace(weight_bytes=lambda: weights, kv_cache_specs=lambda: [FullAttentionSpec(num_kv_heads=8, head_dim=128)] * 32)


def pool(config, acc, m, **kw):
    plan = kv_pool_pages(config, acc, m, torch.bfloat16, max_model_len=kw.pop("max_model_len", 4096), **kw)
    return plan.num_pages, plan.page_bytes[0], plan.budget


@pytest.mark.parametrize("share", [0.1, 0.5, 0.8])
def test_budget_counts_the_weights_once(share):
    weights = int(share * TOTAL)
    peak, a2a = 2 * GiB, GiB
    acc = ScriptedAccelerator(held=weights + a2a + CONTEXT)  # read after the weights loaded and the buffers were made
    config = EngineConfig.from_kwargs(model="x", max_num_seqs=10**6)  # no cap from sequence lengths
    pages, page_bytes, budget = pool(config, acc, model(weights), activation_peak=peak, reserved=a2a)
    want = min(int(0.9 * TOTAL) - weights - peak - a2a, TOTAL - weights - a2a - CONTEXT - peak)
    assert budget == want > 0
    assert pages == budget // page_bytes > 0
    # everything the run holds stays within the utilisation share of the device
    assert weights + peak + a2a + pages * page_bytes <= 0.9 * TOTAL
    old = int(0.9 * (TOTAL - weights - CONTEXT)) - weights  # the formula this replaces
    if share >= 0.5:
        assert old < budget  # the weights were subtracted twice
    if share == 0.8:
        assert old < 0


def test_utilization_and_what_is_free_both_bound_the_budget():
    acc = ScriptedAccelerator(held=10 * GiB)
    m = model(8 * GiB)
    low = EngineConfig.from_kwargs(model="x", gpu_memory_utilization=0.5, max_num_seqs=10**6)
    _, _, budget = pool(low, acc, m, activation_peak=GiB)
    assert budget == int(0.5 * TOTAL) - 8 * GiB - GiB
    busy = ScriptedAccelerator(held=70 * GiB)  # another process holds most of the device
    _, _, budget = pool(EngineConfig.from_kwargs(model="x"), busy, m, activation_peak=GiB)
    assert budget == 10 * GiB - GiB
    with pytest.raises(Exception, match="gpu_memory_utilization"):
        EngineConfig.from_kwargs(model="x", gpu_memory_utilization=1.5)


def test_given_sizes_skip_the_budget():
    acc = ScriptedAccelerator(held=79 * GiB)
    m = model(79 * GiB)
    assert pool(EngineConfig.from_kwargs(model="x", num_pages=7), acc, m, max_model_len=64)[0] == 7
    _, _, budget = pool(EngineConfig.from_kwargs(model="x", kv_cache_memory=2.0), acc, m, max_model_len=64)
    assert budget == 2 * GiB


def test_the_default_peak_reads_memory_around_the_forward():
    class Plain(ScriptedAccelerator):
        measure_peak = Accelerator.measure_peak

    acc = Plain(held=GiB)

    def forward():  # a caching allocator keeps what the forward took
        acc.held += 3 * GiB

    assert acc.measure_peak(forward) == 3 * GiB


def test_profiling_tokens_are_the_step_budget():
    assert profiling_tokens(EngineConfig.from_kwargs(model="x", max_num_batched_tokens=2048), 4096) == 2048
    assert profiling_tokens(EngineConfig.from_kwargs(model="x", max_num_batched_tokens=2048), 1000) == 1000
    assert profiling_tokens(EngineConfig.from_kwargs(model="x"), 4096) == 512  # the default budget where it is measured later


def test_a_draft_models_weights_are_left_out(tmp_path):
    from plinth.engine.startup import draft_weight_bytes

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    assert draft_weight_bytes(EngineConfig.from_kwargs(model="x", speculative_method="draft", speculative_model=str(tmp_path))) == 4096
    assert draft_weight_bytes(EngineConfig.from_kwargs(model="x")) == 0


def test_the_profile_runs_a_decode_step_too_where_an_a2a_takes_its_decode_path():
    """An MoE layer's decode path through an a2a plugin (the "padded"
    layout) holds other buffers than a prefill: with ``decode_seqs`` the
    measured function runs a decode-only step of that many sequences after
    the prefill, both inside ``measure_peak``."""
    from plinth.api import ModelConfig
    from plinth.engine.startup import profile_activation_peak
    from toy_engine import TOY_ATTENTION, ToyModel

    seen: list[tuple[int, bool]] = []

    class Recording(ToyModel):
        def forward(self, input_ids, positions, kv_caches, meta):
            seen.append((int(input_ids.shape[0]), bool(meta.is_decode_only)))
            return super().forward(input_ids, positions, kv_caches, meta)

    class Measuring(ScriptedAccelerator):
        def measure_peak(self, fn, index: int = 0) -> int:
            before = len(seen)
            fn()
            self.inside = seen[before:]
            return self.peak

    cfg = ModelConfig(architecture="Toy", vocab_size=97, hidden_size=1, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1,
                      max_model_len=4096)  # fmt: skip
    acc = Measuring(held=0, peak=123)
    kw = dict(device=torch.device("cpu"), dtype=torch.float64, page_size=4, tokens=24)
    assert profile_activation_peak(acc, Recording(), TOY_ATTENTION, cfg, **kw) == 123
    assert acc.inside == [(24, False)]
    assert profile_activation_peak(acc, Recording(), TOY_ATTENTION, cfg, decode_seqs=5, **kw) == 123
    assert acc.inside == [(24, False), (5, True)]
