import os
import sys

import pytest

# test helpers beside the tests (pytest runs with --import-mode=importlib)
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """A folder for the tiny random-weight models (built once per session)."""
    return str(tmp_path_factory.mktemp("tiny-models"))
