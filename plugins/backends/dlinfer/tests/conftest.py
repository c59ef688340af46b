"""The fake dlinfer (``fake_dlinfer/``) and the fake NPU accelerator
(``fake_npu/``) go on sys.path only inside the fixtures that ask for them,
so no other test in the same run sees either."""

from __future__ import annotations

import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).parent
FAKE_DLINFER = HERE / "fake_dlinfer"
FAKE_NPU = HERE / "fake_npu"
#: the names dlinfer-ascend imports from LMDeploy at import time (see fake_lmdeploy/)
FAKE_LMDEPLOY = HERE / "fake_lmdeploy"


def _forget_dlinfer() -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in ("dlinfer", "lmdeploy") or m.startswith("plinth_plugin_dlinfer.ops")]:
        del sys.modules[name]
    from plinth_plugin_dlinfer.backend import import_problem

    import_problem.cache_clear()  # the probe's answer belongs to the path it was asked with


@pytest.fixture
def fake_dlinfer(monkeypatch):
    """The fake dlinfer importable (and found by find_spec), with the fake
    lmdeploy it imports at import time."""
    monkeypatch.syspath_prepend(str(FAKE_LMDEPLOY))
    monkeypatch.syspath_prepend(str(FAKE_DLINFER))
    yield FAKE_DLINFER
    _forget_dlinfer()


@pytest.fixture
def fake_dlinfer_without_lmdeploy(monkeypatch):
    """The fake dlinfer alone: importing it fails as dlinfer-ascend 0.2.7 does without lmdeploy."""
    monkeypatch.syspath_prepend(str(FAKE_DLINFER))
    yield FAKE_DLINFER
    _forget_dlinfer()


@pytest.fixture
def fake_npu(monkeypatch, fake_dlinfer):
    """The fake dlinfer and the ``fakenpu`` accelerator: a registry that has it."""
    monkeypatch.syspath_prepend(str(FAKE_NPU))
    from plinth.testing import discover_all

    registry = discover_all()
    assert "fakenpu" in registry.names("accelerator"), "the fake NPU's entry point was not found"
    yield registry
    sys.modules.pop("plinth_test_fakenpu", None)
