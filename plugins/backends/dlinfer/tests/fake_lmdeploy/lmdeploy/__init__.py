"""A fake of the names dlinfer-ascend imports from LMDeploy at import time
(dlinfer v0.2.7 framework/lmdeploy_ext/cudagraph/ascend_cudagraph.py:14-21):
the module paths and names only, no behaviour (plinth calls none of them).
Tests put this folder on sys.path beside the fake dlinfer; without it,
``import dlinfer`` fails as the real one does without lmdeploy."""
__version__ = "0.13.0"
