"""Step planning (plinth.engine.step_plan): the choice from made-up curves,
the bounded measurement loop under a fake clock, and the option's parsing."""

from __future__ import annotations

import argparse
import random

import pytest
from plinth.engine import step_plan as sp
from plinth.engine.config import AUTO, DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig, parse_token_budget
from plinth.errors import ConfigError

SIZES = sp.CANDIDATE_TOKENS  # 32 .. 2048


def saturating(n: int) -> float:
    """A fixed cost per step plus a cost per token: throughput saturates."""
    return 0.005 + 0.0001 * n


def curve_of(cost, sizes=SIZES):
    return [(n, cost(n)) for n in sizes]


class FakeClock:
    """Time that moves only when a fake forward runs."""

    def __init__(self, cost):
        self.now = 0.0
        self.cost = cost
        self.calls: list[int] = []

    def __call__(self) -> float:
        return self.now

    def forward(self, n: int) -> None:
        self.calls.append(n)
        self.now += self.cost(n)


# ---- the choice ------------------------------------------------------------------------------


def test_saturating_curve_takes_the_smallest_size_near_the_best_cost_per_token():
    budget, why = sp.choose_budget(curve_of(saturating))
    # per token: 512 -> 109.8 us, 1024 -> 104.9, 2048 -> 102.4 (the best); 5% over it is 107.5
    assert budget == 1024
    assert "within 5%" in why


def test_linear_curve_takes_the_smallest_size():
    # the same cost per token at every size: a bigger step buys no throughput
    assert sp.choose_budget(curve_of(lambda n: 0.0001 * n))[0] == 32


def test_latency_bound_caps_a_curve_still_falling():
    # a large fixed cost: the cost per token keeps falling, but 2048 tokens take 0.30 s
    cost = lambda n: 0.1 + 0.0001 * n  # noqa: E731
    budget, why = sp.choose_budget(curve_of(cost), latency_bound=0.25)
    assert budget == 1024 and "under 250 ms" in why
    assert sp.choose_budget(curve_of(cost), latency_bound=1.0)[0] == 2048


def test_every_size_over_the_bound_takes_the_smallest_then_the_decodes():
    curve = curve_of(lambda n: 1.0 + 0.01 * n, sizes=(32, 64))
    budget, why = sp.choose_budget(curve, latency_bound=0.25)
    assert budget == 32 and "over the 250 ms" in why
    budget, why = sp.choose_budget(curve, latency_bound=0.25, decodes=64)
    assert budget == 32 + 64 and "over the 250 ms" in why and "64 for max_num_seqs decodes" in why


def test_a_full_batch_of_decodes_comes_on_top_of_the_prompt_chunk():
    # the scheduler serves running streams first: the chunk a prompt gets is what is left
    assert sp.choose_budget(curve_of(lambda n: 0.0001 * n), decodes=64)[0] == 32 + 64
    assert sp.choose_budget(curve_of(saturating), decodes=64)[0] == 1024 + 64
    # 2 Zen 4 cores, SmolLM2-135M bf16 (a start-up's probe): 64 tokens are within 5% of 128's cost
    # per token; alone, a 64-token budget left a prompt 48 tokens a step beside 16 streams
    zen4 = [(32, 0.0233), (64, 0.0407), (128, 0.0782), (256, 0.1588)]
    budget, why = sp.choose_budget(zen4, decodes=64)
    assert budget == 128 and why.startswith("a 64-token prompt chunk (cost per token within 5%")


def test_the_latency_bound_counts_the_decodes_too():
    cost = lambda n: 0.05 + 0.0015 * n  # noqa: E731  # per token: 32 3.06 ms, 64 2.28, 128 1.89
    curve = curve_of(cost, sizes=(32, 64, 128))
    assert sp.choose_budget(curve, latency_bound=0.3)[0] == 128  # alone, 128 tokens take 0.242 s
    # 64 decodes on top: a 128-token chunk's step would take 0.363 s, over the bound; 64's 0.292 s is not
    budget, why = sp.choose_budget(curve, latency_bound=0.3, decodes=64)
    assert budget == 64 + 64 and "steps under 300 ms" in why


@pytest.mark.parametrize("seed", range(20))
def test_noisy_curve_stays_near_the_true_saturation_point(seed):
    noise = 0.03
    rng = random.Random(seed)
    curve = [(n, t * (1 + rng.uniform(-noise, noise))) for n, t in curve_of(saturating)]
    budget, _ = sp.choose_budget(curve)
    true_best = min(saturating(n) / n for n in SIZES)
    # noise can move the pick a size either way, never to a size far from saturation
    assert saturating(budget) / budget <= true_best * (1 + sp.SATURATION_TOLERANCE) * (1 + noise) / (1 - noise)
    assert budget in (512, 1024, 2048)
    assert sp.choose_budget(curve) == sp.choose_budget(list(reversed(curve)))  # order of the points does not matter


def test_no_measurements_is_an_error():
    with pytest.raises(ValueError):
        sp.choose_budget([])


# ---- the measurement loop ------------------------------------------------------------------------------


def test_measure_takes_the_fastest_repeat_after_a_warm_up():
    costs = iter([9.0, 0.3, 0.2, 0.5, 0.4, 0.45])  # warm-up, then two timed, per size
    now = [0.0]

    def forward(n):
        now[0] += next(costs)

    curve, _ = sp.measure_curve(forward, [32, 64], clock=lambda: now[0], time_budget=100, latency_bound=10)
    assert curve == [(32, pytest.approx(0.2)), (64, pytest.approx(0.4))]


def test_measure_stops_once_saturated():
    clock = FakeClock(saturating)
    curve, spent = sp.measure_curve(clock.forward, SIZES, clock=clock)
    # 1024 and 2048 each lower the best cost per token by under 5%: stop there
    assert [n for n, _ in curve] == list(SIZES)
    clock = FakeClock(lambda n: 0.0001 * n)  # flat from the start
    curve, _ = sp.measure_curve(clock.forward, SIZES, clock=clock)
    assert [n for n, _ in curve] == [32, 64, 128]


def test_measure_stops_at_the_first_size_over_the_latency_bound():
    clock = FakeClock(lambda n: 0.05 + 0.001 * n)  # 256 tokens: 0.306 s
    curve, _ = sp.measure_curve(clock.forward, SIZES, clock=clock, latency_bound=0.25, time_budget=100)
    assert [n for n, _ in curve] == [32, 64, 128, 256]
    assert sp.choose_budget(curve, latency_bound=0.25)[0] == 128


def test_measure_keeps_to_its_time_budget():
    clock = FakeClock(lambda n: 0.02 + 0.0004 * n)  # cost per token falls all the way
    curve, spent = sp.measure_curve(clock.forward, SIZES, clock=clock, time_budget=1.0, latency_bound=10)
    assert spent <= 1.0
    assert [n for n, _ in curve] == [32, 64, 128, 256]  # 512 would have taken 3 x 0.225 s more
    assert spent == clock.now


def test_a_slow_forward_counts_once_timed_again():
    clock = FakeClock(lambda n: 1.5)
    curve, spent = sp.measure_curve(clock.forward, SIZES, clock=clock, time_budget=2.0)
    assert curve == [(32, 1.5)] and clock.calls == [32, 32] and spent == 3.0


class FirstCallClock(FakeClock):
    """A forward whose first call at each kernel regime autotunes: 2.5 s
    more at the first call of up to 64 tokens and of more (the triton MoE's
    BLOCK_M 16 and 64, tuned once each)."""

    def __init__(self, cost):
        super().__init__(cost)
        self.tuned: set[bool] = set()

    def forward(self, n: int) -> None:
        regime = n > 64
        if regime not in self.tuned:
            self.tuned.add(regime)
            self.now += 2.5
        super().forward(n)


def test_autotuning_is_kept_out_of_the_timings_and_the_budget():
    """Before: the 32-token warm-up (autotune, > half the budget) was taken
    as its timing and ended the measurement: a budget of 32 + max_num_seqs."""
    clock = FirstCallClock(lambda n: 0.002 + 0.0001 * n)
    curve, spent = sp.measure_curve(clock.forward, SIZES, clock=clock)
    assert curve[0] == (32, pytest.approx(0.0052))
    assert [n for n, _ in curve][:4] == [32, 64, 128, 256]  # past the second regime's tuning too
    assert all(t < 0.25 for _, t in curve)
    assert spent == clock.now and spent > 5.0  # the wall time, tuning included, is still reported
    assert sp.choose_budget(curve, decodes=16)[0] > 32 + 16


def test_probe_sizes_fit_the_context_and_the_pool():
    assert sp.probe_sizes(4096, 10**6) == list(SIZES)
    assert sp.probe_sizes(1024, 10**6) == [32, 64, 128, 256, 512]  # a probe leaves room for a token
    assert sp.probe_sizes(4096, 300) == [32, 64, 128, 256]
    assert sp.probe_sizes(20, 10**6) == [19]


# ---- the plan -----------------------------------------------------------------------------------


class _Pool:
    num_pages, page_size = 1000, 16


def test_explicit_budget_skips_measurement():
    def forward(n):
        raise AssertionError("measured although an integer was given")

    plan = sp.plan_step(EngineConfig.from_kwargs(max_num_batched_tokens=300), kv=_Pool(), max_model_len=4096, forward=forward)
    assert (plan.max_num_batched_tokens, plan.source, plan.curve) == (300, "explicit", [])


def test_auto_measures_with_the_given_forward():
    clock = FakeClock(saturating)
    plan = sp.plan_step(EngineConfig(), kv=_Pool(), max_model_len=4096, forward=clock.forward, clock=clock)
    assert plan.source == "measured" and plan.max_num_batched_tokens == 1024 + 64  # a chunk, and max_num_seqs decodes
    assert plan.measure_s == clock.now
    d = plan.describe()
    assert d["curve"][0] == {"tokens": 32, "step_ms": 8.2, "us_per_token": 256.25}
    assert "step budget 1088 tokens (measured: a 1024-token prompt chunk" in plan.log_line() and "32:8.2ms" in plan.log_line()


def test_the_decodes_count_speculative_tokens():
    clock = FakeClock(lambda n: 0.0001 * n)
    cfg = EngineConfig.from_kwargs(max_num_seqs=40, speculative_method="ngram", num_speculative_tokens=3)
    plan = sp.plan_step(cfg, kv=_Pool(), max_model_len=4096, forward=clock.forward, clock=clock)
    assert plan.max_num_batched_tokens == 32 + 40 * (1 + 3)


def test_distributed_takes_the_default_without_measuring():
    plan = sp.plan_step(EngineConfig(), max_model_len=4096, distributed=True)
    assert (plan.max_num_batched_tokens, plan.source) == (DEFAULT_MAX_NUM_BATCHED_TOKENS, "default")
    plan = sp.plan_step(EngineConfig.from_kwargs(max_num_seqs=1000), max_model_len=4096, distributed=True)
    assert plan.max_num_batched_tokens == 1000


# ---- the option -----------------------------------------------------------------------------------


def test_option_parsing():
    assert EngineConfig().scheduler.max_num_batched_tokens == AUTO
    assert EngineConfig.from_kwargs(max_num_batched_tokens="Auto").scheduler.max_num_batched_tokens == AUTO
    assert EngineConfig.from_kwargs(max_num_batched_tokens="256").scheduler.max_num_batched_tokens == 256
    assert parse_token_budget(None) == AUTO
    for bad in (0, -3, "x", "1.5", 2.5):
        with pytest.raises(ConfigError):
            EngineConfig.from_kwargs(max_num_batched_tokens=bad)


def test_cli_flag_takes_auto_or_an_integer(capsys):
    from plinth.cli import add_config_arguments
    from plinth.plugins import PluginRegistry

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, PluginRegistry.discover(), command="serve", only=["max_num_batched_tokens"])
    assert parser.parse_args([]).max_num_batched_tokens == AUTO
    assert parser.parse_args(["--max-num-batched-tokens", "auto"]).max_num_batched_tokens == AUTO
    assert parser.parse_args(["--max-num-batched-tokens", "128"]).max_num_batched_tokens == 128
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-batched-tokens", "lots"])
    assert "integer >= 1 or 'auto'" in capsys.readouterr().err
