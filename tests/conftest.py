import os
import sys

import pytest

# test helpers beside the tests (pytest runs with --import-mode=importlib)
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """A folder for the tiny random-weight models (built once per session)."""
    return str(tmp_path_factory.mktemp("tiny-models"))


# ---- server tests (tests/test_server_*.py; helpers in tests/server_fixtures.py) ----


@pytest.fixture(scope="session")
def smollm2_async_engine():
    """One AsyncLLM over the real default model, shared by the server test modules."""
    from server_fixtures import smollm2_engine, smollm2_missing

    why = smollm2_missing()
    if why:
        pytest.skip(why)
    engine = smollm2_engine()
    yield engine
    engine.close()
