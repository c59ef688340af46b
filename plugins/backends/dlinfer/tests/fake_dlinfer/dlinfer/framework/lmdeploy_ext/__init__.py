"""Upstream dlinfer/framework/lmdeploy_ext/__init__.py (v0.2.7) :2-6 imports
transformers_ext, torch_npu_ext, quants, cudagraph and device; the fake
models the one that reaches LMDeploy first, cudagraph (:5)."""
from . import cudagraph  # noqa: F401
