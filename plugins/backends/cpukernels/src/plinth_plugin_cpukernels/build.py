"""`python -m plinth_plugin_cpukernels.build`: compile the kernels now (make
setup runs it, so the first `platform serve` does not wait for the compiler)."""

import sys
import time


def main() -> int:
    from plinth_plugin_cpukernels.kernels import compiler_missing, load_kernels

    missing = compiler_missing()
    if missing:
        print(f"cpukernels: not built: {missing}", file=sys.stderr)
        return 0  # the plugin then reports itself unavailable; the torch backend serves
    t = time.perf_counter()
    load_kernels()
    print(f"cpukernels: kernels ready ({time.perf_counter() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
