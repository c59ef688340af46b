"""Step planning at a real start-up (a tiny model, the torch backend): the
default ``auto`` times the model and picks a budget within bounds; an
explicit budget skips the measurement. The choice logic itself is tested
with made-up curves in core/tests/test_step_plan.py."""

import logging

from plinth import LLM, SamplingParams
from plinth.engine import step_plan as sp
from tiny_models import tiny_model_dir


def _llm(path, **kw):
    return LLM(path, dtype="float32", backend="torch", load_progress=False, num_pages=300, max_num_seqs=8, **kw)


def test_auto_budget_is_measured_and_within_bounds(tiny_root, caplog):
    path = tiny_model_dir("llama", tiny_root)
    with caplog.at_level(logging.INFO, logger="plinth.startup"):
        llm = _llm(path)
    plan = llm.engine.components.step_plan
    assert plan.source == "measured"
    sizes = [n for n, _ in plan.curve]
    # probes fit the context (1024) and the pool (300 pages x 16 tokens)
    assert sizes and sizes == sorted(sizes) and set(sizes) <= {32, 64, 128, 256, 512}
    assert all(t > 0 for _, t in plan.curve)
    # a probed prompt chunk plus room for max_num_seqs (8) decodes
    assert plan.max_num_batched_tokens - 8 in sizes
    assert plan.measure_s < 3 * sp.MEASURE_TIME_BUDGET_S
    assert llm.engine.scheduler.max_num_batched_tokens == plan.max_num_batched_tokens
    # what start-up settled, frozen: the measured budget, the backend's mode, the pool
    r = llm.resolved
    assert (r.max_num_batched_tokens, r.backend, r.page_size, r.num_pages) == (plan.max_num_batched_tokens, "torch", 16, (300,))
    assert isinstance(r.deterministic, bool) and llm.engine.describe()["deterministic"] is r.deterministic
    assert llm.config.scheduler.max_num_batched_tokens == "auto"  # the setting as given stays as given
    assert llm.engine.components.describe()["step_plan"]["max_num_batched_tokens"] == plan.max_num_batched_tokens
    assert any("step budget" in r.getMessage() and "prefill step times" in r.getMessage() for r in caplog.records)
    # the probes gave every page back and left nothing in the prefix cache
    assert llm.engine.pages_held() == 0
    assert llm.engine.pool.num_free == 300
    out = llm.generate([[5, 6, 7] * 100], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.stats()["prefix_cache_hits"] == 0


def test_explicit_budget_skips_measurement(tiny_root, monkeypatch):
    path = tiny_model_dir("llama", tiny_root)

    def refuse(*a, **k):
        raise AssertionError("measured although a budget was given")

    monkeypatch.setattr(sp, "measure_curve", refuse)
    llm = _llm(path, max_num_batched_tokens=48)
    plan = llm.engine.components.step_plan
    assert (plan.source, plan.max_num_batched_tokens, plan.curve) == ("explicit", 48, [])
    assert llm.engine.scheduler.max_num_batched_tokens == 48
