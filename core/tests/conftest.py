import os
import sys

# test helpers beside the tests (pytest runs with --import-mode=importlib)
sys.path.insert(0, os.path.dirname(__file__))
