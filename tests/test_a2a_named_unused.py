"""An a2a plugin named by ``--a2a`` that start-up will not use (ep=1, a
dense model) is reported at start-up with why, and with what its check()
says; where it would be used but cannot run, start-up refuses with its
check() reasons (nothing loaded). Through the engine: ``LLM(...)``."""

from __future__ import annotations

import logging

import pytest
import torch
from plinth.errors import PluginError
from tiny_models import tiny_model_dir

KW = dict(device="cpu", backend="torch", dtype="float32", num_pages=64, load_progress=False, max_num_batched_tokens=64)
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine: deepep's check() may pass")


def _warnings(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "plinth.startup")


@no_gpu
def test_a_named_a2a_at_ep1_is_reported_with_why(tiny_root, caplog):
    from plinth import LLM, SamplingParams

    path = tiny_model_dir("llama", tiny_root)
    with caplog.at_level(logging.INFO, logger="plinth.startup"):
        llm = LLM(path, a2a="deepep", **KW)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 2  # it serves: ep=1 needs no a2a
    finally:
        llm.close()
    text = _warnings(caplog)
    assert "a2a deepep" in text and "is not used: ep=1" in text, text
    assert "nor could it run here" in text and "deep_ep is not installed" in text, text


def test_auto_at_ep1_says_nothing(tiny_root, caplog):
    from plinth.engine.config import EngineConfig
    from plinth.engine.startup import check_a2a
    from plinth.plugins import PluginRegistry

    config = EngineConfig.from_kwargs(model=tiny_model_dir("llama", tiny_root))
    with caplog.at_level(logging.INFO, logger="plinth.startup"):
        assert check_a2a(config, PluginRegistry.discover()) is config
    assert "a2a" not in _warnings(caplog)


@no_gpu
def test_a_named_a2a_on_a_dense_model_is_reported_and_not_refused(tiny_root, caplog):
    """ep=2 on a dense model moves no token: deepep is not judged as if it
    would run (it would be refused here), only reported."""
    from plinth.engine.config import EngineConfig
    from plinth.engine.startup import check_a2a
    from plinth.plugins import PluginRegistry

    config = EngineConfig.from_kwargs(model=tiny_model_dir("llama", tiny_root), ep=2, dp=2, a2a="deepep", device="cpu")
    with caplog.at_level(logging.INFO, logger="plinth.startup"):
        assert check_a2a(config, PluginRegistry.discover()).parallel.a2a == "deepep"
    text = _warnings(caplog)
    assert "is not used: the model has no routed experts (a dense model)" in text and "deep_ep is not installed" in text, text


@no_gpu
def test_a_named_a2a_that_would_be_used_is_refused_with_its_reasons(tmp_path):
    """An MoE model at ep=2: deepep would move the tokens and cannot run here."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "plugins/models/llama/tests"))
    from plinth import LLM
    from tiny_moe import saved_model

    path = saved_model("qwen3moe", str(tmp_path))
    with pytest.raises(PluginError) as err:
        LLM(path, ep=2, a2a="deepep", **KW)
    assert "a2a deepep" in str(err.value) and "deep_ep is not installed" in str(err.value)
