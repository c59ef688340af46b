"""Upstream dlinfer/vendor/ascend/__init__.py (v0.2.7) :5 imports
pytorch_patch and torch_npu_ops (which registers the ops and imports the
attention and moe modules); pytorch_patch (torch_npu's patches of torch) is
not modelled."""
from . import torch_npu_ops  # noqa: F401
