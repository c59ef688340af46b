"""Upstream dlinfer/vendor/ascend/__init__.py:1-5 imports pytorch_patch and
torch_npu_ops (which registers the ops)."""
from . import torch_npu_ops  # noqa: F401
