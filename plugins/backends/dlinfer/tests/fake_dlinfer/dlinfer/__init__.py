"""A fake of DeepLink-org/dlinfer for plinth's tests (never installed by default).

Same module paths, function signatures, defaults and return values as
upstream (read at a50184e3734e5799bd4cec484d3a2ac46a36ae86, dlinfer 0.2.8);
each vendor op computes in torch, on the tensor layouts the Ascend kernels
read and write, and asserts what the vendor code asserts. A test puts this
folder on ``sys.path``.

Upstream dlinfer/__init__.py:1-5: importing dlinfer initialises the vendor.
"""
import dlinfer.vendor as vendor

vendor.vendor_torch_init()
__version__ = "0.2.8"
