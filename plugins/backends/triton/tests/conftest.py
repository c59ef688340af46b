"""The kernels run in Triton's interpreter on CPU tensors here: the variable
must be set before the first @triton.jit function runs (before the plugin's
modules are imported)."""

import os
import pathlib
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(pathlib.Path(__file__).parent))
