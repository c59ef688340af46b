import pathlib
import sys

# the driver next to the tests (pytest runs with --import-mode=importlib)
sys.path.insert(0, str(pathlib.Path(__file__).parent))
