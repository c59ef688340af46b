"""Upstream dlinfer/framework/lmdeploy_ext/cudagraph/__init__.py (v0.2.7)
:1-17: the vendor's graph runner module is imported with the package."""
import importlib
from functools import lru_cache

from dlinfer.vendor import vendor_name

graph_vendor = ["ascend", "maca", "camb", "ppu"]


@lru_cache(1)
def import_vendor_module(vendor_name_str):
    if vendor_name_str in graph_vendor:
        importlib.import_module(f".{vendor_name_str}_cudagraph", __package__)


def vendor_graph_init():
    import_vendor_module(vendor_name)


vendor_graph_init()
