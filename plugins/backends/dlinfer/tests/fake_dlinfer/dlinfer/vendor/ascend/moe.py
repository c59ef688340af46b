"""Upstream dlinfer/vendor/ascend/moe.py (v0.2.7): its imports (:1-4); the
naive one-rank path the fake models is computed in torch_npu_ops.fused_moe
(kernels); the mc2 and all2all paths (ep > 1 inside dlinfer) are not
modelled: plinth moves tokens between ranks with its a2a plugin."""
import numpy  # noqa: F401
import torch  # noqa: F401
import torch.distributed as dist  # noqa: F401

from dlinfer.utils.type_annotation import MoECommType  # noqa: F401
