"""Upstream dlinfer/framework/lmdeploy_ext/cudagraph/ascend_cudagraph.py
(v0.2.7): its imports from LMDeploy at import time (:14-21), which fail
without lmdeploy installed; ``import torch_npu`` (:10) is not modelled (the
fake NPU stands in for it). The graph runner itself is not modelled: plinth
runs eager, so ``AscendGraphRunner.capturing`` stays False."""
import functools

import torch  # noqa: F401
from lmdeploy.pytorch.backends.graph_runner import GraphRunner
from lmdeploy.pytorch.config import BackendConfig, CacheConfig, ModelConfig  # noqa: F401
from lmdeploy.pytorch.model_inputs import (  # noqa: F401,F811
    StepContext,
    get_step_ctx_manager,  # noqa: F401
)
from lmdeploy.pytorch.models.utils.cudagraph import (
    CudaGraphMeta,  # noqa: F401
    CudaGraphMixin,  # noqa: F401
)
from lmdeploy.utils import get_logger

logger = get_logger("dlinfer")


@functools.lru_cache
def aclgraph_use_torch_npu_update():
    return False  # :28-37 compares torch_npu's version; the fake has no torch_npu


class AscendGraphRunner(GraphRunner):
    capturing = False


def get_graph_params():
    raise NotImplementedError("graph capture is not modelled")
