"""Upstream dlinfer/vendor/ascend/attention.py (v0.2.7): what plinth's tests
need of it is its import (:1-8): LMDeploy's graph runner, through
dlinfer.framework.lmdeploy_ext. decode_attention's eager branch is computed
by the fake's torch_npu_ops.paged_decode_attention (kernels); the graph
capture branches (:21-71) are not modelled."""
import math  # noqa: F401

import torch  # noqa: F401

from dlinfer.framework.lmdeploy_ext.cudagraph.ascend_cudagraph import (  # noqa: F401
    AscendGraphRunner,
    aclgraph_use_torch_npu_update,
    get_graph_params,
)
from dlinfer.utils.type_annotation import Optional, Tensor  # noqa: F401


def decode_attention(*args, **kwargs):
    raise NotImplementedError("the fake computes decode attention in torch_npu_ops.paged_decode_attention (kernels)")


def decode_attention_mla(*args, **kwargs):
    raise NotImplementedError("the fake dlinfer does not model decode_attention_mla (atb._npu_paged_attention_mla)")
