"""Upstream dlinfer/vendor/__init__.py:1-29: the vendor named in vendor.yaml
(written by setup.py at build time) registers its ops in
``vendor_ops_registry`` when dlinfer is imported."""
import importlib
from functools import lru_cache
from pathlib import Path

import torch
import yaml

vendor_ops_registry = dict()
vendor_is_initialized = False
vendor_name_file = Path(__file__).parent / "vendor.yaml"


with open(str(vendor_name_file)) as f:
    config = yaml.safe_load(f)
    vendor_name = config["vendor"]
    dispatch_key = config["dispatch_key"]


@lru_cache(1)
def import_vendor_module(vendor_name_str):
    return importlib.import_module(f".{vendor_name_str}", __package__)


def vendor_torch_init():
    import_vendor_module(vendor_name)
    global vendor_is_initialized
    vendor_is_initialized = True
    global linear_w8a8_scale_type, dynamic_quant_scale_type
    linear_w8a8_scale_type = torch.Tensor if vendor_name in ["ascend"] else float
    dynamic_quant_scale_type = torch.Tensor if vendor_name in ["ascend"] else float
