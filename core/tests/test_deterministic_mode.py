"""Deterministic mode (``--deterministic``), the core's side: the flag's
plumbing into ``EngineConfig`` and every backend's ``SelectionContext``,
what `platform plugins` says each backend declines in the mode, and the
sampler computing each row the same alone or among others (bitwise)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from plinth.api import (  # noqa: E402
    BASE_OPS,
    Backend,
    BackendCapabilities,
    BackendDescriptor,
    PluginError,
    SelectionContext,
    hookimpl,
)
from plinth.cli import _details, build_parser, cmd_plugins, engine_kwargs  # noqa: E402
from plinth.engine.config import EngineConfig, setting_defaults  # noqa: E402

DEFAULT_DETERMINISTIC = setting_defaults()["deterministic"]
from plinth.engine.sampler import Sampler, SampleRow, filtered_probs, make_generator, process_logits  # noqa: E402
from plinth.engine.sampling_params import SamplingParams  # noqa: E402
from plinth.engine.startup import choose_backend, resolve_deterministic, resolve_ops  # noqa: E402
from plugin_fakes import accel, impl_module, plugin_module, registry_of  # noqa: E402

# ---- the flag ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_flag_reaches_the_engine_config_and_either_default_can_be_overridden(command: str) -> None:
    parser = build_parser(registry_of())
    extra = ["--prompt", "x"] if command == "generate" else []
    for flag, want in (([], DEFAULT_DETERMINISTIC), (["--deterministic"], True), (["--no-deterministic"], False)):
        args = parser.parse_args([command, *extra, *flag])
        kwargs = engine_kwargs(args)
        assert kwargs["deterministic"] is want and "deterministic" not in kwargs["plugin_options"]
        assert EngineConfig.from_kwargs(**kwargs).compute.deterministic is want
    assert EngineConfig().compute.deterministic is DEFAULT_DETERMINISTIC


def test_offline_bench_takes_the_flag() -> None:
    from plinth.bench.offline import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, registry_of())
    assert parser.parse_args([]).deterministic is DEFAULT_DETERMINISTIC
    assert parser.parse_args(["--deterministic"]).deterministic is True
    assert parser.parse_args(["--no-deterministic"]).deterministic is False


# ---- backends in the mode ------------------------------------------------------------------


def _any_ops(names):
    return {op: (lambda *a, op=op, **k: op) for op in names}


class _Reference(Backend):
    def ops(self):
        return _any_ops(BASE_OPS)


class _SplitsGemm(Backend):
    """A backend whose GEMM splits its reduction by the batch's rows: it declines it in the mode."""

    seen: list[bool] = []
    WHY = "its GEMM splits K by the number of rows"

    @classmethod
    def unsupported_ops(cls, ctx):
        return {"pack_linear": cls.WHY, "linear": cls.WHY} if ctx.deterministic else {}

    def ops(self):
        type(self).seen.append(self.ctx.deterministic)
        names = ("silu_and_mul",)
        return _any_ops(names if self.ctx.deterministic else (*names, "linear", "pack_linear"))


def _registry():
    impl_module().DetReference = _Reference
    impl_module().DetSplits = _SplitsGemm
    ref = BackendDescriptor(name="ref", impl=f"{impl_module().__name__}:DetReference", reference=True)
    mine = BackendDescriptor(name="splits", impl=f"{impl_module().__name__}:DetSplits", priority=5)
    hooks = {"plinth_register_backends": hookimpl(lambda: [ref, mine])}
    hooks["plinth_register_backends"].__name__ = "plinth_register_backends"
    return registry_of(("plinth-fake-det", "1.0", plugin_module("det", accel("detcpu"), **hooks)))


def test_the_mode_reaches_the_backend_and_what_it_declines_comes_from_the_reference() -> None:
    reg = _registry()
    for mode in (False, True):
        _SplitsGemm.seen.clear()
        _, sources = resolve_ops(reg, reg.get("backend", "splits"), SelectionContext(deterministic=mode))
        assert _SplitsGemm.seen == [mode]  # the backend built its table for the context's mode
        assert sources["silu_and_mul"] == "splits"
        assert sources["linear"] == sources["pack_linear"] == ("ref" if mode else "splits")


def test_plugins_shows_what_each_backend_declines_in_the_mode(capsys: pytest.CaptureFixture[str]) -> None:
    reg = _registry()
    args = build_parser(reg).parse_args(["plugins", "--json"])
    assert cmd_plugins(args, reg) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["plugins"] if r["category"] == "backend"}
    assert rows["splits"]["deterministic"] == {"float32": {"pack_linear": _SplitsGemm.WHY, "linear": _SplitsGemm.WHY}}
    assert rows["splits"]["unsupported_ops"] == {}  # outside the mode it declines nothing
    assert rows["ref"]["deterministic"] == {"float32": {}}
    args = build_parser(reg).parse_args(["plugins"])
    assert cmd_plugins(args, reg) == 0
    table = capsys.readouterr().out
    line = next(x for x in table.splitlines() if " splits " in x)
    assert f"--deterministic in float32: pack_linear, linear from the reference: {_SplitsGemm.WHY}" in line
    assert "--deterministic: every op batch-invariant" in next(x for x in table.splitlines() if " ref " in x)
    assert "every op batch-invariant" in _details({"reasons": [], "deterministic": {"bfloat16": {}, "float32": {}}})


# ---- the default: the backend's word -----------------------------------------------------------


class _CheapHere(Backend):
    """Declares its batch-invariant ops within 5% of its default ones on bfloat16."""

    @classmethod
    def capabilities(cls, ctx):
        cheap = str(ctx.dtype) == "torch.bfloat16"
        return BackendCapabilities(deterministic_default=cheap, deterministic_why="measured 1.01x" if cheap else "measured 1.4x")

    def ops(self):
        return _any_ops(BASE_OPS)


def test_an_unset_flag_follows_the_backend_and_a_set_one_wins() -> None:
    impl_module().DetCheap = _CheapHere
    entry = registry_of(
        ("plinth-fake-cheap", "1.0", plugin_module("cheap", accel("cheapcpu"), plinth_register_backends=_register(
            BackendDescriptor(name="cheap", impl=f"{impl_module().__name__}:DetCheap", reference=True))))
    ).get("backend", "cheap")
    bf16, fp32 = SelectionContext(dtype=torch.bfloat16), SelectionContext(dtype=torch.float32)
    assert resolve_deterministic(None, entry, bf16) == (True, "unset, so backend cheap's default: measured 1.01x")
    assert resolve_deterministic(None, entry, fp32) == (False, "unset, so backend cheap's default: measured 1.4x")
    assert resolve_deterministic(False, entry, bf16) == (False, "--no-deterministic")
    assert resolve_deterministic(True, entry, fp32) == (True, "--deterministic")
    assert "deterministic by default (measured 1.01x)" in _details({"reasons": [], "capabilities": {"bfloat16": {"deterministic_default": True, "deterministic_why": "measured 1.01x"}}})


class _RefusesInTheMode(Backend):
    """Cheap here in the mode's numbers (its default turns it on), yet with
    no batch-invariant GEMM: its check() refuses the mode."""

    WHY = "no batch-invariant GEMM"

    @classmethod
    def check(cls, ctx):
        return [cls.WHY] if ctx.deterministic else []

    @classmethod
    def capabilities(cls, ctx):
        return BackendCapabilities(deterministic_default=True, deterministic_why="measured 1.01x")

    def ops(self):
        return _any_ops(BASE_OPS)


def test_a_backend_is_judged_in_the_mode_it_would_run_in() -> None:
    """The mode is settled with the backend (``choose_backend``): each
    candidate is judged in the mode it would run in, never selected with the
    mode off and then run with it on."""
    impl_module().DetRefuses = _RefusesInTheMode
    impl_module().DetReference = _Reference
    reg = registry_of(
        ("plinth-fake-modes", "1.0", plugin_module("modes", accel("modecpu"), plinth_register_backends=_register(
            BackendDescriptor(name="eager", impl=f"{impl_module().__name__}:DetRefuses", priority=9),
            BackendDescriptor(name="ref", impl=f"{impl_module().__name__}:DetReference", reference=True))))
    )  # fmt: skip
    ctx = SelectionContext(dtype=torch.bfloat16)
    unset = choose_backend(reg, "auto", None, ctx)  # eager would run deterministic, which it refuses: the reference
    assert (unset.entry.name, unset.deterministic) == ("ref", False)
    off = choose_backend(reg, "auto", False, ctx)
    assert (off.entry.name, off.deterministic, off.why) == ("eager", False, "--no-deterministic")
    with pytest.raises(PluginError, match=_RefusesInTheMode.WHY):
        choose_backend(reg, "eager", None, ctx)


def _register(*descriptors):
    hook = hookimpl(lambda: list(descriptors))
    hook.__name__ = "plinth_register_backends"
    return hook


# ---- the sampler, per row --------------------------------------------------------------------


def _rows(params: list[SamplingParams], prompts, outputs) -> list[SampleRow]:
    return [
        SampleRow(params=p, prompt_ids=pr, output_ids=o, generator=make_generator(p.seed))
        for p, pr, o in zip(params, prompts, outputs)
    ]


def _workload(n: int, vocab: int):
    """Rows with every processor on: penalties, bias, temperature, top-k, top-p, min-p, seeds."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, vocab, generator=g) * 3
    params, prompts, outputs = [], [], []
    for i in range(n):
        params.append(
            SamplingParams(
                temperature=[0.0, 0.7, 1.0, 1.3][i % 4], top_p=[1.0, 0.9, 0.5, 0.97][(i // 2) % 4],
                top_k=[-1, 50, 7][i % 3], min_p=[0.0, 0.05][i % 2], repetition_penalty=[1.0, 1.2][(i // 3) % 2],
                frequency_penalty=[0.0, 0.4][i % 2], presence_penalty=[0.0, 0.3][(i // 2) % 2],
                logit_bias={5: 2.0} if i % 5 == 0 else None, seed=100 + i,
            )
        )
        prompts.append(torch.randint(0, vocab, (3 + i,), generator=g).tolist())
        outputs.append(torch.randint(0, vocab, (i % 6,), generator=g).tolist())
    return logits, params, prompts, outputs


def test_each_row_is_processed_and_sampled_the_same_alone_and_among_others() -> None:
    n, vocab = 12, 4096
    logits, params, prompts, outputs = _workload(n, vocab)
    sampler = Sampler()
    rows = _rows(params, prompts, outputs)
    batched = process_logits(logits.clone(), rows)
    rand = [i for i in range(n) if not params[i].greedy]
    probs = filtered_probs(batched, rows, rand)
    tokens = [sampler(logits.clone(), _rows(params, prompts, outputs))[0] for _ in range(1)][0]
    for i in range(n):
        alone_rows = _rows(params[i : i + 1], prompts[i : i + 1], outputs[i : i + 1])
        alone = process_logits(logits[i : i + 1].clone(), alone_rows)
        assert torch.equal(alone[0], batched[i]), i
        if i in rand:
            assert torch.equal(filtered_probs(alone, alone_rows, [0])[0], probs[rand.index(i)]), i
        # a fresh generator of the same seed: the row's draw is its own, whatever its neighbours drew
        assert sampler(logits[i : i + 1].clone(), _rows(params[i : i + 1], prompts[i : i + 1], outputs[i : i + 1]))[0] == [tokens[i]]
    # and in another order, among other rows
    order = list(reversed(range(n)))
    shuffled = sampler(logits[order].clone(), _rows([params[j] for j in order], [prompts[j] for j in order], [outputs[j] for j in order]))[0]
    assert [shuffled[order.index(i)] for i in range(n)] == tokens


def test_top_p_cut_of_a_row_does_not_follow_the_batchs_widest_band() -> None:
    """Top-p packs each row's band of candidates to the batch's widest: a
    flat row beside a peaked one (and the reverse) keeps the same tokens."""
    vocab = 2048
    flat = torch.zeros(1, vocab)
    flat[0, :10] += torch.linspace(0, 0.01, 10)  # nearly all tokens in one band
    peaked = torch.full((1, vocab), -20.0)
    peaked[0, :3] = torch.tensor([5.0, 4.0, 3.9])
    p = SamplingParams(temperature=1.0, top_p=0.8)
    for row, other in ((flat, peaked), (peaked, flat)):
        alone = filtered_probs(row.clone(), _rows([p], [[]], [[]]), [0])
        both = filtered_probs(torch.cat([row, other]), _rows([p, p], [[], []], [[], []]), [0, 1])
        assert torch.equal(alone[0], both[0])
