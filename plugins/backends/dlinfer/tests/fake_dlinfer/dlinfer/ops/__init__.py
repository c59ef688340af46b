"""Upstream dlinfer/ops/__init__.py:1-2."""
from .llm import *  # noqa: F401,F403
